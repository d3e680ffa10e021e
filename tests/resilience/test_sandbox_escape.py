"""Sandbox escapes with real podman containers: network, writes outside the workdir, a fork bomb and
a memory hog. Each ends as a verifier failure (the task's own tests fail) or as the right
exception on the trial (never a reward), and the host is left as it was.

The task image is the forgeflow base image plus ``tests/resilience/testbed`` at ``/testbed``.
"""

from __future__ import annotations

import re
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.common.settings import tool_env
from forgeflow.sandbox.base import DEFAULT_PIDS_LIMIT, SandboxSpec
from forgeflow.sandbox.podman import PodmanSandbox
from forgeflow.sandbox.trial import validate_candidate, verify

pytestmark = pytest.mark.integration

PYTEST = "python3 -m pytest -rA -p no:cacheprovider"


@dataclass(frozen=True)
class _Task:
    """What validation reads of a task: its id and its bug patch (unused by a failing NOP)."""

    instance_id: str
    patch: str = ""


def _host_ipv4s() -> list[str]:
    """Every IPv4 address of this host's interfaces (local /32 entries of /proc/net/fib_trie)."""
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    found = {"127.0.0.1"}
    for previous, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line:
            match = re.search(r"(\d+\.\d+\.\d+\.\d+)", previous)
            if match:
                found.add(match.group(1))
    return sorted(found)


def _containers_named(name: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env=tool_env(),
                         capture_output=True, text=True, timeout=60).stdout.split()
    return [n for n in out if n == name]


def test_network_attempt_is_a_verifier_failure_and_the_host_listener_sees_nothing(escape_image: str) -> None:
    # podman's bridge gateway and slirp's host alias, beside every address of the host itself
    addresses = _host_ipv4s() + ["10.88.0.1", "10.0.2.2"]
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(16)
        listener.settimeout(0)
        port = listener.getsockname()[1]
        # control: from the host, the listener is reachable on every host address
        for address in _host_ipv4s():
            socket.create_connection((address, port), timeout=3).close()
            listener.accept()[0].close()

        with PodmanSandbox(escape_image, SandboxSpec(memory_mb=256)) as sandbox:
            result = verify(sandbox, f"FF_HOST_PORT={port} FF_HOST_ADDRS={','.join(addresses)} "
                                     f"{PYTEST} --tb=line tests/test_network.py", timeout_s=60)
            pids_max = sandbox.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max",
                                    timeout_s=30).stdout.strip()
        with pytest.raises(BlockingIOError):  # no connection reached the host
            listener.accept()

    assert result.exit_code == 1
    assert len(result.tests) == len(addresses) + 2
    assert set(result.tests.values()) == {"FAILED"}, result.tests
    assert "Network is unreachable" in result.log_tail  # no route: the container has only lo
    assert "Connection refused" in result.log_tail  # 127.0.0.1 is the container's own loopback
    assert pids_max == str(DEFAULT_PIDS_LIMIT) == "1024"  # every sandbox gets the default pids limit


def test_writes_outside_the_workdir_stay_in_the_container(escape_image: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "host-owned.txt"
    sentinel.write_text("host content\n")
    before = sentinel.stat()
    image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", escape_image],
                              env=tool_env(), capture_output=True, text=True, timeout=60).stdout.strip()

    with PodmanSandbox(escape_image, SandboxSpec(memory_mb=256)) as sandbox:
        result = verify(sandbox, f"FF_HOST_FILE={sentinel} {PYTEST} tests/test_write.py", timeout_s=60)
        changed = subprocess.run(["podman", "diff", sandbox.name], env=tool_env(), capture_output=True,
                                 text=True, timeout=60).stdout.splitlines()

    # inside the container the writes succeeded; mounting did not (no CAP_SYS_ADMIN)
    assert result.tests == {
        "tests/test_write.py::test_overwrite_host_path": "PASSED",
        "tests/test_write.py::test_write_system_file": "PASSED",
        "tests/test_write.py::test_mount_host_filesystem": "FAILED",
    }
    # ... and they live in the container's own layer
    assert f"A {sentinel}" in changed and "A /etc/ff-escape" in changed and "D /usr/bin/python3" in changed
    # the host file is untouched (same inode, bytes and mtime) and nothing appeared on the host
    after = sentinel.stat()
    assert sentinel.read_text() == "host content\n"
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert not Path("/etc/ff-escape").exists()
    # the image is unchanged: a fresh container sees none of it
    assert subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", escape_image], env=tool_env(),
                          capture_output=True, text=True, timeout=60).stdout.strip() == image_id
    with PodmanSandbox(escape_image, SandboxSpec(memory_mb=256)) as fresh:
        probe = fresh.exec(f"test -e {sentinel} || test -e /etc/ff-escape || echo clean; "
                           "test -x /usr/bin/python3 && echo python-present", timeout_s=30)
    assert probe.stdout.split() == ["clean", "python-present"]


def test_fork_bomb_hits_the_pids_limit_and_is_an_exception_not_a_reward(escape_image: str) -> None:
    run_key = uuid.uuid4().hex
    bomb = "bash -c 'bomb() { bomb | bomb & }; bomb'; sleep 1"
    outcome = validate_candidate(_Task("resilience.fork_bomb"), escape_image, bomb, timeout_s=30,
                                 spec=SandboxSpec(memory_mb=256, pids_limit=32), run_key=run_key)
    nop = outcome.nop
    assert nop.exception_type == "SandboxPidsLimitError", nop
    assert nop.reward is None and "32 pids" in nop.exception_message
    assert outcome.report is None  # never accepted (whether an Oracle run follows is validation's rule)
    assert isinstance(errors.SandboxPidsLimitError("x"), errors.SandboxError)
    # the bomb went with its container
    from forgeflow.sandbox.trial import container_name

    assert _containers_named(container_name(nop.instance_id, "nop", nop.trial_id)) == []


def test_memory_hog_is_an_oom_exception_not_a_reward(escape_image: str) -> None:
    hog = "python3 -c \"x = b'a' * (512 << 20)\""
    outcome = validate_candidate(_Task("resilience.memory_hog"), escape_image, hog, timeout_s=60,
                                 spec=SandboxSpec(memory_mb=64), run_key=uuid.uuid4().hex)
    assert outcome.nop.exception_type == "SandboxOOMError", outcome.nop
    assert outcome.nop.reward is None and "64 MiB" in outcome.nop.exception_message
    assert outcome.report is None  # never accepted (whether an Oracle run follows is validation's rule)
