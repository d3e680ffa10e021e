"""RL bursts: GRPO (Shao et al. 2024) or RLOO (Ahmadian et al. 2024) with LoRA through TRL 1.16, rewarded by
the task's verifier. An infrastructure failure's reward is None: TRL 1.16 makes it NaN
(``GRPOTrainer._calculate_rewards``), drops it from ``nanmean``/``nanstd`` and zeroes its advantage.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_file, sha256_json
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import Cpus, LimitOverrides, MemoryMb, SandboxLimits
from forgeflow.training import vl_burst
from forgeflow.training.adapters import (
    LINEAGE_FILE,
    AdapterRecord,
    Lineage,
    LoraSettings,
    lora_config,
    publish_adapter,
    read_adapter_record,
    resolve_lineage_inputs,
)
from forgeflow.training.burst import TRAINER_RUN_ARGS, BurstData
from forgeflow.training.device import DeviceChoice, DevicePlan, device_plan
from forgeflow.training.episodes import EpisodeSettings, Policy
from forgeflow.training.episodes_grpo import EpisodeRollout, EpisodeStepStats, episode_reward
from forgeflow.training.health import (
    BurstHealthError,
    HealthGates,
    check_health,
    enforce_health,
    health_callback,
)
from forgeflow.training.preflight import burst_preflight, preflight
from forgeflow.training.rewards import (
    RL_VERIFIER_LIMITS,
    StepRewardCounts,
    VerifierReward,
    VerifierSpec,
    training_timeout_s,
)
from forgeflow.training.staging import StagingDir, remove_dead_staging_dirs

DEFAULT_PROMPT_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "rl_prompt.md"
"""The user prompt of an RL rollout; ``{problem_statement}`` is replaced by the task's text."""

PROMPT_PLACEHOLDER = "{problem_statement}"



# --- tasks and data ----------------------------------------------------------------------------
class RLTask(VerifierSpec):
    """One task an RL burst samples fixes for: the verifier's spec plus the problem statement (never the patch).

    Stricter than ``VerifierSpec``: an empty FAIL_TO_PASS would reward a no-op completion 1, so it is refused
    (``pydantic.ValidationError``).
    """

    problem_statement: str = Field(min_length=1, description="The issue text the policy is prompted with.")
    FAIL_TO_PASS: list[str] = Field(validation_alias=AliasChoices("FAIL_TO_PASS", "fail_to_pass"),
                                    description="Test ids the fix must make pass (at least one).")

    @field_validator("FAIL_TO_PASS")
    @classmethod
    def _a_failing_test(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("no test: an RL task needs at least one FAIL_TO_PASS test (without one, a completion "
                             "that changes nothing is rewarded)")
        return value

    @field_validator("patch")
    @classmethod
    def _never_the_patch(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("an RL task never carries the bug patch (the answer's inverse)")
        return None


def build_rl_dataset(tasks: Sequence[RLTask | dict],
                     prompt_template: Path = DEFAULT_PROMPT_TEMPLATE) -> BurstData:
    """Render each task's prompt from ``prompt_template`` (``{problem_statement}`` replaced verbatim): the RL
    dataset with its digest (``sha256_json`` of the rows: it covers the rendered prompts) and the template's.

    The test columns are ``FAIL_TO_PASS`` / ``PASS_TO_PASS``, as :class:`~forgeflow.common.task.Task` spells them
    (lowercase until issue 35: a dataset's digest, and so an RL adapter's lineage, changed once with the rename).
    ``known_tests`` is a column only when some task has them, so older digests stay the same.

    Raises:
        InputError: ``tasks`` is empty, a task is malformed (index and field named), ``instance_id``
            repeats, or the template lacks the placeholder.
        PreflightError: the template file is missing or empty.
    """
    from datasets import Dataset
    from pydantic import ValidationError

    if not tasks:
        raise errors.InputError("tasks is empty: an RL dataset needs at least one task")
    preflight(template_files=[Path(prompt_template)])
    template = Path(prompt_template).read_text(encoding="utf-8")
    if PROMPT_PLACEHOLDER not in template:
        raise errors.InputError(f"prompt_template {prompt_template} does not contain {PROMPT_PLACEHOLDER}")
    rows, seen, valid = [], set(), []
    for i, raw in enumerate(tasks):
        try:
            task = raw if isinstance(raw, RLTask) else RLTask.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "task"
            raise errors.InputError(f"tasks[{i}].{field}: {first['msg']}") from exc
        if task.instance_id in seen:
            raise errors.InputError(f"tasks[{i}].instance_id {task.instance_id!r} repeats")
        seen.add(task.instance_id)
        valid.append(task)
        rows.append({
            "prompt": [{"role": "user", "content": template.replace(PROMPT_PLACEHOLDER, task.problem_statement)}],
            "instance_id": task.instance_id,
            "image_ref": task.image_ref,
            "test_command": task.test_command,
            "FAIL_TO_PASS": list(task.FAIL_TO_PASS),
            "PASS_TO_PASS": list(task.PASS_TO_PASS),
            "task_timeout_s": float(task.task_timeout_s),
            "pristine_duration_s": None if task.pristine_duration_s is None else float(task.pristine_duration_s),
        })
    if any(task.known_tests for task in valid):  # the column only where recorded: older datasets keep their digest
        for task, row in zip(valid, rows):
            row["known_tests"] = list(task.known_tests) if task.known_tests else None
    return BurstData(dataset=Dataset.from_list(rows), sha256=sha256_json(rows), prompt_template=Path(prompt_template),
                     prompt_template_sha256=sha256_file(prompt_template))


# --- the burst ---------------------------------------------------------------------------------
def _rl_gates() -> HealthGates:
    """RL default gates: the loss trend is off — the GRPO/RLOO loss is a policy surrogate whose
    level says nothing about progress (it is 0 whenever the advantages are)."""
    return HealthGates(loss_trend_window=0)


class RLBurstConfig(LoraSettings):
    """Hyperparameters of one RL burst: the ``rl-burst`` flow's ``params.training`` (flat, TRL-style names shared
    with :class:`~forgeflow.training.burst.BurstConfig`; translated in :func:`_trl_objects`).

    Rows per step (TRL's ``per_device_train_batch_size``) = ``prompts_per_step`` x ``num_generations``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: Literal["grpo", "rloo"] = Field("grpo", description="grpo or rloo (TRL trainers)")
    max_steps: int = Field(2, ge=1, le=100_000, description="optimizer steps")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="constant learning rate (no warm-up)")
    prompts_per_step: int = Field(1, ge=1, le=4096, description="distinct prompts per optimizer step, each "
                                  "sampled num_generations times")
    num_generations: int = Field(2, ge=2, le=64, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(128, ge=1, le=32_768, description="tokens per completion")
    temperature: float = Field(1.0, gt=0.0, le=2.0, description="sampling temperature of the rollouts")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient against the base policy (0: no reference model)")
    seed: int = Field(0, description="training, data-order and sampling seed")
    verifier_timeout_multiplier: float = Field(0.06, gt=0.0, le=10.0, description="the training verifier's "
                                               "timeout = each task's task_timeout_s (seconds, default 3000) x "
                                               "this, never below 5 x its pristine_duration_s")
    verifier_memory_mb: MemoryMb | None = Field(None, description="memory limit of each verifier container, MiB; "
                                                "null: the sandbox block's, else 1024")
    verifier_cpus: Cpus | None = Field(None, description="CPU quota of each verifier container, cores; null: the "
                                       "sandbox block's, else 1")
    verifier_concurrency: int = Field(1, ge=1, le=32, description="verifier sandboxes at once")
    min_scored_fraction: float = Field(0.5, ge=0.0, le=1.0, description="least fraction of completions that must "
                                       "get a reward (not an exception); below it the burst fails")
    gates: HealthGates = Field(default_factory=_rl_gates, description="health gates the burst must pass for its "
                               "adapter to be written (the loss trend off: a policy surrogate's level says "
                               "nothing)")
    device: DeviceChoice = Field("auto", description="auto: CUDA in bfloat16 when the worker has a GPU, else the CPU "
                                 "in float32; cpu; or cuda (refused where CUDA is not available)")
    episode: EpisodeSettings | None = Field(None, exclude_if=lambda v: v is None, description="the agentic mode: "
                                            "each rollout a multi-turn episode (bash in the task's container, "
                                            "submit) in a fresh sandbox, rewarded by the verifier; grpo only; "
                                            "null: single-turn rollouts")

    @model_validator(mode="after")
    def _agentic_needs_grpo(self) -> "RLBurstConfig":
        if self.episode is not None and self.algorithm != "grpo":
            raise ValueError("episode (the agentic mode) needs algorithm 'grpo': TRL's RLOOTrainer takes no "
                             "rollout function")
        return self

    def verifier_limits(self, block: SandboxLimits | None = None) -> SandboxLimits:
        """The verifier's limits: this config's where set, else ``block``'s (the sandbox block), else
        :data:`~forgeflow.training.rewards.RL_VERIFIER_LIMITS`."""
        own = LimitOverrides(memory_mb=self.verifier_memory_mb, cpus=self.verifier_cpus)
        return own.over(block if block is not None else RL_VERIFIER_LIMITS)

    def resolved(self, block: SandboxLimits | None = None) -> "RLBurstConfig":
        """This config with the verifier's limits filled in (:meth:`verifier_limits`): what a burst records."""
        limits = self.verifier_limits(block)
        return self.model_copy(update={"verifier_memory_mb": limits.memory_mb, "verifier_cpus": limits.cpus})


class RLBurstRecord(BaseModel):
    """An RL burst's adapter, its reward counts per step and its episode stats; ``weights_changed`` False: no
    gradient flowed, nothing was learned (:func:`trainable_digest`).
    """

    model_config = ConfigDict(frozen=True)

    adapter: AdapterRecord
    reward_counts: list[StepRewardCounts]
    weights_changed: bool
    episode_stats: list[EpisodeStepStats] = Field(default_factory=list)

    def totals(self) -> StepRewardCounts:
        """The counts summed over steps (``step`` is the last step)."""
        return StepRewardCounts.total(self.reward_counts)


def _trl_objects(config: RLBurstConfig, output_dir: Path, with_lora: bool,
                 plan: DevicePlan | None = None, vision: bool = False) -> tuple[Any, Any]:
    """Translate :class:`RLBurstConfig` into ``(trl.GRPOConfig | trl.RLOOConfig, peft.LoraConfig | None)``; on a
    ``vision`` base the LoRA adapts the language model only (:func:`~forgeflow.training.vl_burst.vl_lora_config`)."""
    if config.algorithm == "grpo":
        from trl import GRPOConfig as TrainerConfig
    else:
        from trl import RLOOConfig as TrainerConfig
    args = TrainerConfig(
        output_dir=str(output_dir),
        learning_rate=config.learning_rate,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.prompts_per_step * config.num_generations,
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        beta=config.beta,
        seed=config.seed,
        data_seed=config.seed,
        **TRAINER_RUN_ARGS,
        **(plan or device_plan(config.device)).trainer_args,
    )
    if not with_lora:
        return args, None
    if vision:
        return args, vl_burst.vl_lora_config(config.lora_r, config.lora_alpha, config.lora_dropout,
                                             config.lora_target_modules)
    return args, lora_config(config)


def _policy(base_model_dir: Path, parent_adapter_dir: Path | None, plan: DevicePlan, tokenizer: Any,
            data: BurstData) -> tuple[Any, vl_burst.VLBurstInputs | None]:
    """``(policy, tower)``: the model an RL burst trains (the parent adapter loaded trainable) and None; on an
    image-text-to-text base (tiny-vl) the model with its vision tower frozen
    (:func:`~forgeflow.training.vl_burst.load_vl_model`; the prompts stay text) and the tower's digests that
    :func:`~forgeflow.training.vl_burst.check_tower_unchanged` compares after training."""
    from transformers import AutoModelForCausalLM

    tower = None
    if vl_burst.is_image_text_model(base_model_dir):
        model = vl_burst.load_vl_model(base_model_dir, {"dtype": plan.torch_dtype()})
        tower = vl_burst.VLBurstInputs(model=model, processor=tokenizer, dataset=data.dataset,
                                       vision_tower_sha256=vl_burst.vision_tower_sha256(base_model_dir),
                                       state_sha256=vl_burst.vision_state_sha256(model))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=plan.torch_dtype())
    if parent_adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
    return model, tower


def _reusable_rl(out_dir: Path, expected: dict[str, Any]) -> RLBurstRecord | None:
    """The RL burst already in ``out_dir`` if it was trained from the same inputs and passed its gates."""
    import json

    if not (out_dir / LINEAGE_FILE).is_file():
        return None
    try:
        record = read_adapter_record(out_dir)
        written = json.loads((out_dir / LINEAGE_FILE).read_text(encoding="utf-8"))
        counts = written.get("reward_counts")
    except (errors.InputError, KeyError, ValueError):
        return None
    lineage = record.lineage
    found = {"algorithm": lineage.algorithm, "base_model_sha256": lineage.base_model_sha256,
             "parent_adapter_sha256": lineage.parent_adapter_sha256, "dataset_sha256": lineage.dataset_sha256,
             "hyperparameters": lineage.hyperparameters}
    if found != expected or not record.promotable or counts is None:
        return None
    changed = written.get("weights_changed")
    if changed is None:  # written before the burst measured it: only a parent's digest tells
        changed = lineage.parent_adapter_sha256 != record.sha256
    return RLBurstRecord(adapter=record, reward_counts=[StepRewardCounts.model_validate(c) for c in counts],
                         weights_changed=bool(changed),
                         episode_stats=[EpisodeStepStats.model_validate(e) for e in written.get("episode_stats", [])])


def trainable_digest(model: Any) -> str:
    """sha256 of the trainable parameters (float32 values, in order): equal exactly when no weight moved."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _check_scored(counts: list[StepRewardCounts], config: RLBurstConfig, report: Any) -> None:
    """The RL gate: enough completions got a reward rather than an exception."""
    total = sum(c.completions for c in counts)
    scored = sum(c.resolved + c.unresolved for c in counts)
    if total == 0 or scored / total < config.min_scored_fraction:
        types: dict[str, int] = {}
        for c in counts:
            for k, v in c.exception_types.items():
                types[k] = types.get(k, 0) + v
        raise BurstHealthError(
            f"RL burst scored {scored} of {total} completions (min_scored_fraction "
            f"{config.min_scored_fraction}); exceptions by type {types}; per step "
            f"{[c.model_dump() for c in counts]}", report,
        )


def run_rl_burst(
    base_model_dir: Path,
    data: BurstData,
    out_dir: Path,
    config: RLBurstConfig,
    parent_adapter_dir: Path | None = None,
    run_id: str | None = None,
    verifier_backend: "str | SandboxTarget" = "podman",
    ray: RayPlacement | None = None,
    policy: Policy | None = None,
) -> RLBurstRecord:
    """Train a LoRA adapter with GRPO or RLOO, rewarded by the verifier in each task's container.

    As an SFT burst, plus the scored-fraction gate and ``reward_counts`` in ``lineage.json``. ``ray`` scores
    rollouts on a cluster's sandbox nodes; ``policy`` replaces the agentic mode's generator. The verifier's
    limits left None in ``config`` are ``RL_VERIFIER_LIMITS``' (:meth:`RLBurstConfig.resolved`).

    Raises:
        InputError: a folder is missing or the parent does not fit.
        PreflightError: a template is missing or empty, or disk space is short.
        BurstDivergedError / BurstHealthError: a gate failed, including too few completions scored.
    """
    from transformers import AutoTokenizer

    base_model_dir, out_dir, config = Path(base_model_dir), Path(out_dir).resolve(), config.resolved()
    base_sha, parent_sha = resolve_lineage_inputs(base_model_dir, parent_adapter_dir, config.lora_r)
    hyperparameters = config.model_dump(mode="json")
    expected = {"algorithm": config.algorithm, "base_model_sha256": base_sha, "parent_adapter_sha256": parent_sha,
                "dataset_sha256": data.sha256, "hyperparameters": hyperparameters}
    existing = _reusable_rl(out_dir, expected)
    if existing is not None:
        return existing
    remove_dead_staging_dirs(out_dir)  # a killed burst's leftovers: free their disk before measuring it
    if data.prompt_template is None:
        raise errors.InputError("an RL burst's data names its prompt template: build it with build_rl_dataset")
    burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [data.prompt_template])
    if sha256_file(data.prompt_template) != data.prompt_template_sha256:
        raise errors.InputError(f"prompt template {data.prompt_template} changed since the dataset was built")

    plan = device_plan(config.device)
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    model, tower = _policy(base_model_dir, parent_adapter_dir, plan, tokenizer, data)
    if config.algorithm == "grpo":
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOTrainer as Trainer
    run_id = run_id or uuid.uuid4().hex
    episodes_dir = out_dir.parent / "rl-episodes" / run_id
    reward, rollout = _reward_source(config, data, verifier_backend, ray, episodes_dir, policy)
    with StagingDir(out_dir) as tmp:
        args, lora = _trl_objects(config, tmp / "trainer", with_lora=parent_adapter_dir is None, plan=plan,
                                  vision=tower is not None)
        agentic = {"rollout_func": rollout} if rollout is not None else {}
        trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=data.dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[health_callback(config.gates)],
                          **agentic)
        before = trainable_digest(trainer.model)
        trainer.train()
        changed = trainable_digest(trainer.model) != before
        report = check_health(trainer.state.log_history, config.gates)
        enforce_health(report, hyperparameters)
        if tower is not None:
            vl_burst.check_tower_unchanged(trainer.model, tower, report)
        stats = list(rollout.stats) if rollout is not None else []
        counts = [s.reward_counts() for s in stats] if rollout is not None else [
            reward.counts[s] for s in sorted(reward.counts)]
        _check_scored(counts, config, report)
        lineage = Lineage(algorithm=config.algorithm, base_model_sha256=base_sha, parent_adapter_sha256=parent_sha,
                          dataset_sha256=data.sha256, hyperparameters=hyperparameters,
                          run_id=run_id, created_at=datetime.now(timezone.utc),
                          device=plan.device, dtype=plan.dtype,
                          gradient_checkpointing=bool(trainer.args.activation_checkpointing),
                          vision_tower_frozen=True if tower is not None else None,
                          vision_tower_sha256=tower.vision_tower_sha256 if tower is not None else None)
        extra = {"reward_counts": [c.model_dump(mode="json") for c in counts], "weights_changed": changed}
        if stats:
            extra["episode_stats"] = [s.model_dump(mode="json") for s in stats]
        adapter = publish_adapter(trainer, tmp, out_dir, lineage, report, extra=extra)
    return RLBurstRecord(adapter=adapter, reward_counts=counts, weights_changed=changed, episode_stats=stats)


def _reward_source(config: RLBurstConfig, data: BurstData, backend: "str | SandboxTarget",
                   ray: RayPlacement | None, episodes_dir: Path,
                   policy: Policy | None = None) -> tuple[Any, EpisodeRollout | None]:
    """The trainer's reward function and, in the agentic mode, its rollout function."""
    if config.episode is None:
        limits = config.verifier_limits()
        return VerifierReward(verifier_timeout_multiplier=config.verifier_timeout_multiplier,
                              memory_mb=limits.memory_mb, cpus=limits.cpus,
                              concurrency=config.verifier_concurrency, backend=backend, ray=ray), None
    rows = [{**row, "verifier_timeout_s": training_timeout_s(row["task_timeout_s"], config.verifier_timeout_multiplier,
                                                             row["pristine_duration_s"])} for row in data.dataset]
    return episode_reward, EpisodeRollout(rows, config.episode, episodes_dir, {"backend": backend, "ray": ray},
                                          policy=policy)
