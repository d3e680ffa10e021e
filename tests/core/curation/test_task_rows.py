"""The task-row loader the curate and canary flows share (forgeflow.curation.task_rows): the team's
JSONL, a HF ``datasets`` split (saved folder and ``load_dataset``), SWE-bench's field shapes, and
per-repository test specifications with SWE-bench log parsers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.curation.task_rows import DatasetSource, TaskSource, TestSpec, load_task_rows

PATCH = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
NOT_THERE = Path("/nonexistent/candidates.jsonl")


def _swebench_row(instance_id: str, repo: str, **extra: object) -> dict:
    """A row as SWE-bench publishes it: test lists as JSON strings, the image as image_name."""
    return {"instance_id": instance_id, "repo": repo, "patch": PATCH, "base_commit": "abc123",
            "problem_statement": f"{instance_id}: the parser drops the last token",
            "FAIL_TO_PASS": json.dumps(["test_last (tests.test_m.T.test_last)"]),
            "PASS_TO_PASS": json.dumps(["test_first (tests.test_m.T.test_first)"]),
            "image_name": f"registry.example:5000/sweb.eval.{instance_id}:v1", **extra}


def test_jsonl_rows_take_their_specs_from_the_row_then_the_repository(tmp_path: Path) -> None:
    rows = [_swebench_row("django__django-1", "django/django"),
            _swebench_row("sympy__sympy-2", "sympy/sympy", test_command="bin/test -C --verbose",
                          log_parser="parse_log_sympy")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = {"django/django": TestSpec(test_command="./tests/runtests.py --verbosity 2",
                                       log_parser="parse_log_django"),
             "sympy/sympy": TestSpec(test_command="python -m pytest", log_parser=None)}
    loaded = load_task_rows(path, None, NOT_THERE, test_specs=specs)
    assert [r.instance_id for r in loaded.rows] == ["django__django-1", "sympy__sympy-2"]
    django, sympy = loaded.rows
    assert django.image_ref == "registry.example:5000/sweb.eval.django__django-1:v1"  # from image_name
    assert django.FAIL_TO_PASS == ["test_last (tests.test_m.T.test_last)"]  # JSON string decoded
    assert django.problem_statement == "django__django-1: the parser drops the last token"
    assert loaded.test_commands == {"django__django-1": "./tests/runtests.py --verbosity 2",
                                    "sympy__sympy-2": "bin/test -C --verbose"}  # the row's own wins
    assert loaded.log_parsers == {"django__django-1": "parse_log_django", "sympy__sympy-2": "parse_log_sympy"}
    assert loaded.source == str(path)


def test_a_saved_dataset_dict_is_read_by_split_and_a_missing_split_is_named(tmp_path: Path) -> None:
    import datasets

    train = [_swebench_row(f"acme__widgets-{n}", "acme/widgets") for n in range(3)]
    test = [_swebench_row("acme__widgets-9", "acme/widgets")]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "ds"))
    specs = {"acme/widgets": TestSpec(test_command="python3 -m unittest -v", log_parser="parse_log_django")}
    loaded = load_task_rows(None, None, NOT_THERE, dataset=DatasetSource(path=str(tmp_path / "ds"), split="train"),
                            test_specs=specs)
    assert [r.instance_id for r in loaded.rows] == ["acme__widgets-0", "acme__widgets-1", "acme__widgets-2"]
    assert all(r.image_ref and r.image_ref.endswith(":v1") for r in loaded.rows)
    assert set(loaded.log_parsers.values()) == {"parse_log_django"}
    assert loaded.source == f"dataset {tmp_path / 'ds'}[train]"
    with pytest.raises(InputError, match=r"no split 'validation'; its splits: \['test', 'train'\]"):
        load_task_rows(None, None, NOT_THERE, dataset=DatasetSource(path=str(tmp_path / "ds"), split="validation"),
                       test_specs=specs)


def test_load_dataset_reads_a_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "test.jsonl").write_text("".join(json.dumps(_swebench_row(f"acme__gadgets-{n}", "acme/gadgets")) + "\n"
                                               for n in range(2)))
    loaded = load_task_rows(None, None, NOT_THERE, dataset=DatasetSource(path=str(folder), split="test"),
                            test_commands={"acme/gadgets": "python3 -m pytest -rA"})
    assert [r.instance_id for r in loaded.rows] == ["acme__gadgets-0", "acme__gadgets-1"]
    assert set(loaded.test_commands.values()) == {"python3 -m pytest -rA"}
    assert set(loaded.log_parsers.values()) == {None}  # forgeflow's pytest report
    with pytest.raises(InputError, match=r"dataset .*nowhere.* cannot be read"):
        load_task_rows(None, None, NOT_THERE, dataset=DatasetSource(path=str(tmp_path / "nowhere"), split="test"))


def test_bad_specs_and_sources_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_swebench_row("acme__x-1", "acme/x")) + "\n")
    with pytest.raises(InputError, match=r"unknown log parser\(s\) \['parse_log_nope'\]; valid: .*parse_log_django"):
        load_task_rows(path, None, NOT_THERE, test_specs={"acme/x": TestSpec(test_command="t",
                                                                             log_parser="parse_log_nope")})
    with pytest.raises(InputError, match=r"no test_command for repos \['acme/x'\]"):
        load_task_rows(path, None, NOT_THERE)
    with pytest.raises(InputError, match="give one of candidates_path, dataset, generated_path; got candidates_path, "
                                         "dataset"):
        load_task_rows(path, None, NOT_THERE, dataset=DatasetSource(path=str(tmp_path)))
    with pytest.raises(InputError, match="no candidates file at /nonexistent/candidates.jsonl"):
        load_task_rows(None, None, NOT_THERE)


def test_a_task_source_parameter_group_loads_as_the_loader_does_and_refuses_two_sources(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_swebench_row("acme__widgets-1", "acme/widgets")) + "\n")
    source = TaskSource.model_validate({"candidates_path": str(path),
                                        "test_specs": {"acme/widgets": {"test_command": "python3 -m unittest -v",
                                                                        "log_parser": "parse_log_django"}}})
    loaded = source.load(NOT_THERE, "canary")
    assert loaded.test_commands == {"acme__widgets-1": "python3 -m unittest -v"}
    assert loaded.log_parsers == {"acme__widgets-1": "parse_log_django"}
    with pytest.raises(InputError, match="canary: give one of candidates_path, dataset, generated_path"):
        TaskSource(candidates_path=path, generated_path=path).load(NOT_THERE, "canary")


def test_generated_rows_run_the_local_image_or_the_lifecycles_pushed_copy(tmp_path: Path) -> None:
    """The lifecycle's validate stage reads its generated rows with ``images="registry"``: the trials pull
    the copy it pushed into its shard (keyed by the registry's digest), not the local build."""
    from forgeflow.curation.generated import GeneratedTask, write_generated

    def row(instance_id: str, pushed: bool) -> GeneratedTask:
        return GeneratedTask(instance_id=instance_id, repo="toolz", patch=PATCH, modifier="func_pm_remove_assign",
                             file_path="toolz/itertoolz.py", func_name="take", image=f"localhost/forgeflow/task:{instance_id}", image_id="a" * 64,
                             registry_ref=f"127.0.0.1:5722/task-03:{instance_id}" if pushed else None,
                             registry_digest="sha256:" + "b" * 64 if pushed else None, test_command="pytest -rA")

    path = write_generated(tmp_path / "candidates.jsonl", [row("toolz.func_pm_remove_assign__0000aaa1", True)])
    local = TaskSource(generated_path=path).load(NOT_THERE, "curate")
    assert [r.image_ref for r in local.rows] == ["localhost/forgeflow/task:toolz.func_pm_remove_assign__0000aaa1"]
    assert local.image_ids == {"toolz.func_pm_remove_assign__0000aaa1": "a" * 64}
    pushed = TaskSource(generated_path=path, images="registry").load(NOT_THERE, "curate")
    assert [r.image_ref for r in pushed.rows] == ["127.0.0.1:5722/task-03:toolz.func_pm_remove_assign__0000aaa1"]
    assert pushed.image_ids == {"toolz.func_pm_remove_assign__0000aaa1": "sha256:" + "b" * 64}
    assert pushed.test_commands == {"toolz.func_pm_remove_assign__0000aaa1": "pytest -rA"}

    write_generated(path, [row("toolz.func_pm_remove_assign__0000aaa1", True), row("toolz.func_pm_remove_assign__0000aaa2", False)])
    with pytest.raises(InputError, match=r"curate: images='registry', but 1 row\(s\) of .* have no registry_ref "
                                         r"\(never pushed by the lifecycle\): toolz.func_pm_remove_assign__0000aaa2"):
        TaskSource(generated_path=path, images="registry").load(NOT_THERE, "curate")
    users = tmp_path / "rows.jsonl"
    users.write_text(json.dumps(_swebench_row("acme__widgets-1", "acme/widgets")) + "\n")
    with pytest.raises(InputError, match="images='registry' applies to generated rows only"):
        TaskSource(candidates_path=users, images="registry").load(NOT_THERE, "canary")
