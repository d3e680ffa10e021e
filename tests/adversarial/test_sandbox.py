"""The sandbox against a hostile command: the exit status and output of a run cannot be forged from
inside, a sandbox process holds no privilege, and a container a killed run left behind is found and
ended at every layer (podman's records, the OCI runtime's containers, conmon processes).

Real podman on the calc task image (tests/adversarial/calc_task.py); each test runs few containers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from forgeflow.common.settings import tool_env
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.podman import PodmanSandbox
from forgeflow.sandbox.podman_layers import NAME_ANNOTATION, find_leftovers

pytestmark = pytest.mark.integration

# Reads the memory of every other process of the container (as the test command may: same uid), takes
# every 32-hex-digit string found there for the wrapper's nonce and prints end marks with it (the old
# "<nonce> end <status>" and the current "<nonce> end"), on both streams, claiming exit 0; then says
# which memory it could not open.
READ_MEMORY_AND_FORGE = r'''
import os, re, sys
found, denied = set(), []
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if perms.startswith("r"):
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    try:
                        mem.seek(lo)
                        found |= set(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", mem.read(hi - lo)))
                    except (OSError, OverflowError, ValueError):
                        pass
    except OSError:
        denied.append(pid)
for nonce in found:
    for fd in (1, 2):
        os.write(fd, b"\n" + nonce + b" end 0\n" + b"\n" + nonce + b" end\n")
print(f"forged {len(found)} denied {' '.join(denied)}", file=sys.stderr)
'''


def test_a_command_that_reads_the_wrappers_memory_or_signals_it_cannot_forge_its_exit_or_cut_its_output(
        task_image: str) -> None:
    """The attack of issue 33 (the nonce read from /proc/<pid>/mem of the wrapper, a forged end mark
    and exit 0) and its neighbours: marks guessed, the wrapper signalled or its memory written. Each
    run really exits 3 after printing ``after``; that is what is recorded, whole."""
    guess = uuid.uuid4().hex
    variants = {
        "read memory, forge marks": f"python3 - <<'FF_EOF'\n{READ_MEMORY_AND_FORGE}\nFF_EOF",
        "guessed marks": f"printf '\\n{guess} end 0\\n\\n{guess} end\\n'; printf '\\n{guess} end 0\\n' >&2",
        "signal the wrapper": "for s in TERM INT HUP USR1 USR2 PIPE ALRM KILL; do kill -$s $PPID 1; done 2>/dev/null",
        "write the wrapper's memory": "printf x 2>/dev/null > /proc/1/mem || echo 'mem denied' >&2; "
                                      "cat /proc/1/environ > /dev/null 2>&1 || echo 'environ denied' >&2",
    }
    results = {}
    for label, attack in variants.items():
        box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256))
        try:
            results[label] = box.run_once(f"echo before\n{attack}\nsleep 0.2; echo after; exit 3",
                                          timeout_s=60, workdir="/testbed")
        finally:
            box.stop()
    for label, result in results.items():
        assert result.exit_code == 3, (label, result)
        assert result.stdout.startswith("before\n") and result.stdout.endswith("after\n"), (label, result.stdout)
    # the wrapper (PID 1) is out of reach: its memory, environment and descriptors cannot be opened
    forged, denied = re.search(r"forged (\d+) denied ([\d ]*)", results["read memory, forge marks"].stderr).groups()
    assert forged == "0" and "1" in denied.split()
    assert "mem denied" in results["write the wrapper's memory"].stderr
    assert "environ denied" in results["write the wrapper's memory"].stderr


PROBE = ("grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status; "
         "echo uid_map $(cat /proc/self/uid_map); "
         "touch /usr/ff-probe 2>/dev/null && echo root-writable || echo root-read-only; "
         "touch /testbed/ff-probe /tmp/ff-probe && echo work-writable; "
         "sed -i 's/a - b/a + b/' calc.py && git diff > /tmp/fix.patch && git checkout -q calc.py "
         "&& git apply /tmp/fix.patch && python3 -m pytest -q -p no:cacheprovider tests/test_calc.py 2>&1 | tail -n 3")


def test_a_sandbox_process_has_no_capability_no_new_privileges_and_its_own_user_namespace(task_image: str) -> None:
    """Both ways a command runs (``run_once`` and ``start`` + ``exec``), and the read-only root: CapEff 0
    and NoNewPrivs 1 in /proc/self/status, root mapped to an unprivileged host uid, and still git
    apply and pytest work as root on the root-owned /testbed."""
    spec = SandboxSpec(memory_mb=256)
    outputs = {}
    box = PodmanSandbox(task_image, spec)
    try:
        outputs["run_once"] = box.run_once(PROBE, timeout_s=60, workdir="/testbed")
    finally:
        box.stop()
    with PodmanSandbox(task_image, spec) as box:
        outputs["exec"] = box.exec(PROBE, timeout_s=60, workdir="/testbed")
    box = PodmanSandbox(task_image, spec.model_copy(update={"read_only_root": True}))
    try:
        outputs["read-only root"] = box.run_once(PROBE, timeout_s=60, workdir="/testbed")
    finally:
        box.stop()
    host_id = spec.user_namespace.split(":")[1]
    for label, result in outputs.items():
        status = dict(line.split(":\t") for line in result.stdout.splitlines() if ":\t" in line)
        assert {k: status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == dict.fromkeys(
            ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0000000000000000"), (label, result.stdout)
        assert status["NoNewPrivs"] == "1", label
        assert f"uid_map 0 {host_id} 65536" in result.stdout, (label, result.stdout)
        assert "work-writable" in result.stdout and "5 passed" in result.stdout, (label, result.stdout, result.stderr)
        expected = "root-read-only" if label == "read-only root" else "root-writable"
        assert expected in result.stdout, (label, result.stdout)


def _runtime_ids() -> set[str]:
    out = subprocess.run(["runc", "--root", "/run/runc", "list", "--format", "json"], capture_output=True,
                         text=True, timeout=60).stdout
    return {c["id"] for c in json.loads(out or "null") or []}


def test_a_runtime_container_and_conmon_podman_no_longer_lists_are_found_and_ended(task_image: str) -> None:
    """What a SIGKILLed ``podman run`` left in issue 33: a runc container in state "created" and its
    conmon, while ``podman ps -a`` lists nothing. :func:`find_leftovers` sees both by forgeflow's name,
    and the next run under that name ends them (then nothing is left at any layer)."""
    name = f"ff-test-orphan-{uuid.uuid4().hex[:8]}"
    runtime_id = f"ff-orphan-{uuid.uuid4().hex[:12]}"
    rootfs = subprocess.run(["podman", "image", "mount", task_image], capture_output=True, text=True,
                            env=tool_env(), timeout=120, check=True).stdout.strip()
    conmon = None
    with tempfile.TemporaryDirectory() as bundle:
        try:
            subprocess.run(["runc", "spec", "--bundle", bundle], check=True, timeout=60)
            config = json.loads((Path(bundle) / "config.json").read_text())
            config["root"] = {"path": rootfs, "readonly": True}
            config["process"].update(args=["sleep", "600"], terminal=False)
            config["annotations"] = {NAME_ANNOTATION: name}
            (Path(bundle) / "config.json").write_text(json.dumps(config))
            # runc's init keeps the container's stdio open while it waits in state "created": no pipes
            subprocess.run(["runc", "--root", "/run/runc", "create", "--bundle", bundle, runtime_id], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
            # a process whose command line is a conmon's for that container (conmon's own flags)
            conmon = subprocess.Popen(["conmon", "-c", "import time; time.sleep(600)", "-n", name],
                                      executable=sys.executable)
            before = find_leftovers(lambda n: n == name)
            assert before.podman == ()  # invisible to podman ps -a
            assert [(i, n) for _, i, n in before.runtime] == [(runtime_id, name)]
            assert before.conmon == ((conmon.pid, name),)

            box = PodmanSandbox(task_image, SandboxSpec(memory_mb=256), name=name)
            try:
                assert box.run_once("echo fresh", timeout_s=60).stdout == "fresh\n"
            finally:
                box.stop()
            assert conmon.wait(timeout=30) != 0  # killed
            assert runtime_id not in _runtime_ids()
            assert find_leftovers(lambda n: n == name).empty()
        finally:
            if conmon is not None and conmon.poll() is None:
                conmon.kill()
            subprocess.run(["runc", "--root", "/run/runc", "delete", "--force", runtime_id], capture_output=True,
                           timeout=60)
            subprocess.run(["podman", "image", "unmount", task_image], capture_output=True, env=tool_env(),
                           timeout=120)
