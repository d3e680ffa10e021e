"""An agent's work tree, copied out of its container where the agent has no hand, and into a verifier's.

The agent controls everything inside its own container: the git binary, ``.git/config`` (external
diff drivers, aliases), ``PATH``, background processes. So its submission is not taken by running
anything there: the container is stopped (no agent process runs on), its root file system is mounted
on the host by podman (``podman mount``) and the host's own ``tar`` archives ``/testbed`` without its
``.git`` (symbolic links archived as links, never followed). The verifier puts that tree in place in
a fresh container of the pristine task image and asks git there what changed
(:mod:`forgeflow.sandbox.changes`).

Backends: podman (rootful: ``podman mount`` needs root or ``podman unshare``), and Kubernetes, which
has no host-side view of a pod's file system: there the agent's pod carries a second container from
the same pristine image that only sleeps, the repository on a volume both mount
(:func:`forgeflow.sandbox.kubernetes_manifests.render_trial_pod` with ``tree_repo``), and the same
``tar`` (:func:`tree_tar_argv`) runs in that container
(:meth:`forgeflow.sandbox.kubernetes.KubernetesSandbox.export_tree`): its binaries are the image's,
and the agent's container shares no process namespace with it. Both are bounded by
:data:`TREE_MAX_BYTES`; a container or pod gone before its tree is taken is a SandboxError.
"""

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
    """The ``tar`` that archives an agent's tree: ``root`` without its ``.git``, every member owned by
    0:0 (the verifier extracts with ``--no-same-owner``; a host-side view of a container in a user
    namespace would otherwise record shifted host ids, so both backends give the same archive), links
    archived as links (never followed), files unreadable or removed while read skipped with a warning
    (``--ignore-failed-read``: they are not part of the submission) rather than failing the archive.

    Args:
        root: the repository directory (``/testbed``, or where podman mounted it on the host).

    Returns:
        The argv; the archive goes to stdout, members relative to ``root`` (``./calc.py``, ...).
    """
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
    """Stop ``container`` and copy ``repo`` out of it (without ``.git``) as a tar archive, from the host.

    Args:
        container: the podman container's name (the agent's).
        repo: the repository inside it.
        max_bytes: the most bytes of tar taken.

    Returns:
        The tar archive (members relative to ``repo``: ``./calc.py``, ...).

    Raises:
        SandboxError: the container is gone (removed by an operator, conmon or the runtime: an
            infrastructure fault, never the agent's) or podman could not mount it.
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

