"""Harbor interop without Harbor: the exported task files and the import of Harbor result files.

The export is checked by reading its files back (TOML with tomllib, the grader run with python3
on pytest logs and compared with forgeflow's own grading). The import reads hand-written
``result.json`` files shaped like the ones Harbor 0.25.0 writes (fields copied from a real job
folder; the round trip against real Harbor output is ``tests/integration/test_harbor_roundtrip.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import uuid
from collections import Counter
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.common.task import Task
from forgeflow.curation.freeze import (
    SplitQuotas,
    TaskRef,
    select_splits,
    write_freeze,
)
from forgeflow.evaluation.harbor import (
    HARBOR_TASK_SCHEMA_VERSION,
    HarborTaskLimits,
    export_split,
    map_harbor_exception,
)
from forgeflow.evaluation.harbor_import import import_harbor_job, read_harbor_job
from forgeflow.ledger.store import Store
from forgeflow.sandbox.grading import grade_resolved, parse_test_log

IMAGE = "127.0.0.1:5702/task-01:calc.add-1"
F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_mul", "tests/test_other.py::test_x[1-2]"]
BUG = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a + b
+    return a - b
"""


def _task(iid: str, **overrides) -> Task:
    fields = dict(instance_id=iid, image_ref=IMAGE, patch=BUG, FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P,
                  test_command="python3 -m pytest -rA -p no:cacheprovider tests", repo="calc")
    return Task(**{**fields, **overrides})


@pytest.fixture()
def freeze(tmp_path: Path) -> Path:
    quotas = SplitQuotas(train=1, validation=0, test=2, max_per_repo=5)
    accepted = [TaskRef(instance_id=i, repo=r) for i, r in
                (("calc.add-1", "calc"), ("calc.add-2", "calc"), ("other.bug-1", "other"))]
    selection = select_splits(accepted, quotas)
    assert selection.ready
    return write_freeze("harbor-unit", selection, quotas, 0, tmp_path / "freezes").path


def _split(manifest: Path, split: str) -> list[str]:
    return json.loads(manifest.read_text())["splits"][split]


# --- export ------------------------------------------------------------------------------------
def test_export_writes_one_harbor_task_per_instance_of_the_split(freeze: Path, tmp_path: Path) -> None:
    ids = _split(freeze, "test")
    tasks = [_task(iid) for iid in ids] + [_task("not.in-split")]
    limits = HarborTaskLimits(agent_timeout_s=300, verifier_timeout_s=120, memory_mb=1024, cpus=2)
    export = export_split(freeze, "test", tasks, tmp_path / "ds", limits)
    assert export.instance_ids == sorted(ids) and export.split == "test" and export.freeze == "harbor-unit"
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.is_dir()) == sorted(ids)

    folder = tmp_path / "ds" / ids[0]
    config = tomllib.loads((folder / "task.toml").read_text())
    assert config["schema_version"] == HARBOR_TASK_SCHEMA_VERSION
    assert config["metadata"]["instance_id"] == ids[0] and config["metadata"]["image"] == IMAGE
    assert config["metadata"]["freeze_semantic_sha256"] == export.freeze_semantic_sha256
    assert config["verifier"] == {"timeout_sec": 120.0} and config["agent"] == {"timeout_sec": 300.0}
    assert config["environment"]["network_mode"] == "no-network"
    assert config["environment"]["memory_mb"] == 1024 and config["environment"]["cpus"] == 2
    assert (folder / "environment" / "Dockerfile").read_text().startswith(f"FROM {IMAGE}\n")

    instruction = (folder / "instruction.md").read_text()
    assert "tests/test_calc.py::test_add" in instruction and "a - b" not in instruction

    test_sh = (folder / "tests" / "test.sh").read_text()
    assert os.access(folder / "tests" / "test.sh", os.X_OK) and test_sh.startswith("#!/bin/bash\n")
    assert "git ls-files -- tests/test_calc.py tests/test_other.py" in test_sh
    assert "'python3 -m pytest -rA -p no:cacheprovider tests' > /logs/verifier/test_output.log" in test_sh
    assert "/logs/verifier/reward.txt" in test_sh
    assert json.loads((folder / "tests" / "config.json").read_text())["PASS_TO_PASS"] == P2P

    assert "git apply -R" in (folder / "solution" / "solve.sh").read_text()
    assert os.access(folder / "solution" / "solve.sh", os.X_OK)
    assert (folder / "solution" / "bug.patch").read_text() == BUG


def test_export_is_idempotent_and_never_overwrites(freeze: Path, tmp_path: Path) -> None:
    ids = _split(freeze, "test")
    first = export_split(freeze, "test", [_task(i) for i in ids], tmp_path / "ds")
    again = export_split(freeze, "test", [_task(i) for i in ids], tmp_path / "ds")
    assert again.semantic_sha256 == first.semantic_sha256
    with pytest.raises(errors.InputError, match="another export"):
        export_split(freeze, "test", [_task(i, test_command="pytest -rA") for i in ids], tmp_path / "ds")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(errors.InputError, match="not a forgeflow Harbor export"):
        export_split(freeze, "test", [_task(i) for i in ids], tmp_path / "other")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".staging")]


def test_export_names_bad_input(freeze: Path, tmp_path: Path) -> None:
    ids = _split(freeze, "test")
    with pytest.raises(errors.InputError, match=f"missing: {ids[1]}"):
        export_split(freeze, "test", [_task(ids[0])], tmp_path / "a")
    with pytest.raises(errors.InputError, match="no split 'holdout'"):
        export_split(freeze, "holdout", [], tmp_path / "b")
    with pytest.raises(errors.InputError, match="split 'validation' .* is empty"):
        export_split(freeze, "validation", [], tmp_path / "c")
    with pytest.raises(errors.InputError, match="given twice"):
        export_split(freeze, "test", [_task(ids[0]), _task(ids[0])], tmp_path / "d")
    with pytest.raises(errors.InputError, match="does not exist"):
        export_split(tmp_path / "nope.json", "test", [], tmp_path / "e")
    for bad, message in [(_task("../escape"), "the instance id must use only"),
                         (_task(ids[0], FAIL_TO_PASS=[]), "no FAIL_TO_PASS"),
                         (_task(ids[0], patch=None, test_command=" "), "no patch, no test_command")]:
        with pytest.raises(errors.InputError, match=message):
            export_split(freeze, "test", [bad, *(_task(i) for i in ids[1:])], tmp_path / "f")
    old_keys = {"instance_id": "calc.add-1", "image_ref": IMAGE, "bug_patch": BUG, "fail_to_pass": F2P,
                "test_command": "pytest -rA"}  # the spelling before one Task: still loads, dumps as patch
    assert Task.model_validate(old_keys).model_dump()["patch"] == BUG
    assert not (tmp_path / "a").exists()


LOG_HEAD = "============================= test session starts ==============================\n"


@pytest.mark.parametrize(
    ("name", "log"),
    [
        ("all pass", LOG_HEAD + "PASSED tests/test_calc.py::test_add\nPASSED tests/test_calc.py::test_mul\n"
         "PASSED tests/test_other.py::test_x[1-2]\n============ 3 passed in 0.1s ============\n"),
        ("bug present", LOG_HEAD + "PASSED tests/test_calc.py::test_mul\nPASSED tests/test_other.py::test_x[1-2]\n"
         "FAILED tests/test_calc.py::test_add - assert -1 == 5\n====== 1 failed, 2 passed in 0.1s ======\n"),
        ("xfail is not a pass", LOG_HEAD + "XFAIL tests/test_calc.py::test_add\nPASSED tests/test_calc.py::test_mul\n"
         "PASSED tests/test_other.py::test_x[1-2]\n====== 2 passed, 1 xfailed in 0.1s ======\n"),
        ("p2p missing", LOG_HEAD + "PASSED tests/test_calc.py::test_add\nPASSED tests/test_calc.py::test_mul\n"
         "============ 2 passed in 0.1s ============\n"),
        ("p2p error", LOG_HEAD + "PASSED tests/test_calc.py::test_add\nPASSED tests/test_calc.py::test_mul\n"
         "ERROR tests/test_other.py::test_x[1-2] - ImportError\n====== 2 passed, 1 error in 0.1s ======\n"),
        ("nothing collected", LOG_HEAD + "============ no tests ran in 0.01s ============\n"),
    ],
)
def test_exported_grader_agrees_with_forgeflow_grading(freeze: Path, tmp_path: Path, name: str, log: str) -> None:
    iid = _split(freeze, "test")[0]
    export_split(freeze, "test", [_task(i) for i in _split(freeze, "test")], tmp_path / "ds")
    tests = tmp_path / "ds" / iid / "tests"
    (tmp_path / "log.txt").write_text(log)
    reward_file = tmp_path / "reward.txt"
    run = subprocess.run([sys.executable, str(tests / "grade.py"), str(tmp_path / "log.txt"),
                          str(tests / "config.json"), str(reward_file)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    expected = grade_resolved(parse_test_log(log), F2P, P2P)
    assert float(reward_file.read_text()) == expected, name
    assert (name == "all pass") == (expected == 1.0)


def test_exported_grader_writes_no_reward_for_a_log_that_is_not_pytest(freeze: Path, tmp_path: Path) -> None:
    """No reward file: Harbor records RewardFileNotFoundError (an exception), as forgeflow's own
    verifier raises VerifierOutputError; never a reward of 0."""
    iid = _split(freeze, "test")[0]
    export_split(freeze, "test", [_task(i) for i in _split(freeze, "test")], tmp_path / "ds")
    tests = tmp_path / "ds" / iid / "tests"
    log = "bash: python3: command not found\n"
    (tmp_path / "log.txt").write_text(log)
    run = subprocess.run([sys.executable, str(tests / "grade.py"), str(tmp_path / "log.txt"),
                          str(tests / "config.json"), str(tmp_path / "reward.txt")], capture_output=True, text=True)
    assert run.returncode == 2 and "not pytest -rA output" in run.stderr
    assert not (tmp_path / "reward.txt").exists()
    with pytest.raises(errors.VerifierOutputError):
        parse_test_log(log)


# --- import ------------------------------------------------------------------------------------
JOB_UUID = "42f5a5eb-dca3-4a9d-8ba0-57d93bb59969"


def _trial_result(task: str, trial: str, agent: str, reward: float | None = None,
                  exception: str | None = None, rewards: dict | None = None, job_id: str = JOB_UUID) -> dict:
    """A result.json shaped like Harbor 0.25.0's TrialResult (trimmed fields are optional there)."""
    t0, t1 = "2026-11-30T04:26:00.287970Z", "2026-11-30T04:26:10.338988Z"
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{job_id}/{trial}")),
        "task_name": task, "trial_name": trial, "trial_uri": f"file:///jobs/j/{trial}",
        "task_id": {"path": f"/ds/{task}"}, "source": "ds", "task_checksum": "0" * 64,
        "config": {"task": {"path": f"/ds/{task}"}, "trial_name": trial, "agent": {"name": agent},
                   "environment": {"import_path": "forgeflow_harbor_env:ForgeflowPodmanEnvironment"},
                   "job_id": job_id},
        "agent_info": {"name": agent, "version": "1.0.0", "model_info": None},
        "agent_result": {"n_input_tokens": 1200 if agent not in ("nop", "oracle") else None,
                         "n_output_tokens": 80 if agent not in ("nop", "oracle") else None},
        "verifier_result": ({"rewards": rewards if rewards is not None else {"reward": reward}}
                            if reward is not None or rewards is not None else None),
        "exception_info": ({"exception_type": exception, "exception_message": f"{exception} happened",
                            "exception_traceback": "Traceback ...", "occurred_at": t1} if exception else None),
        "started_at": t0, "finished_at": t1,
        "environment_setup": {"started_at": t0, "finished_at": "2026-11-30T04:26:02.939253Z"},
        "agent_setup": {"started_at": "2026-11-30T04:26:02.939332Z", "finished_at": "2026-11-30T04:26:02.939401Z"},
        "agent_execution": {"started_at": "2026-11-30T04:26:02.939508Z", "finished_at": "2026-11-30T04:26:02.943566Z"},
        "verifier": {"started_at": "2026-11-30T04:26:05.322083Z", "finished_at": "2026-11-30T04:26:09.523443Z"},
        "step_results": None,
    }


def _job(root: Path, trials: list[dict], job_uuid: str = JOB_UUID) -> Path:
    root.mkdir(parents=True)
    (root / "result.json").write_text(json.dumps({"id": job_uuid, "started_at": "2026-11-30T04:26:00",
                                                  "n_total_trials": len(trials), "stats": {}}))
    for trial in trials:
        (root / trial["trial_name"]).mkdir()
        (root / trial["trial_name"] / "result.json").write_text(json.dumps(trial, indent=2))
    return root


def test_import_maps_rewards_and_exceptions_into_forgeflow_accounting(tmp_path: Path, store_url: str) -> None:
    job = _job(tmp_path / "jobs" / "j1", [
        _trial_result("calc.add-1", "calc.add-1__nop", "nop", 0.0),
        _trial_result("calc.add-1", "calc.add-1__oracle", "oracle", 1.0),
        _trial_result("calc.add-2", "calc.add-2__nop", "nop", exception="VerifierTimeoutError"),
        _trial_result("calc.add-2", "calc.add-2__oracle", "oracle", exception="RewardFileNotFoundError"),
        _trial_result("calc.add-1", "calc.add-1__agent-timeout", "mini-swe-agent", 1.0, exception="AgentTimeoutError"),
        _trial_result("calc.add-2", "calc.add-2__oracle-timeout", "oracle", 1.0, exception="AgentTimeoutError"),
        _trial_result("calc.add-2", "calc.add-2__agent-ctx", "mini-swe-agent", 0.0, exception="ContextWindowExceededError"),
        _trial_result("calc.add-2", "calc.add-2__agent-exit", "mini-swe-agent", 1.0, exception="NonZeroAgentExitCodeError"),
        _trial_result("calc.add-2", "calc.add-2__agent-oom", "mini-swe-agent", exception="SandboxLikelyOutOfMemoryError"),
    ])
    (job / "calc.add-2__running").mkdir()
    (job / "calc.add-2__running" / "config.json").write_text("{}")
    store = Store(store_url)
    store.upgrade()
    found = import_harbor_job(job, store, instance_ids=["calc.add-1", "calc.add-2"])
    assert found.job_id == f"harbor-{JOB_UUID}" and found.unfinished == ["calc.add-2__running"]
    rows = {t.trial_id: t for t in store.trials_for(job_id=found.job_id)}
    assert len(rows) == 9
    assert all(t.job_id == found.job_id and t.timings["total_s"] > 10 for t in rows.values())
    kinds = Counter((t.kind, t.reward, t.exception_type) for t in rows.values())
    assert kinds == Counter([
        ("nop", 0.0, None),
        ("oracle", 1.0, None),
        ("nop", None, "VerifierTimeoutError"),
        ("oracle", None, "VerifierOutputError"),
        ("agent", 1.0, "AgentTimeoutError"),  # Harbor's convention: the verifier's reward is kept
        ("oracle", None, "AgentTimeoutError"),  # not for nop/oracle: an exception only
        ("agent", 0.0, None),  # a context overflow is the model's outcome
        ("agent", None, "InfraError"),  # an unlisted Harbor error never yields a reward
        ("agent", None, "SandboxOOMError"),
    ])
    for row in rows.values():
        if row.exception_type:
            assert row.exception_message.startswith("Harbor ") and "happened" in row.exception_message
        assert row.timings["env_setup_s"] == pytest.approx(2.651283) and row.timings["verifier_s"] > 4
    agents = [r for r in rows.values() if r.kind == "agent"]
    assert {r.input_tokens for r in agents} == {1200}
    # re-importing the same job upserts: no new rows
    import_harbor_job(job, store)
    assert store.counts()["trials"] == 9
    assert (found.trials, found.scored, found.reward_1, found.kinds) == (9, 4, 2, {"nop": 2, "oracle": 3, "agent": 4})
    assert found.exceptions == {"VerifierTimeoutError": 1, "VerifierOutputError": 1, "AgentTimeoutError": 2,
                                "InfraError": 1, "SandboxOOMError": 1}


def test_harbor_exception_taxonomy_covers_transient_and_permanent_kinds() -> None:
    assert map_harbor_exception("ApiRateLimitError") == "ModelEndpointError"
    assert errors.is_transient(errors.ModelEndpointError("x"))
    assert map_harbor_exception("AuthenticationError") == "ModelRequestError"
    assert map_harbor_exception("SandboxBuildFailedError") == "ImageBuildError"
    assert map_harbor_exception("EnvironmentStartTimeoutError") == "SandboxError"
    assert map_harbor_exception("SomethingNew") == "InfraError"
    for name in ("ModelEndpointError", "ModelRequestError", "ImageBuildError", "SandboxError", "InfraError"):
        assert issubclass(getattr(errors, name), errors.InfraError)


def test_import_names_bad_input(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match="does not exist"):
        read_harbor_job(tmp_path / "missing")
    jobs = tmp_path / "jobs"
    _job(jobs / "j1", [_trial_result("calc.add-1", "t1", "nop", 0.0)])
    with pytest.raises(errors.InputError, match="jobs folder"):
        read_harbor_job(jobs)
    with pytest.raises(errors.InputError, match="not one of the 1 given instance ids"):
        read_harbor_job(jobs / "j1", instance_ids=["calc.add-2"])

    def bad(name: str, trial: dict) -> Path:
        return _job(tmp_path / name, [trial])

    broken = _trial_result("calc.add-1", "t1", "nop", 0.0)
    del broken["agent_info"]
    with pytest.raises(errors.InputError, match=r"t1/result.json: field agent_info"):
        read_harbor_job(bad("no-agent", broken))
    with pytest.raises(errors.InputError, match="outside 0..1"):
        read_harbor_job(bad("big", _trial_result("calc.add-1", "t1", "nop", 1.5)))
    with pytest.raises(errors.InputError, match="no 'reward' key"):
        read_harbor_job(bad("keys", _trial_result("calc.add-1", "t1", "nop", rewards={"accuracy": 1.0})))
    with pytest.raises(errors.InputError, match="belongs to job"):
        read_harbor_job(bad("mixed", _trial_result("calc.add-1", "t1", "nop", 0.0, job_id="other")))
    multi = _trial_result("calc.add-1", "t1", "nop", 0.0)
    multi["step_results"] = [{"step_name": "a"}]
    with pytest.raises(errors.InputError, match="multi-step"):
        read_harbor_job(bad("multi", multi))
    notjson = _job(tmp_path / "notjson", [])
    (notjson / "t1").mkdir()
    (notjson / "t1" / "result.json").write_text("{truncated")
    with pytest.raises(errors.InputError, match="not valid JSON"):
        read_harbor_job(notjson)
    (tmp_path / "nojob").mkdir()
    (tmp_path / "nojob" / "result.json").write_text("{}")
    with pytest.raises(errors.InputError, match="lacks 'id'"):
        read_harbor_job(tmp_path / "nojob")
