"""Harbor round trip for real: export a frozen split, ``harbor run`` it (nop and oracle agents, podman,
network cut), import the job, and compare with forgeflow's own NOP/Oracle trials of the same tasks.

Harbor 0.25.0 runs from its own virtualenv (``scripts/harbor_venv.sh``, cached under
``~/.cache/forgeflow/harbor-venv``) with forgeflow's environment class
(``infra/harbor/forgeflow_harbor_env.py``) on ``PYTHONPATH`` and podman configured by
``infra/containers.conf`` (runc, lowered ulimits). The task image is the calc project of
``test_agent.py`` (``add`` broken, ``mul`` fine). A second task of the split runs a test command
that prints no pytest output (it probes the network instead): forgeflow records
``VerifierOutputError`` for it, and so must the import of Harbor's ``RewardFileNotFoundError``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from test_agent import BUG_PATCH, F2P, P2P, TEST_COMMAND, task_image  # noqa: F401 (the fixture)

from forgeflow.common.settings import REPO_ROOT, tool_env
from forgeflow.common.task import Task
from forgeflow.curation.candidates import CandidateTask
from forgeflow.curation.freeze import (
    SplitQuotas,
    TaskRef,
    select_splits,
    write_freeze,
)
from forgeflow.evaluation.harbor import (
    HARBOR_ENV_DIR,
    HARBOR_ENV_IMPORT_PATH,
    HarborTaskLimits,
    export_split,
)
from forgeflow.evaluation.harbor_import import import_harbor_job
from forgeflow.ledger.store import Store
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.trial import validate_candidate

VALID = "calc.add-1"
NO_PYTEST = "calc.add-1-netprobe"
NET_PROBE = (
    "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"; "
    "cat /proc/net/dev"
)
"""Prints no pytest output (so no reward), and shows whether the sandbox has a network."""

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def harbor_bin() -> Path:
    """Harbor's CLI from its own (cached) virtualenv."""
    out = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "harbor_venv.sh")], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


def _harbor_env(harbor: Path) -> dict[str, str]:
    env = tool_env()  # CONTAINERS_CONF: runc and lowered ulimits
    env["PATH"] = f"{harbor.parent}{os.pathsep}{env['PATH']}"  # its podman-compose (>= 1.1) first
    env["PYTHONPATH"] = str(HARBOR_ENV_DIR)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # offline: no fetch of litellm's price list
    return env


def test_export_harbor_run_import_gives_forgeflow_accounting(task_image: str, harbor_bin: Path, tmp_path: Path) -> None:  # noqa: F811
    quotas = SplitQuotas(train=0, validation=0, test=2, max_per_repo=2)
    selection = select_splits([TaskRef(instance_id=i, repo="calc") for i in (VALID, NO_PYTEST)], quotas)
    freeze = write_freeze("harbor-roundtrip", selection, quotas, 0, tmp_path / "freezes")
    commands = {VALID: TEST_COMMAND, NO_PYTEST: NET_PROBE}

    tasks = [Task(instance_id=iid, image_ref=task_image, patch=BUG_PATCH, FAIL_TO_PASS=F2P,
                  PASS_TO_PASS=P2P, test_command=command, repo="calc") for iid, command in commands.items()]
    export = export_split(freeze.path, "test", tasks, tmp_path / "dataset",
                          HarborTaskLimits(agent_timeout_s=120, verifier_timeout_s=120, memory_mb=512))
    job_config = tmp_path / "job.json"
    job_config.write_text(json.dumps({"agents": [{"name": "nop"}, {"name": "oracle"}]}))
    t0 = time.monotonic()
    harbor = subprocess.Popen(  # runs while forgeflow's own trials run below
        [str(harbor_bin), "run", "-c", str(job_config), "-p", str(export.path), "-e", HARBOR_ENV_IMPORT_PATH,
         "-o", str(tmp_path / "jobs"), "--job-name", "roundtrip", "-n", "4", "-y", "-q"],
        env=_harbor_env(harbor_bin), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # Harbor's own schema accepts the exported task.toml as written
        check = subprocess.run(
            [str(harbor_bin.parent / "python"), "-c",
             "import sys; from harbor.models.task.config import TaskConfig; "
             "c = TaskConfig.model_validate_toml(open(sys.argv[1]).read()); "
             "print(c.environment.network_mode.value, c.verifier.timeout_sec, c.metadata['instance_id'])",
             str(export.path / VALID / "task.toml")], capture_output=True, text=True, timeout=120)
        assert check.stdout.split() == ["no-network", "120.0", VALID], check.stderr[-2000:]

        # forgeflow's own trials of the same two tasks
        own = {}
        for iid, command in commands.items():
            candidate = CandidateTask(instance_id=iid, repo="calc", patch=BUG_PATCH, FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)
            outcome = validate_candidate(candidate, task_image, command, timeout_s=120,
                                         spec=SandboxSpec(memory_mb=512), run_key="harbor-roundtrip")
            own[(iid, "nop")] = (outcome.nop.reward, outcome.nop.exception_type)
            if outcome.oracle is not None:
                own[(iid, "oracle")] = (outcome.oracle.reward, outcome.oracle.exception_type)
        assert own == {(VALID, "nop"): (0.0, None), (VALID, "oracle"): (1.0, None),
                       (NO_PYTEST, "nop"): (None, "VerifierOutputError")}
        output, _ = harbor.communicate(timeout=600)
    finally:
        if harbor.poll() is None:
            harbor.kill()
            harbor.wait()
    harbor_s = time.monotonic() - t0
    assert harbor.returncode == 0, output[-4000:]
    print(f"harbor run: 4 trials in {harbor_s:.1f} s (forgeflow's own 3 trials ran meanwhile)")

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    found = import_harbor_job(tmp_path / "jobs" / "roundtrip", store, instance_ids=export.instance_ids)
    assert found.unfinished == []
    rows = store.trials_for(job_id=found.job_id)
    harbor = {(t.instance_id, t.kind): (t.reward, t.exception_type) for t in rows}
    assert len(rows) == 4 and len(harbor) == 4
    for key, outcome in own.items():
        assert harbor[key] == outcome, key
    # forgeflow skips the oracle after a broken verifier; Harbor ran it: the same exception, no reward
    assert harbor[(NO_PYTEST, "oracle")] == (None, "VerifierOutputError")
    assert all("RewardFileNotFoundError" in t.exception_message for t in rows if t.exception_type)

    # the network was really cut: the probe could not connect and the only interface is loopback
    probe_logs = list((tmp_path / "jobs" / "roundtrip").glob(f"{NO_PYTEST}__*/verifier/test_output.log"))
    assert len(probe_logs) == 2
    for log in probe_logs:
        text = log.read_text()
        assert "Network is unreachable" in text, text[-2000:]
        interfaces = re.findall(r"^\s*([\w.-]+):\s+\d", text, flags=re.MULTILINE)  # /proc/net/dev rows
        assert interfaces == ["lo"], text[-2000:]
    # Harbor removed its containers
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env=tool_env(), capture_output=True,
                          text=True, timeout=60).stdout.split()
    assert not [name for name in left if name.startswith("calc-add-1")], left
