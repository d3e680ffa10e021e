"""The ``harbor-export``, ``harbor-import`` and ``judge`` flows (flows/evaluation.py) in real flow runs
(session Prefect harness, a store per test).

Export: a freeze made by the ``freeze`` flow from accepted tasks in the store, the task rows from a
candidates JSONL; the dataset folder is read back (task.toml with tomllib, the tests' config). Import:
``result.json`` files shaped like Harbor 0.25.0's (the helpers of tests/core/evaluation/test_harbor.py),
one per exported task and agent, imported as two jobs of the frozen split and paired by the ``compare``
flow; ``forgeflow trials --job`` lists them. Judge: a small JSONL file, a parquet file read with HF
``datasets``, and a file with a bad row (nothing recorded). Harbor itself runs in
tests/integration/test_harbor_roundtrip.py.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.curation.freeze import SplitQuotas
from forgeflow.curation.task_rows import TaskSource
from forgeflow.ledger.records import TaskRecord
from forgeflow.ledger.store import Store
from tests.core.evaluation.test_harbor import BUG, F2P, IMAGE, P2P, _job, _trial_result

TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider tests"
TASKS = {"calc.add-1": "calc", "calc.add-2": "calc", "calc.add-3": "calc", "other.bug-1": "other",
         "other.bug-2": "other"}
QUOTAS = SplitQuotas(train=2, validation=0, test=2, max_per_repo=3, min_repos=2)


@pytest.fixture
def home(flow_home: Path) -> Path:
    return flow_home


@pytest.fixture
def frozen(home: Path, tmp_path: Path, prefect_harness) -> tuple[object, Path]:
    """Five accepted tasks frozen as ``harbor-flow`` by the freeze flow, and their candidates JSONL."""
    from flows.stages import FreezeParams, freeze

    store = Store()
    for instance_id, repo in TASKS.items():
        store.record_task(TaskRecord(instance_id=instance_id, repo=repo, image_ref=IMAGE, status="accepted",
                                     FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P))
    manifest = freeze(FreezeParams(name="harbor-flow", quotas=QUOTAS))
    candidates = tmp_path / "candidates.jsonl"
    candidates.write_text("".join(json.dumps({
        "instance_id": iid, "repo": repo, "patch": BUG, "image": IMAGE, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P,
        "problem_statement": f"add() is broken in {iid}", "test_command": TEST_COMMAND}) + "\n"
        for iid, repo in TASKS.items()))
    return manifest, candidates


def _artifact(key: str) -> list[object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_export_a_frozen_split_import_two_harbor_jobs_and_compare_them(frozen, home: Path, tmp_path: Path) -> None:
    from deployments.cli import app
    from flows.evaluation import (
        EXPORT_ARTIFACT_KEY,
        IMPORT_ARTIFACT_KEY,
        HarborExportParams,
        HarborImportParams,
        harbor_export,
        harbor_import,
    )
    from flows.stages import CompareParams, compare

    manifest, candidates = frozen
    test_ids = sorted(manifest.splits["test"])
    assert len(test_ids) == 2

    source = TaskSource(candidates_path=candidates)
    export = harbor_export(HarborExportParams(freeze_name="harbor-flow", split="test", source=source))
    assert export.path == home / "harbor" / "harbor-flow-test"
    assert export.instance_ids == test_ids and export.freeze_semantic_sha256 == manifest.semantic_sha256
    assert sorted(p.name for p in export.path.iterdir() if p.is_dir()) == test_ids
    for iid in test_ids:
        config = tomllib.loads((export.path / iid / "task.toml").read_text())
        assert (config["metadata"]["freeze"], config["metadata"]["split"], config["metadata"]["image"]) == (
            "harbor-flow", "test", IMAGE)
        assert config["environment"]["network_mode"] == "no-network"
        tests = json.loads((export.path / iid / "tests" / "config.json").read_text())
        assert (tests["FAIL_TO_PASS"], tests["PASS_TO_PASS"]) == (F2P, P2P)  # the store's validated tests
        assert (export.path / iid / "instruction.md").read_text() == f"add() is broken in {iid}\n"
    assert harbor_export(HarborExportParams(freeze_name="harbor-flow", split="test", source=source)) == export  # the same export: no-op
    assert any(f"2 task(s) in `{export.path}`" in (a.data or "") for a in _artifact(EXPORT_ARTIFACT_KEY))

    # what Harbor would write after `harbor run -p <export>`: two agents, each its own job
    def harbor_job(name: str, job_uuid: str, rewards: dict[str, float | None], exception: str | None = None) -> Path:
        return _job(tmp_path / "jobs" / name, [
            _trial_result(iid, f"{iid}__{name}", "terminus-2", reward, job_id=job_uuid,
                          exception=exception if reward is None else None)
            for iid, reward in rewards.items()], job_uuid=job_uuid)

    base = harbor_job("base", "11111111-1111-4111-8111-111111111111", {test_ids[0]: 1.0, test_ids[1]: 0.0})
    cand = harbor_job("cand", "22222222-2222-4222-8222-222222222222", {test_ids[0]: 1.0, test_ids[1]: 1.0})
    first = harbor_import(HarborImportParams(job_dir=base, job_id="harbor-base", freeze_name="harbor-flow", split="test"))
    assert (first.job_id, first.trials, first.scored, first.reward_1, first.kinds) == (
        "harbor-base", 2, 2, 1, {"agent": 2})
    second = harbor_import(HarborImportParams(job_dir=cand, freeze_name="harbor-flow"))
    assert second.job_id == "harbor-22222222-2222-4222-8222-222222222222" and second.reward_1 == 2
    store = Store()
    job = store.get_job("harbor-base")
    assert (job.kind, job.freeze_name, job.split) == ("harbor", "harbor-flow", "test")
    assert {(t.instance_id, t.reward) for t in store.trials_for(job_id="harbor-base")} == {
        (test_ids[0], 1.0), (test_ids[1], 0.0)}
    assert harbor_import(HarborImportParams(job_dir=base, job_id="harbor-base", freeze_name="harbor-flow")) == first  # re-import: same rows
    assert len(store.trials_for(job_id="harbor-base")) == 2
    assert any("harbor-base" in (a.description or "") for a in _artifact(IMPORT_ARTIFACT_KEY))

    paired = compare(CompareParams(job_a="harbor-base", job_b=second.job_id, report_path=tmp_path / "report.md")).paired
    assert (paired.wins, paired.ties, paired.losses) == (1, 1, 0)
    assert "freeze harbor-flow, split test" in (tmp_path / "report.md").read_text()
    listed = CliRunner().invoke(app, ["trials", "--job", "harbor-base", "--json"])
    assert listed.exit_code == 0, listed.output
    assert sorted((t["instance_id"], t["reward"]) for t in json.loads(listed.output)) == [
        (test_ids[0], 1.0), (test_ids[1], 0.0)]

    # an exception stays an exception: no reward, forgeflow's type, never a 0
    broken = harbor_job("broken", "33333333-3333-4333-8333-333333333333", {test_ids[0]: None},
                        exception="SandboxLikelyOutOfMemoryError")
    summary = harbor_import(HarborImportParams(job_dir=broken, freeze_name="harbor-flow"))
    assert (summary.scored, summary.exceptions) == (0, {"SandboxOOMError": 1})


def test_harbor_flows_name_bad_input_before_any_work(frozen, home: Path, tmp_path: Path) -> None:
    from flows.evaluation import HarborExportParams, HarborImportParams, harbor_export, harbor_import

    manifest, candidates = frozen
    source = TaskSource(candidates_path=candidates)
    with pytest.raises(InputError, match=r"freeze 'nope' is not recorded in the store"):
        harbor_export(HarborExportParams(freeze_name="nope", split="test", source=source))
    with pytest.raises(InputError, match=r"freeze 'harbor-flow' has no split 'dev'; its splits"):
        harbor_export(HarborExportParams(freeze_name="harbor-flow", split="dev", source=source))
    with pytest.raises(InputError, match=r"split 'validation' of freeze 'harbor-flow' is empty"):
        harbor_export(HarborExportParams(freeze_name="harbor-flow", split="validation", source=source))
    with pytest.raises(InputError, match=r"harbor-export: images='registry' applies to generated rows only"):
        harbor_export(HarborExportParams(freeze_name="harbor-flow", split="test",
                                         source=source.model_copy(update={"images": "registry"})))
    with pytest.raises(InputError, match=r"missing\.jsonl"):
        harbor_export(HarborExportParams(freeze_name="harbor-flow", split="test",
                                         source=TaskSource(candidates_path=tmp_path / "missing.jsonl")))
    # a test task without its row, and one read with another log parser: both listed, nothing written
    test_ids = sorted(manifest.splits["test"])
    rows = [json.loads(line) for line in candidates.read_text().splitlines()]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(json.dumps({**r, "log_parser": "parse_log_django"} if r["instance_id"] == test_ids[1]
                                          else r) + "\n" for r in rows if r["instance_id"] != test_ids[0]))
    with pytest.raises(PreflightError, match=r"2 of 2 task\(s\) cannot be exported") as raised:
        harbor_export(HarborExportParams(freeze_name="harbor-flow", split="test", source=TaskSource(candidates_path=partial),
                                         out_dir=tmp_path / "partial-export"))
    assert f"{test_ids[0]}: no row" in str(raised.value) and "parse_log_django" in str(raised.value)
    assert not (tmp_path / "partial-export").exists()

    with pytest.raises(InputError, match=r"params\.job_dir .*no-such-job does not exist"):
        harbor_import(HarborImportParams(job_dir=tmp_path / "no-such-job", freeze_name="harbor-flow"))
    train_id = manifest.splits["train"][0]
    outside = _job(tmp_path / "jobs" / "outside", [_trial_result(train_id, f"{train_id}__a", "terminus-2", 1.0)])
    with pytest.raises(InputError, match=rf"task '{train_id}' is not one of the 2 given instance ids"):
        harbor_import(HarborImportParams(job_dir=outside, freeze_name="harbor-flow", split="test"))
    with pytest.raises(InputError, match=r"freeze 'nope' is not recorded"):
        harbor_import(HarborImportParams(job_dir=outside, freeze_name="nope"))
    assert Store().trials_for() == [] and Store().jobs(kind="harbor") == []


def test_judge_records_verdicts_and_refuses_a_bad_row(prefect_harness, home: Path, tmp_path: Path) -> None:
    import datasets

    from flows.evaluation import JUDGE_ARTIFACT_KEY, JudgeParams, judge

    rows = [{"question_id": "q1", "answer": "1,000.0", "reference": "1000"},
            {"question_id": "q2", "answer": "The Paris!", "reference": "paris"},
            {"question_id": "q3", "answer": "a, b; c", "reference": "a;b;c"},
            {"question_id": "q4", "answer": 41, "reference": "42"}]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = judge(JudgeParams(path=answers, job_id="qa-1"))
    assert (summary.judged, summary.correct, summary.incorrect) == (4, 3, 1)
    assert summary.rules == {"number": 2, "string": 1, "list": 1}
    verdicts = {j.question_id: j.correct for j in Store().judgments(job_id="qa-1")}
    assert verdicts == {"q1": True, "q2": True, "q3": True, "q4": False}
    assert any("qa-1: 3/4 correct" in (a.description or "") for a in _artifact(JUDGE_ARTIFACT_KEY))

    # a number tolerance widens the match; the default job id names the file's content
    loose = judge(JudgeParams(path=answers, rel_tol=0.05))
    assert loose.job_id.startswith("judge-") and loose.correct == 4

    parquet = tmp_path / "answers.parquet"
    datasets.Dataset.from_list([{"question_id": "p1", "answer": "7", "reference": "7.0"}]).to_parquet(str(parquet))
    assert judge(JudgeParams(path=parquet, job_id="qa-pq")).correct == 1

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps({"question_id": "q9", "answer": "x"}) + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl line 3: field 'reference' is missing"):
        judge(JudgeParams(path=bad, job_id="qa-bad"))
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(InputError, match=r"line 2: field 'question_id' 'q1' repeats .*line 1"):
        judge(JudgeParams(path=bad, job_id="qa-bad"))
    with pytest.raises(InputError, match=r"answers file .*nope\.jsonl does not exist"):
        judge(JudgeParams(path=tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match=r"tolerances must be >= 0, got params\.rel_tol=-1\.0"):
        judge(JudgeParams(path=answers, rel_tol=-1.0))
    assert Store().judgments(job_id="qa-bad") == []
