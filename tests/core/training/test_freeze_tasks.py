"""RL tasks from a freeze (forgeflow.training.freeze_tasks): the rows an ``rl-burst`` trains on carry what
validation recorded for the verifier (test lists, known tests, pristine duration); the patch never leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.curation.freeze import SplitQuotas, TaskRef, select_splits, write_freeze
from forgeflow.curation.generated import GeneratedTask, write_generated
from forgeflow.curation.task_rows import TaskSource, TestSpec
from forgeflow.ledger.records import FreezeRecord, TaskRecord
from forgeflow.ledger.store import Store
from forgeflow.training.freeze_tasks import rl_tasks_from_freeze
from forgeflow.training.rl import RLTask, build_rl_dataset

PATCH = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
IDS = [f"proj.func_pm_op_swap__abcd000{n}" for n in range(3)]
KNOWN = ["tests/test_m.py::test_a", "tests/test_m.py::test_b", "tests/test_m.py::test_c"]


@pytest.fixture()
def frozen(tmp_path: Path) -> tuple[Store, Path]:
    """A store with three accepted tasks (one validated before known tests were recorded), all three in the
    train split of freeze ``rl-unit``, and their generated rows."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    for n, iid in enumerate(IDS):
        recorded = {"known_tests": KNOWN, "pristine_duration_s": 1.5 + n} if n < 2 else {}
        store.record_task(TaskRecord(instance_id=iid, repo="proj", status="accepted", FAIL_TO_PASS=KNOWN[:1],
                                     PASS_TO_PASS=KNOWN[1:], **recorded))
    quotas = SplitQuotas(train=3, validation=0, test=0, max_per_repo=5)
    selection = select_splits([TaskRef(instance_id=i, repo="proj") for i in IDS], quotas)
    manifest = write_freeze("rl-unit", selection, quotas, 0, tmp_path / "freezes")
    store.record_freeze(FreezeRecord(name="rl-unit", semantic_sha256=manifest.semantic_sha256,
                                     file_sha256=manifest.file_sha256, manifest_path=str(manifest.path)))
    generated = write_generated(tmp_path / "candidates.jsonl", [GeneratedTask(
        instance_id=iid, repo="proj", patch=PATCH, modifier="func_pm_op_swap", file_path="m.py", func_name="f",
        image=f"localhost/forgeflow/task:t{n}", image_id=f"{n}" * 64, test_command="python3 -m pytest -rA")
        for n, iid in enumerate(IDS)])
    yield store, generated
    store.dispose()


def test_the_rl_tasks_of_a_freeze_carry_the_stores_validation_and_never_the_patch(frozen, tmp_path: Path) -> None:
    store, generated = frozen
    rows = rl_tasks_from_freeze(store, "rl-unit", "train", TaskSource(generated_path=generated),
                                tmp_path / "none.jsonl", check_images=False)
    assert [r["instance_id"] for r in rows] == IDS
    first, second, old = (RLTask.model_validate(r) for r in rows)  # what rl-burst trains on, as a JSONL row would be
    assert first.image_ref == "localhost/forgeflow/task:t0" and first.test_command == "python3 -m pytest -rA"
    assert first.FAIL_TO_PASS == KNOWN[:1] and first.PASS_TO_PASS == KNOWN[1:] and first.patch is None
    assert (first.known_tests, first.pristine_duration_s, second.pristine_duration_s) == (KNOWN, 1.5, 2.5)
    assert old.known_tests is None and old.pristine_duration_s is None  # validated before they were recorded
    assert first.task_timeout_s == 3000.0 and "x = 2" not in first.problem_statement  # the patch never leaks
    assert build_rl_dataset(rows).dataset["known_tests"] == [KNOWN, KNOWN, None]


def test_a_freeze_that_cannot_give_rl_tasks_is_refused_with_the_reason(frozen, tmp_path: Path) -> None:
    store, generated = frozen
    source = TaskSource(generated_path=generated)
    with pytest.raises(InputError, match="freeze 'nope' is not recorded"):
        rl_tasks_from_freeze(store, "nope", "train", source, tmp_path / "none.jsonl", check_images=False)
    with pytest.raises(InputError, match="no split 'valid'"):
        rl_tasks_from_freeze(store, "rl-unit", "valid", source, tmp_path / "none.jsonl", check_images=False)
    store.record_task(TaskRecord(instance_id=IDS[2], repo="proj", status="rejected"))
    with pytest.raises(PreflightError, match=rf"^rl-burst: 1 of 3 task\(s\) cannot run:\n  {IDS[2]}: not an accepted"):
        rl_tasks_from_freeze(store, "rl-unit", "train", source, tmp_path / "none.jsonl", check_images=False)
    store.record_task(TaskRecord(instance_id=IDS[2], repo="proj", status="accepted", FAIL_TO_PASS=KNOWN[:1]))
    parsed = TaskSource(generated_path=generated, test_specs={"proj": TestSpec(test_command="python3 -m unittest -v", log_parser="parse_log_django")})
    with pytest.raises(InputError, match="3 task\\(s\\) are read with a SWE-bench log parser"):
        rl_tasks_from_freeze(store, "rl-unit", "train", parsed, tmp_path / "none.jsonl", check_images=False)


def test_forgeflow_rl_tasks_writes_the_rows_rl_burst_reads(frozen, tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from deployments.cli import app
    from forgeflow.training.jsonl import read_rl_jsonl

    store, generated = frozen
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", store.url)
    out = tmp_path / "rl.jsonl"
    args = ["rl-tasks", "rl-unit", "--out", str(out), "--generated-path", str(generated), "--no-check-images"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "3 RL task(s) of rl-unit/train, 2 with known tests recorded" in done.output
    rows = read_rl_jsonl(out)  # what rl-burst's params.tasks_jsonl takes
    assert [r["instance_id"] for r in rows] == IDS and rows[0]["known_tests"] == KNOWN
    refused = CliRunner().invoke(app, [*args[:1], "nope", *args[2:]])
    assert refused.exit_code == 2 and "freeze 'nope' is not recorded" in refused.output
    # --verl: the same rows as verl's parquet (the ppo flow's train_files), each with its verifier spec
    from datasets import Dataset

    parquet = tmp_path / "train.parquet"
    done = CliRunner().invoke(app, ["rl-tasks", "rl-unit", "--out", str(parquet), "--generated-path", str(generated),
                                    "--no-check-images", "--verl"])
    assert done.exit_code == 0, done.output
    table = Dataset.from_parquet(str(parquet))
    assert [r["ground_truth"] for r in table["reward_model"]] == IDS
    assert [json.loads(e["verifier"])["known_tests"] if "known_tests" in json.loads(e["verifier"]) else None
            for e in table["extra_info"]] == [KNOWN, KNOWN, None]
