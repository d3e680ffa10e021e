"""Fixtures of the resilience suite: free loopback ports, process lookups by command line, and a
small task image (the base image plus a ``/testbed`` of escape attempts) for sandbox tests."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeflow.common.settings import tool_env
from tests.helpers import free_port, pid_alive  # noqa: F401 - re-exported to the resilience tests

TESTBED_DIR = Path(__file__).resolve().parent / "testbed"
"""The escape-attempt test files copied to ``/testbed`` of the sandbox test image."""

collect_ignore = ["testbed"]  # they run inside the sandbox, never on the host




def cmdline(pid: int) -> list[str]:
    """argv of a live process, empty when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]




def pids_matching(*needles: str) -> list[int]:
    """PIDs of live processes whose argv contains every one of ``needles`` as an element."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = cmdline(int(entry.name))
            if argv and all(n in argv for n in needles) and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return sorted(found)


def _podman(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(["podman", *args], env=tool_env(), capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == 0, f"podman {args}: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="session")
def escape_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``FROM`` the forgeflow base image (Debian python3 + pytest), ``COPY testbed /testbed``;
    tagged by the content digest of the test files and removed at the end of the session."""
    from forgeflow.registry.images import ensure_base_image

    base = ensure_base_image().name
    digest = hashlib.sha256()
    for path in sorted(TESTBED_DIR.rglob("*.py")):
        digest.update(path.relative_to(TESTBED_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    # one tag per xdist worker: a worker removes its own at the end while another may still run from its own
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    tag = f"localhost/forgeflow-test/resilience-escape:{digest.hexdigest()[:12]}-{worker}"
    context = tmp_path_factory.mktemp("escape-image")
    shutil.copytree(TESTBED_DIR, context / "testbed", ignore=shutil.ignore_patterns("__pycache__"))
    (context / "Containerfile").write_text(f"FROM {base}\nCOPY testbed /testbed\n")
    _podman("build", "--pull=never", "--network=none", "-q", "-t", tag, "-f", "Containerfile", ".",
            cwd=context)
    try:
        yield tag
    finally:
        subprocess.run(["podman", "rmi", "--force", tag], env=tool_env(), capture_output=True, timeout=120)

