"""``PodmanSandbox.run_once``: a NOP or Oracle run as the container's own process (one ``podman run``
per trial, no ``exec``), on a real podman container of the calc task image.

What a trial relies on: the command's own stdout and stderr byte for byte (nothing of the wrapper),
its exit status, stdin from /dev/null, the env and working directory given; the kernel's evidence
read before the container goes (OOM kill, refused forks: the trial-level checks are in
tests/resilience/test_sandbox_escape.py and tests/integration/test_trial.py); a timeout that leaves
no container; output that only looks like the wrapper's marks changes nothing.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent import task_image  # noqa: E402,F401 - fixture

from forgeflow.common import errors  # noqa: E402
from forgeflow.common.settings import tool_env  # noqa: E402
from forgeflow.sandbox.base import OneShotSandbox, SandboxSpec  # noqa: E402
from forgeflow.sandbox.podman import PodmanSandbox  # noqa: E402

pytestmark = pytest.mark.integration


def _listed(name: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}"],
                         capture_output=True, text=True, env=tool_env(), timeout=60, check=True).stdout
    return out.split()


def test_the_command_runs_as_the_containers_process_with_its_own_output_exit_env_and_workdir(task_image: str) -> None:
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256), name=f"ff-test-once-{uuid.uuid4().hex[:8]}")
    assert isinstance(box, OneShotSandbox)
    command = "printf 'one\\n'; printf 'two' >&2; pwd; echo \"$FORGEFLOW_X\"; cat; printf '\\377tail'; exit 3"
    result = box.run_once(command, timeout_s=60, workdir="/testbed", env={"FORGEFLOW_X": "x y"})
    try:
        # the command's bytes only: the wrapper's start and end marks are cut off, stdin was /dev/null
        assert result.stdout == "one\n/testbed\nx y\n\ufffdtail"
        assert result.undecodable
        assert result.stdout_sha256 == hashlib.sha256(b"one\n/testbed\nx y\n\xfftail").hexdigest()
        assert result.stderr == "two"
        assert result.exit_code == 3
        assert box.setup_s is not None and box.setup_s > 0 and 0 <= result.duration_s < 60
    finally:
        box.stop()
    assert _listed(box.name) == []
    with pytest.raises(errors.SandboxError, match="already started"):
        box2 = PodmanSandbox(task_image, SandboxSpec(memory_mb=256))
        box2.start()
        try:
            box2.run_once("true", timeout_s=10)
        finally:
            box2.stop()


def test_output_that_looks_like_the_end_mark_does_not_end_the_run(task_image: str) -> None:
    """The nonce comes on stdin, never in argv or the environment: a command cannot print the real
    mark, and a look-alike is only output."""
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256))
    fake = f"\\n{uuid.uuid4().hex} end 0\\n"
    try:
        result = box.run_once(f"printf '{fake}'; printf '{fake}' >&2; cat /proc/*/cmdline /proc/*/environ "
                              "2>/dev/null | tr '\\0' '\\n' | grep -c -E '^[0-9a-f]{32}$'; sleep 1; exit 5",
                              timeout_s=60)
    finally:
        box.stop()
    assert result.exit_code == 5
    assert result.stdout.splitlines()[1].endswith(" end 0") and result.stdout.splitlines()[-1] == "0"
    assert " end 0" in result.stderr


def test_a_timeout_is_an_exception_and_leaves_no_container(task_image: str) -> None:
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256), name=f"ff-test-once-{uuid.uuid4().hex[:8]}")
    with pytest.raises(errors.VerifierTimeoutError, match=r"exceeded 2 s \(evidence: forgeflow's wall clock"):
        box.run_once("sleep 60", timeout_s=2)
    box.stop()
    assert _listed(box.name) == []


def test_a_pids_limit_hit_is_named_by_the_containers_pids_counter(task_image: str) -> None:
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256, pids_limit=32))
    with pytest.raises(errors.SandboxPidsLimitError, match=r"32 pids.*evidence: .*pids\.events max 0 -> \d+"):
        try:
            box.run_once("bash -c 'bomb() { bomb | bomb & }; bomb'; sleep 1", timeout_s=60)
        finally:
            box.stop()


def test_an_oom_kill_is_named_by_the_containers_memory_counter(task_image: str) -> None:
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=64))
    with pytest.raises(errors.SandboxOOMError, match=r"64 MiB; evidence: .*oom_kill 0 -> 1"):
        try:
            box.run_once("python3 -c \"x = b'a' * (512 << 20)\"", timeout_s=60)
        finally:
            box.stop()


def test_an_image_podman_cannot_start_is_a_sandbox_error_naming_podmans_answer(task_image: str) -> None:
    box = PodmanSandbox("localhost/forgeflow/no-such-image:0", SandboxSpec(memory_mb=64))
    with pytest.raises(errors.SandboxError, match=r"podman could not start 'localhost/forgeflow/no-such-image:0' "
                                                  r"\(evidence: podman run exited 125"):
        box.run_once("true", timeout_s=30)
    box.stop()


def test_a_container_left_under_the_name_is_replaced(task_image: str) -> None:
    name = f"ff-test-once-{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "create", "--name", name, task_image, "sleep", "infinity"], check=True,
                   capture_output=True, env=tool_env(), timeout=120)
    box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256), name=name)
    try:
        assert box.run_once("echo replaced", timeout_s=60).stdout == "replaced\n"
    finally:
        box.stop()
    assert _listed(name) == []
