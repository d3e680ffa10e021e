"""What lies under podman, read directly: a container's exit status as conmon writes it
(:func:`container_exit_code`), and forgeflow's containers at every layer, found and ended after a
crash (:func:`find_leftovers`, :func:`sweep_containers`): podman's records (and its storage's), the
OCI runtime's containers (runc), conmon processes. A SIGKILLed ``podman run`` can leave a runc
container in state "created" with its conmon while ``podman ps -a`` lists nothing (issue 33);
forgeflow knows its own by name: the ``-n`` of a conmon's command line, and the
:data:`NAME_ANNOTATION` that :class:`~forgeflow.sandbox.podman.PodmanSandbox` gives every container
(kept in the runtime's bundle)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.settings import tool_env

_EXIT_DIRS: dict[str, Path] = {}
"""conmon's ``--exit-dir`` (where it writes a container's exit status), found once per process."""


def _exit_dir(container_id: str) -> Path | None:
    """The folder conmon writes ``container_id``'s exit status to (its ``--exit-dir``, e.g.
    ``/run/libpod/exits`` for root), read from its command line once and then remembered."""
    if "dir" not in _EXIT_DIRS and container_id:
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
            except OSError:
                continue
            if argv and argv[0].endswith(b"conmon") and container_id.encode() in argv and b"--exit-dir" in argv:
                _EXIT_DIRS["dir"] = Path(argv[argv.index(b"--exit-dir") + 1].decode())
                break
    return _EXIT_DIRS.get("dir")


def container_exit_code(proc: "subprocess.Popen[bytes]", container_id: str, limit_s: float = 120) -> int | None:
    """The exit status of a ``podman run`` container whose process is ending: what conmon writes to
    its exit file (``<exit dir>/<container id>``) the moment it reaps the container's process, which
    is also what ``podman run`` exits with, but before ``--rm`` has removed the container (0.1-0.3 s
    sooner). Where that file cannot be found, ``podman run``'s own exit status. None if neither
    comes within ``limit_s`` seconds."""
    exit_dir = _exit_dir(container_id)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if exit_dir is not None:
            with contextlib.suppress(OSError, ValueError):
                return int((exit_dir / container_id).read_text().strip())
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.005)
    return None


NAME_ANNOTATION = "dev.forgeflow.name"
"""OCI annotation naming a forgeflow container (``podman run --annotation``): the runtime keeps it in
the container's bundle (``runc list --format json`` shows it), so a container is known as forgeflow's
by its name even where podman's record of it is gone."""


class Leftovers(BaseModel):
    """What is left of some of forgeflow's containers, layer by layer."""

    model_config = ConfigDict(frozen=True)

    podman: tuple[str, ...] = Field((),
                                    description="names podman lists (podman ps -a --external: its records and its "
                                                "storage's).")
    runtime: tuple[tuple[str, str, str], ...] = Field(
        (),
        description="(runtime root, container id, name) of the OCI runtime's containers (runc --root ROOT list) "
                    "whose annotation or conmon names one of them.")
    conmon: tuple[tuple[int, str], ...] = Field(
        (),
        description="(pid, name) of conmon processes whose command line names one of them (-n).")

    def empty(self) -> bool:
        """True when nothing is left at any layer."""
        return not (self.podman or self.runtime or self.conmon)


class _Conmon(NamedTuple):
    pid: int
    name: str
    container_id: str
    runtime: str
    runtime_root: str | None


def _conmons() -> list[_Conmon]:
    """The conmon processes on this host, read from ``/proc/<pid>/cmdline`` (``-n`` name, ``-c`` id,
    ``-r`` runtime, ``--runtime-arg --root=...``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode("utf-8", errors="replace").split("\0")
        except OSError:
            continue
        if not argv or Path(argv[0]).name != "conmon":
            continue
        opts: dict[str, str] = {}
        root = None
        for flag, value in zip(argv, argv[1:]):
            if flag in ("-n", "--name", "-c", "--cid", "-r", "--runtime"):
                opts[flag.lstrip("-")[0]] = value
            if flag in ("--runtime-arg",) and value.startswith("--root="):
                root = value.split("=", 1)[1]
        if "n" in opts:
            found.append(_Conmon(int(entry.name), opts["n"], opts.get("c", ""), opts.get("r", "runc"), root))
    return found


def _runtime_roots(conmons: list[_Conmon]) -> dict[str, str]:
    """State roots of the OCI runtime to list, each with the runtime binary: runc's default root for
    this user (``/run/runc`` for root, ``$XDG_RUNTIME_DIR/runc`` otherwise) and every root a conmon
    passes to its runtime (``--runtime-arg --root=...``)."""
    runc = shutil.which("runc")
    default = "/run/runc" if os.geteuid() == 0 else f"{os.environ.get('XDG_RUNTIME_DIR', '/tmp')}/runc"
    roots = {default: runc} if runc else {}
    for c in conmons:
        if Path(c.runtime).name == "runc":
            roots.setdefault(c.runtime_root or default, shutil.which(c.runtime) or c.runtime)
    return roots


def _runtime_containers(runtime: str, root: str) -> list[dict]:
    """``runc --root ROOT list --format json`` (id, pid, status, bundle, annotations); [] if none."""
    if not Path(root).is_dir():
        return []
    proc = subprocess.run([runtime, "--root", root, "list", "--format", "json"], capture_output=True, text=True,
                          timeout=60)
    try:
        return json.loads(proc.stdout) or [] if proc.returncode == 0 else []
    except json.JSONDecodeError:
        return []


def find_leftovers(match: Callable[[str], bool]) -> Leftovers:
    """Every container of forgeflow's whose name ``match`` accepts, at each layer: podman's records (and its
    storage's), the OCI runtime's containers, conmon processes."""
    listed = subprocess.run(["podman", "ps", "-a", "--external", "--format", "{{.Names}}"], capture_output=True,
                            text=True, env=tool_env(), timeout=60)
    podman = tuple(sorted({n for n in listed.stdout.split() if match(n)}))
    conmons = _conmons()
    by_id = {c.container_id: c.name for c in conmons}
    runtime = []
    for root, binary in sorted(_runtime_roots(conmons).items()):
        for ctr in _runtime_containers(binary, root):
            name = (ctr.get("annotations") or {}).get(NAME_ANNOTATION) or by_id.get(ctr.get("id", ""), "")
            if name and match(name):
                runtime.append((root, ctr["id"], name))
    return Leftovers(podman=podman, runtime=tuple(runtime),
                     conmon=tuple(sorted((c.pid, c.name) for c in conmons if match(c.name))))


def sweep_containers(match: Callable[[str], bool]) -> Leftovers:
    """End every container of forgeflow's whose name ``match`` accepts at every layer; returns what was found.

    ``runc kill`` / ``runc delete --force`` too: a container left "created" by a SIGKILLed ``podman run`` is
    invisible to ``podman ps``."""
    found = find_leftovers(match)
    if found.podman:
        subprocess.run(["podman", "rm", "-f", "-t", "0", *found.podman], capture_output=True, text=True,
                       env=tool_env(), timeout=120)
    runtimes = _runtime_roots(_conmons())
    for root, container_id, _ in found.runtime:
        runc = runtimes.get(root) or shutil.which("runc") or "runc"
        subprocess.run([runc, "--root", root, "kill", container_id, "KILL"], capture_output=True, timeout=60)
        subprocess.run([runc, "--root", root, "delete", "--force", container_id], capture_output=True, timeout=60)
    for pid, _ in found.conmon:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if found.runtime or found.conmon:
        # podman's storage may still hold the orphan's layer under the name
        names = sorted({name for *_, name in found.runtime} | {name for _, name in found.conmon})
        subprocess.run(["podman", "rm", "-f", "-t", "0", *names], capture_output=True, text=True, env=tool_env(),
                       timeout=120)
    return found


def end_orphans(name: str) -> None:
    """Before a container named ``name`` starts: end one left under that name that podman may no
    longer list (a conmon naming it: a SIGKILLed ``podman run`` can leave its runtime container in
    state "created" with its conmon and no podman record). Reading ``/proc`` only when none is left."""
    if any(c.name == name for c in _conmons()):
        sweep_containers(lambda n: n == name)


def sweep_labelled(key: str, value: str) -> Leftovers:
    """End every container labelled ``key=value`` at every layer (names from podman's records and from the runtime's
    annotations, which survive podman's record); returns what was found."""
    listed = subprocess.run(["podman", "ps", "-a", "--filter", f"label={key}={value}", "--format", "{{.Names}}"],
                            capture_output=True, text=True, env=tool_env(), timeout=60)
    names = set(listed.stdout.split())
    for root, binary in sorted(_runtime_roots(_conmons()).items()):
        for ctr in _runtime_containers(binary, root):
            annotations = ctr.get("annotations") or {}
            if annotations.get(key) == value and annotations.get(NAME_ANNOTATION):
                names.add(annotations[NAME_ANNOTATION])
    return sweep_containers(names.__contains__) if names else Leftovers()
