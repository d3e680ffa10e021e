"""Ingesting a verl PPO job's checkpoint: only one the job wrote is taken, never one an earlier job left
in the same checkpoint folder (regression: a second run whose job wrote nothing was credited with the
first run's ``global_step_2`` adapter). Plain files stand in for peft adapters: nothing is loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forgeflow.common.errors import InfraError, InputError
from forgeflow.training.ppo import (
    checkpoints_before,
    kept_if_accepted,
    local_checkpoint_dir,
    newest_adapter,
    read_checkpoints_before,
    record_path,
    write_checkpoints_before,
)


def _save(root: Path, step: int, weights: bytes = b"weights", later_s: int = 0) -> Path:
    """A peft adapter of ``step`` in verl's layout; ``later_s``: its files' mtime moved that many seconds on
    (a file rewritten in place within the clock's granularity would otherwise keep its stamp)."""
    folder = root / f"global_step_{step}" / "actor" / "lora_adapter"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("adapter_config.json", b"{}"), ("adapter_model.safetensors", weights)):
        path = folder / name
        path.write_bytes(data)
        if later_s:
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + later_s * 10**9))
    return folder


def test_an_earlier_jobs_checkpoints_are_not_this_jobs(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1), _save(root, 2)
    before = checkpoints_before(root, "job-2")
    assert before.step_folders() == ["global_step_1", "global_step_2"]
    assert newest_adapter(root) == (root / "global_step_2/actor/lora_adapter", 2)  # without a record: the old way
    with pytest.raises(InfraError) as info:
        newest_adapter(root, before=before)  # the job wrote nothing
    message = str(info.value)
    assert f"under {root} was written by Ray job job-2: the job wrote no adapter" in message
    assert "The 2 checkpoints there (steps 1, 2) predate the job" in message


def test_only_what_the_job_wrote_or_rewrote_is_ingested(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, 1), _save(root, 2)
    before = checkpoints_before(root, "job-2")
    _save(root, 1, later_s=1)  # the job rewrites step 1 in place with the same bytes: its own
    assert newest_adapter(root, before=before) == (root / "global_step_1/actor/lora_adapter", 1)
    _save(root, 3)  # and saves a new step
    assert newest_adapter(root, before=before)[1] == 3


def test_a_checkpoint_the_job_changed_is_its_own_and_refused_when_not_an_adapter(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    folder = _save(root, 1)
    before = checkpoints_before(root, "job-2")
    (folder / "adapter_model.safetensors").unlink()  # the folder changed: no longer the earlier job's
    with pytest.raises(InfraError, match="lacks adapter_model.safetensors: not a peft adapter"):
        newest_adapter(root, before=before)


def test_a_fresh_folder_is_all_the_jobs_and_a_record_of_another_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    before = checkpoints_before(root, "job-1")  # the folder does not exist yet
    assert before.stamps == {} and before.checkpoint_dir == root.resolve()
    with pytest.raises(InfraError, match="no checkpoint matches .* the job wrote no adapter"):
        newest_adapter(root, before=before)
    _save(root, 1)
    assert newest_adapter(root, before=before)[1] == 1
    with pytest.raises(InputError, match="record of Ray job job-1 is of"):
        newest_adapter(tmp_path / "other", before=before)


def test_the_record_is_kept_only_for_an_accepted_job_and_read_back_on_a_rerun(tmp_path: Path) -> None:
    root, home = tmp_path / "ckpt", tmp_path / "home"
    _save(root, 1), _save(root, 2)
    path = record_path(home, "job-2")
    assert path == home / "ppo" / "job-2" / "checkpoints-before.json"
    with pytest.raises(RuntimeError, match="refused"), kept_if_accepted(path, checkpoints_before(root, "job-2")):
        raise RuntimeError("refused")  # the job server refused the job: nothing recorded
    assert not path.exists() and list(path.parent.iterdir()) == []
    with kept_if_accepted(path, checkpoints_before(root, "job-2")):
        pass  # accepted
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    _save(root, 2, weights=b"trained", later_s=1)  # the job's own step 2
    for _ in range(2):  # a re-run of the same job ingests the same checkpoint: the record is not retaken
        assert newest_adapter(root, before=read_checkpoints_before(path, "job-2"))[1] == 2
    with pytest.raises(InfraError, match=r"no record of what the checkpoint folder held before Ray job job-3"):
        read_checkpoints_before(record_path(home, "job-3"), "job-3")
    with pytest.raises(InputError, match="is of Ray job job-2, not job-4"):
        read_checkpoints_before(path, "job-4")
    document = json.loads(path.read_text())
    document["stamps"] = {}
    path.write_text(json.dumps(document))
    with pytest.raises(InputError, match="was altered"):
        read_checkpoints_before(path, "job-2")
    write_checkpoints_before(path, checkpoints_before(root, "job-2"))  # a newly accepted job of that id: replaced
    assert read_checkpoints_before(path, "job-2").stamps
    with pytest.raises(InputError, match="not a plain name"):
        record_path(home, "..")


def test_a_relative_checkpoint_dir_is_under_the_jobs_working_dir() -> None:
    assert local_checkpoint_dir("ckpt/ppo", "/srv/repo") == Path("/srv/repo/ckpt/ppo")
    assert local_checkpoint_dir("/data/ckpt", "/srv/repo") == Path("/data/ckpt")
    assert local_checkpoint_dir("ckpt/ppo", None) == Path("ckpt/ppo")
