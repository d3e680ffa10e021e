"""The burst preflight as the flows run it: the ``burst_preflight`` task that the lifecycle's burst
stage calls before its ``sft_burst`` task, and the preflight at the start of the ``rl_burst`` task.

A model folder is the seed-0 tiny model's ``config.json`` (real shapes for the disk estimate) with
its chat template emptied or removed; no model is loaded. The flow test runs a burst stage the way
``flows/lifecycle.py`` composes it (``StageLog.stage("burst")``: preflight task, then the
``sft_burst`` task) in the session's Prefect test harness and checks what a person would see: the
flow run fails with every problem named, the stage's ``summary.json`` record says so, and no
adapter or staging folder was written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import PreflightError
from forgeflow.common.settings import cache_dir
from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.training import preflight
from forgeflow.training.burst import BurstConfig
from forgeflow.training.preflight import chat_template_files, estimate_checkpoint_bytes
from forgeflow.training.rl import DEFAULT_PROMPT_TEMPLATE, RLBurstConfig
from tasks import training as training_tasks

SAMPLES = [{"instance_id": "calc-1", "source": "oracle",
            "messages": [{"role": "user", "content": "fix add"}, {"role": "assistant", "content": "--- a/x\n+++ b/x"}]}]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The seed-0 tiny model (built once per machine, shared with the burst tests)."""
    return build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0).path


def _model_folder(tiny_model: Path, root: Path, template: str | None) -> Path:
    """``config.json`` of the tiny model, and a chat template with ``template`` (None: no template)."""
    folder = root / "base"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def test_preflight_task_passes_on_the_real_model_and_reports_what_it_measured(tiny_model: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "models" / "adapter"
    report = training_tasks.burst_preflight.fn(tiny_model, out_dir, 8, ("q_proj", "v_proj"))
    (template,) = chat_template_files(tiny_model)
    assert report.template_files == {str(template): template.stat().st_size} and template.stat().st_size > 0
    assert report.required_free_bytes == estimate_checkpoint_bytes(tiny_model, 8, ("q_proj", "v_proj"))
    assert report.free_bytes >= report.required_free_bytes and report.checkpoint_dir == out_dir.parent


def test_burst_stage_fails_on_an_empty_chat_template_before_training(
        prefect_harness, tiny_model: Path, tmp_path: Path) -> None:
    from prefect import flow

    from flows.stagekit import StageLog

    base = _model_folder(tiny_model, tmp_path, template="  \n")
    out_dir = tmp_path / "models" / "adapter"
    summary = tmp_path / "summary.json"

    @flow(name="burst-stage-preflight")
    def burst_stage() -> None:
        log = StageLog(summary, None)
        config = BurstConfig(max_steps=1)
        with log.stage("burst"):
            training_tasks.burst_preflight(base, out_dir, config.lora_r, config.lora_target_modules)
            log.call(training_tasks.sft_burst, base, "0" * 64, SAMPLES, out_dir, config, None, "run")

    with pytest.raises(PreflightError, match=rf"burst preflight failed: template file {base}/chat_template.jinja is empty"):
        burst_stage()
    stage = json.loads(summary.read_text())["stages"]["burst"]
    assert stage["status"] == "failed" and stage["tasks_run"] == 0  # sft_burst never started
    assert stage["error"].startswith("PreflightError: burst preflight failed") and "chat_template.jinja is empty" in stage["error"]
    assert not out_dir.exists() and list(out_dir.parent.glob(".adapter.*")) == []


def test_rl_burst_task_lists_every_preflight_problem_before_compute(tiny_model: Path, tmp_path: Path) -> None:
    base = _model_folder(tiny_model, tmp_path, template=None)  # no chat template at all
    prompt = tmp_path / "prompt.md"
    prompt.write_text("")
    out_dir = tmp_path / "models" / "rl"
    task = {"instance_id": "calc-1", "image_ref": "img", "problem_statement": "add fails", "test_command": "pytest",
            "FAIL_TO_PASS": ["t::a"], "verifier_timeout_s": 60.0}
    with pytest.raises(PreflightError) as info:
        training_tasks.rl_burst.fn(training_tasks.BurstInputs(hf_dir=base, rows=[task], parent_dir=None), "0" * 64,
                                   None, out_dir, RLBurstConfig(), "run", prompt)
    message = str(info.value)
    assert f"template file {base}/chat_template.jinja does not exist" in message
    assert f"template file {prompt} is empty" in message
    assert not out_dir.parent.exists()  # nothing written, no model loaded
    # the shipped prompt template passes the same check
    assert preflight.burst_preflight(tiny_model, out_dir, 8, ("q_proj",), [DEFAULT_PROMPT_TEMPLATE]).template_files


def test_the_rl_burst_cache_key_is_what_it_trains_on_not_where_its_rewards_run(tmp_path: Path) -> None:
    """The ``rl_burst`` task's cache key: the folders, the digests, the tasks, the config (and the task's
    source) change it; the run id and the Ray placement do not (a burst moved onto Ray, or re-run by a later
    flow run, is answered from the cache)."""
    from types import SimpleNamespace

    from forgeflow.common.errors import InputError
    from forgeflow.sandbox.dispatch import RayPlacement

    policy = training_tasks.rl_burst.cache_policy
    context = SimpleNamespace(task=training_tasks.rl_burst)
    task = {"instance_id": "calc-1", "image_ref": "img", "problem_statement": "add fails", "test_command": "pytest",
            "FAIL_TO_PASS": ["t::a"], "verifier_timeout_s": 60.0}
    burst = training_tasks.BurstInputs(hf_dir=tmp_path / "base", rows=[task], parent_dir=None)
    inputs = {"inputs": burst, "base_sha256": "0" * 64, "parent_sha256": None, "out_dir": tmp_path / "rl",
              "config": RLBurstConfig(), "run_id": "run-1", "prompt_template": DEFAULT_PROMPT_TEMPLATE, "ray": None}

    def key(**changes: object) -> str:
        return policy.compute_key(task_ctx=context, inputs={**inputs, **changes}, flow_parameters={})

    assert key() == key(run_id="run-2") == key(ray=RayPlacement(address="127.0.0.1:9"))
    parent = burst.model_copy(update={"parent_dir": tmp_path / "parent"})
    other = {key(base_sha256="1" * 64), key(inputs=parent, parent_sha256="a" * 64),
             key(inputs=parent, parent_sha256="b" * 64),
             key(inputs=burst.model_copy(update={"rows": [{**task, "instance_id": "calc-2"}]})),
             key(config=RLBurstConfig(max_steps=3))}
    assert key() not in other and len(other) == 5
    with pytest.raises(InputError, match="parent_dir and parent_sha256 go together"):
        training_tasks.rl_burst.fn(parent, "0" * 64, None, tmp_path / "rl", RLBurstConfig(), "run")
