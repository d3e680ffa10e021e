"""Every stage flow takes one parameter model, ``params`` (issue 16): frozen, unknown fields refused, every
field documented; a bad ``params`` (an unknown field, a wrong type) given to the flow is refused by Prefect's
parameter validation before the flow body runs, the field named as the user wrote it (``params.<field>``)."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from flows.canary import canary, canary_recover
from flows.curate import curate, recover
from flows.evaluation import harbor_export, harbor_import, judge
from flows.promote import promote
from flows.registry import migrate_images, prewarm_plan, registry_audit, rewrite_image_refs
from flows.stagekit import StageParams
from flows.stages import base_model, compare, freeze, package, publish, serve
from flows.training import ppo, rl_burst, sft_burst, windows

STAGE_FLOWS = [freeze, compare, package, publish, serve, base_model, promote, harbor_export, harbor_import, judge,
               canary, canary_recover, curate, recover, migrate_images, registry_audit, rewrite_image_refs, prewarm_plan,
               sft_burst, rl_burst, ppo, windows]
SFT = {"hf_dir": "/m/hf", "samples_jsonl": "/d/chats.jsonl"}
RL = {"hf_dir": "/m/hf", "tasks_jsonl": "/d/tasks.jsonl"}
VERL = {"model_path": "/m/hf", "train_files": ["/d/train.parquet"], "val_files": ["/d/val.parquet"], "lora_rank": 4}
PPO = {"settings": VERL, "job": {"dashboard_url": "http://127.0.0.1:8265"}}


@pytest.mark.parametrize("stage_flow", [f for f in STAGE_FLOWS if f.on_cancellation_hooks or f.on_crashed_hooks],
                         ids=lambda f: f.name)
def test_a_stage_flows_hooks_take_the_keywords_prefects_runner_passes(stage_flow) -> None:
    """The process worker's runner calls ``on_cancellation`` / ``on_crashed`` hooks by keyword (``flow=``,
    ``flow_run=``, ``state=``; ``prefect.runner._hook_runner``); a hook with other parameter names raises
    TypeError there and a killed run's Ray job or trial pods outlive it (the ppo case is run for real in
    ``tests/flows/test_service.py``)."""
    for hook in [*stage_flow.on_cancellation_hooks, *stage_flow.on_crashed_hooks]:
        inspect.signature(hook).bind(flow=stage_flow, flow_run=None, state=None)


@pytest.mark.parametrize("stage_flow", STAGE_FLOWS, ids=lambda f: f.name)
def test_a_stage_flow_takes_one_documented_frozen_strict_parameter_model(stage_flow) -> None:
    signature = inspect.signature(stage_flow.fn)
    assert list(signature.parameters) == ["params"]
    model = typing.get_type_hints(stage_flow.fn)["params"]
    # a StageParams, or the core's own request model where the flow takes it as is (recover: RecoveryRequest)
    assert issubclass(model, BaseModel) and (issubclass(model, StageParams) or model.__module__.startswith("forgeflow."))
    assert model.model_config["frozen"] is True and model.model_config["extra"] == "forbid"
    undocumented = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert undocumented == [], f"{model.__name__}: fields without a description: {undocumented}"
    default = signature.parameters["params"].default
    if default is not inspect.Parameter.empty:  # a model whose every field has a default: the flow's default
        assert default == model()


def test_a_parameter_model_refuses_unknown_fields_and_is_frozen() -> None:
    from flows.stages import ServeParams

    params = ServeParams(gguf_path="/m/model.gguf")
    with pytest.raises(ValidationError, match="gguf_pth"):
        ServeParams(gguf_pth="/m/model.gguf")
    with pytest.raises(ValidationError, match="frozen"):
        params.gguf_path = Path("/m/other.gguf")


@pytest.mark.parametrize(("stage_flow", "params", "field", "reason"), [
    (judge, {"path": "/tmp/answers.jsonl", "rel_tol": "tight"}, "params.rel_tol", "valid number"),
    (judge, {"path": "/tmp/answers.jsonl", "relative_tol": 0.1}, "params.relative_tol", "Extra inputs"),
    (serve, {"gguf_path": "/m/model.gguf", "ports": [8801, 8802, 8803]}, "params.ports", "at most 2"),
    (serve, {"gguf": "/m/model.gguf"}, "params.gguf_path", "Field required"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "quantisations": ["Q8_0"]}, "params.quantisations",
     "Extra inputs"),
    (freeze, {"name": "v1", "quotas": {"train": "many", "validation": 0, "test": 1, "max_per_repo": 2}},
     "params.quotas.train", "valid integer"),
    (canary, {"freeze_name": "v1", "run": {"concurrency": 0}}, "params.run.concurrency", "greater than or equal to 1"),
    (canary, {"freeze_name": "v1", "endpoint": {"base_url": "http://x/v1", "model_sha": "e" * 64}},
     "params.endpoint.model_sha", "Extra inputs"),
    (canary, {"freeze": "v1"}, "params.freeze", "Extra inputs"),
    (canary_recover, {"endpoint": {"base_url": "http://x/v1"}}, "params.job_id", "Field required"),
    (canary_recover, {"job_id": "j", "concurrency": "two"}, "params.concurrency", "valid integer"),
    (curate, {"settings": {"concurrency": 0}}, "params.settings.concurrency", "greater than or equal to 1"),
    (curate, {"quotas": {"train": 1, "validation": 0, "test": 1, "max_per_repo": 2, "min_repo": 1}},
     "params.quotas.min_repo", "Extra inputs"),
    (curate, {"task": {"candidates_path": "/tmp/c.jsonl"}}, "params.task", "Extra inputs"),
    (curate, {"tasks": {"candidates_path": "/tmp/c.jsonl"}}, "params.tasks", "Extra inputs"),  # now params.source
    (harbor_export, {"candidates_path": "/tmp/c.jsonl"}, "params.candidates_path", "Extra inputs"),  # params.source
    (recover, {"batch_ids": ["b1"]}, "params.reason", "Field required"),
    (recover, {"reason": "r", "dry_run": "perhaps"}, "params.dry_run", "valid boolean"),
    (recover, {"reason": "r"}, "params", "give batch_ids and/or trial_ids, or exception_type with since/until"),
    (recover, {"reason": "r", "exception_type": "SandboxError", "since": "2026-12-01T00:00:00"}, "params.since",
     "must be timezone-aware"),
    (migrate_images, {"images": ["env/a:1"], "transfer": {"concurrency_limit": 65}},
     "params.transfer.concurrency_limit", "less than or equal to 64"),
    (migrate_images, {"image": ["env/a:1"]}, "params.image", "Extra inputs"),
    (migrate_images, {"images": ["env/a:1"], "transfer": {"retry_delays_s": [-1.0]}},
     "params.transfer.retry_delays_s.0", "greater than or equal to 0"),
    (registry_audit, {"images": ["env/a:1"], "image_column": ""}, "params.image_column", "at least 1 character"),
    (registry_audit, {"images": ["env/a:1"], "store": "sqlite:///x.db"}, "params.store", "Extra inputs"),
    (rewrite_image_refs, {"old_prefix": "127.0.0.1:5701"}, "params.new_prefix", "Field required"),
    (rewrite_image_refs, {"old_prefix": "a", "new_prefix": "b", "dry_run": "perhaps"}, "params.dry_run",
     "valid boolean"),
    (prewarm_plan, {"shards": 0}, "params.shards", "greater than or equal to 1"),
    (prewarm_plan, {"tag_cap": "many"}, "params.tag_cap", "valid integer"),
    (prewarm_plan, {"prefix": "Task"}, "params.prefix", "should match pattern"),
    (sft_burst, {**SFT, "params": {"max_steps": 2}}, "params.params", "Extra inputs"),
    (sft_burst, {**SFT, "training": {"packing": "perhaps"}}, "params.training.packing", "valid boolean"),
    (sft_burst, {**SFT, "training": {"max_steps": 0}}, "params.training.max_steps", "greater than or equal to 1"),
    (sft_burst, {**SFT, "training": {"batch_size": 0}}, "params.training.batch_size", "greater than or equal to 1"),
    (sft_burst, {**SFT, "training": {"gradient_checkpoint": True}}, "params.training.gradient_checkpoint",
     "Extra inputs"),
    (sft_burst, {"samples_jsonl": "/d/chats.jsonl"}, "params.hf_dir", "Field required"),
    (rl_burst, {**RL, "sandbox_block": "k8s"}, "params.sandbox_block", "Extra inputs"),
    (rl_burst, {**RL, "training": {"algorithm": "ppo"}}, "params.training.algorithm", "'grpo' or 'rloo'"),
    (rl_burst, {**RL, "training": {"num_generations": 1}}, "params.training.num_generations",
     "greater than or equal to 2"),
    (rl_burst, {**RL, "training": {"temperature": 3}}, "params.training.temperature", "less than or equal to 2"),
    (rl_burst, {"hf_dir": "/m/hf"}, "params", "give tasks_jsonl (a JSONL of RLTask rows) or freeze_name"),
    (rl_burst, {**RL, "freeze_name": "demo-v1"}, "params", "not both"),
    (ppo, {**PPO, "dashboard_url": "http://x"}, "params.dashboard_url", "Extra inputs"),
    (ppo, {**PPO, "job": {"dashboard_url": "http://x", "poll_s": "soon"}}, "params.job.poll_s", "valid number"),
    (ppo, {**PPO, "settings": {**VERL, "lora_rank": -1}}, "params.settings.lora_rank", "greater than or equal to 0"),
    (ppo, {**PPO, "settings": {**VERL, "lora_rnk": 4}}, "params.settings.lora_rnk", "Extra inputs"),
    (ppo, {"settings": VERL}, "params.job", "Field required"),
    (ppo, {**PPO, "job": {"dashboard_url": "http://x", "working_dir": ""}}, "params.job.working_dir",
     "at least 1 character"),
    (windows, {"job_id": "j", "config": {"replay_steps": 2}}, "params.config", "Extra inputs"),
    (windows, {"job_id": "j", "windows": {"replay_steps": 0}}, "params.windows.replay_steps",
     "greater than or equal to 1"),
    (windows, {"job_id": "j", "training": {"max_length": "long"}}, "params.training.max_length", "valid integer"),
    (windows, {"hf_dir": "/m/hf"}, "params", "give job_id"),
    (publish, {"gguf_path": "/m/a.gguf", "hf_dir": "/m/hf", "model_name": "../../escape"}, "params.model_name",
     "must be one path component"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "model_name": ".."}, "params.model_name",
     "must be one path component"),
    # one name per knob (issue 35): the old spellings are refused by name
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "publish": "team-store"}, "params.publish", "Extra inputs"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "publish_checkpoint": True}, "params.publish_checkpoint",
     "Extra inputs"),
    (serve, {"gguf_path": "/m/model.gguf", "serving_block": "gpu"}, "params.serving_block", "Extra inputs"),
    (promote, {"baseline_job": "a", "candidate_job": "b", "gguf_path": "/m/model.gguf", "serving_block": "gpu"},
     "params.serving_block", "Extra inputs"),
    (migrate_images, {"images": ["env/a:1"], "limits": {"concurrency_limit": 8}}, "params.limits", "Extra inputs"),
    # checks of a value alone or of two fields are the parameter model's own (issue 35: no error re-mapped by text)
    (freeze, {"name": "Demo V1"}, "params.name", "freeze name 'Demo V1' is invalid"),
    (curate, {"freeze_name": "Bad Name!"}, "params.freeze_name", "freeze name 'Bad Name!' is invalid"),
    (harbor_export, {"freeze_name": "Bad Name"}, "params.freeze_name", "freeze name 'Bad Name' is invalid"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "quantizations": ["Q3_K"]}, "params.quantizations",
     "quantization 'Q3_K' is not a named plan; valid: ["),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "quantizations": ["Q8_0", {"preset": "Q8_0"}]},
     "params.quantizations", "quantizations repeat the artifact key(s) ['Q8_0']"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "quantizations": ["Q8_0"], "publish_quantization": "Q4_K_M"},
     "params.publish_quantization", "'Q4_K_M' is not one of the artifacts ['f16', 'Q8_0']"),
    (package, {"hf_dir": "/m/hf", "out_dir": "/m/out", "metadata_edits": [
        {"op": "set", "key": "general.name", "value": "x"}, {"op": "delete", "key": "general.architecture"}]},
     "params.metadata_edits", "metadata_edits[1] (key 'general.architecture'): cannot delete"),
    (rewrite_image_refs, {"old_prefix": "http://x", "new_prefix": "127.0.0.1:5750/task-09"}, "params.old_prefix",
     "'http://x' is not host[:port][/path]"),
    (rewrite_image_refs, {"old_prefix": "127.0.0.1:5750", "new_prefix": "127.0.0.1:5750/task-01"}, "params",
     "old_prefix '127.0.0.1:5750' and new_prefix '127.0.0.1:5750/task-01' must not contain each other"),
], ids=["judge-type", "judge-unknown", "serve-type", "serve-missing", "package-unknown",
        "freeze-nested-type", "canary-nested-bound", "canary-nested-unknown", "canary-unknown",
        "canary-recover-missing", "canary-recover-type", "curate-nested-bound", "curate-nested-unknown",
        "curate-unknown", "curate-old-tasks", "harbor-export-flat-source", "recover-missing", "recover-type", "recover-no-selection", "recover-naive-window", "migrate-nested-bound", "migrate-unknown",
        "migrate-nested-item-bound", "audit-bound", "audit-unknown", "rewrite-missing", "rewrite-type",
        "prewarm-bound", "prewarm-type", "prewarm-pattern", "sft-burst-unknown", "sft-burst-nested-type",
        "sft-burst-nested-bound", "sft-burst-batch-bound", "sft-burst-nested-unknown", "sft-burst-missing", "rl-burst-unknown",
        "rl-burst-nested-type", "rl-burst-nested-bound", "rl-burst-core-knob-bound", "rl-burst-missing", "rl-burst-both", "ppo-unknown",
        "ppo-nested-type", "ppo-nested-bound", "ppo-nested-unknown", "ppo-missing", "ppo-empty-working-dir", "windows-unknown",
        "windows-nested-bound", "windows-nested-type", "windows-no-source", "publish-name-path",
        "package-name-dots", "package-old-publish", "package-old-publish-checkpoint", "serve-old-serving-block",
        "promote-old-serving-block", "migrate-old-limits", "freeze-name", "curate-freeze-name",
        "harbor-export-freeze-name", "package-unknown-plan", "package-repeated-key", "package-publish-not-made",
        "package-edit", "rewrite-prefix", "rewrite-nested-prefixes"])
def test_a_bad_params_is_refused_through_the_flow_with_the_field_named(prefect_harness, flow_home, stage_flow,
                                                                       params, field, reason) -> None:
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError) as refused:
        stage_flow(params=params)
    message = str(refused.value)
    assert field in message and reason in message, message


def test_the_ppo_flow_names_the_settings_field_it_refuses(prefect_harness, flow_home, tmp_path: Path) -> None:
    """Refused before anything is submitted (no Ray cluster here), the field named as the user wrote it."""
    from forgeflow.common.errors import InputError

    with pytest.raises(InputError, match=r"^params.settings.lora_rank is 0"):
        ppo(params={**PPO, "settings": {**VERL, "lora_rank": 0}})
    for never in (-1, 0):  # verl saves no checkpoint: nothing to ingest after the whole run
        with pytest.raises(InputError, match=rf"^params.settings.save_freq_steps is {never}: verl would save no"):
            ppo(params={**PPO, "settings": {**VERL, "save_freq_steps": never}})
    with pytest.raises(InputError, match=r"^params.settings.model_path '/m/hf' is not a folder here: give "
                                         r"params.job.base_model_sha256"):
        ppo(params=PPO)


def test_the_ppo_cancel_hook_stops_the_job_its_params_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_stop_ppo_job`` reads ``params.job.dashboard_url`` and ``params.submission_id`` from the run's
    parameters (JSON, as the API holds them, or the model), default id ``forgeflow-ppo-<run id>``."""
    from types import SimpleNamespace

    from flows.training import PPOParams, _stop_ppo_job
    from forgeflow.training import ray_jobs

    stopped: list[tuple[str, str]] = []
    monkeypatch.setattr(ray_jobs, "stop", lambda url, submission_id: stopped.append((url, submission_id)))
    _stop_ppo_job(None, SimpleNamespace(id="r1", parameters={"params": {**PPO, "submission_id": "job-7"}}), None)
    _stop_ppo_job(None, SimpleNamespace(id="r2", parameters={"params": PPOParams(**PPO)}), None)
    assert stopped == [("http://127.0.0.1:8265", "job-7"), ("http://127.0.0.1:8265", "forgeflow-ppo-r2")]
