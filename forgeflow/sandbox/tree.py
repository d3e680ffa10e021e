"""An agent's work tree, copied out of its container where the agent has no hand, and into a verifier's.

The agent controls its container (git, ``.git/config``, ``PATH``, background processes), so nothing runs
there: the stopped container is mounted on the host (``podman mount``, rootful) and the host's ``tar`` takes
``/testbed`` without ``.git``; on Kubernetes the same ``tar`` runs in a sidecar of the pristine image."""

from __future__ import annotations

import subprocess
from pathlib import Path

from forgeflow.common import errors
from forgeflow.common.settings import tool_env

__all__ = ["TREE_MAX_BYTES", "TREE_TIMEOUT_S", "TreeTooLargeError", "export_tree", "container_exists",
           "tree_tar_argv"]

TREE_MAX_BYTES = 512 * 1024 * 1024
"""Largest agent tree copied out (bytes of tar): more is the agent's outcome (it wrote that much)."""

TREE_TIMEOUT_S = 600.0
"""Seconds the ``tar`` of an agent's tree may take in a pod's tree sidecar (a tree that takes longer is
the agent's outcome, as one over :data:`TREE_MAX_BYTES`)."""


def tree_tar_argv(root: str) -> list[str]:
    """The ``tar`` argv that archives ``root`` to stdout without its ``.git``: members owned by 0:0 (so both
    backends give the same archive), links never followed, unreadable files skipped (``--ignore-failed-read``)."""
    return ["tar", "-C", root, "--exclude=./.git", "--numeric-owner", "--owner=0", "--group=0", "--ignore-failed-read",
            "-cf", "-", "."]


class TreeTooLargeError(errors.InputError):
    """The agent's tree is over :data:`TREE_MAX_BYTES` (its own doing: the trial's outcome, reward 0)."""


def container_exists(name: str) -> bool:
    """Whether podman still has a container called ``name`` (``podman container exists``).

    Raises:
        ToolMissingError: podman is not installed.
    """
    try:
        proc = subprocess.run(["podman", "container", "exists", name], capture_output=True, env=tool_env(),
                              timeout=60)
    except FileNotFoundError as exc:
        raise errors.ToolMissingError("podman is not installed (apt-get install podman)") from exc
    return proc.returncode == 0


def _podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=tool_env(), timeout=timeout_s)


def export_tree(container: str, repo: str = "/testbed", max_bytes: int = TREE_MAX_BYTES) -> bytes:
    """Stop ``container`` and copy ``repo`` out of it (without ``.git``) as a tar archive of at most ``max_bytes``.

    Raises:
        SandboxError: the container is gone (an infrastructure fault, never the agent's) or cannot be mounted.
        TreeTooLargeError: the tree is over ``max_bytes``.
    """
    if not container_exists(container):
        raise errors.SandboxError(f"the agent's container {container} vanished before its tree was taken "
                                  "(evidence: podman container exists says it is gone)")
    _podman("stop", "-t", "0", container)
    mounted = _podman("mount", container)
    if mounted.returncode != 0:
        gone = not container_exists(container)
        raise errors.SandboxError(f"could not mount the agent's container {container}"
                                  f"{' (it vanished)' if gone else ''}: {mounted.stderr.strip()[-300:]}")
    try:
        root = Path(mounted.stdout.strip()) / repo.lstrip("/")
        if not root.is_dir() or root.is_symlink():
            raise errors.SandboxError(f"the agent's container {container} has no directory {repo}")
        proc = subprocess.Popen(tree_tar_argv(str(root)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        data = proc.stdout.read(max_bytes + 1)
        if len(data) > max_bytes:
            proc.kill()
            proc.wait()
            raise TreeTooLargeError(f"the agent's tree {repo} is over {max_bytes} bytes of tar")
        err = proc.stderr.read().decode("utf-8", errors="replace")
        if proc.wait() not in (0, 1):  # 1: a file changed while read (nothing runs: not expected)
            raise errors.SandboxError(f"tar of the agent's tree failed: {err.strip()[-300:]}")
        return data
    finally:
        _podman("unmount", container)

