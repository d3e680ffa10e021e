"""RL bursts: GRPO (or RLOO) with LoRA, rewarded by the task's verifier in its container.

One RL burst continues an adapter lineage exactly as an SFT burst does
(:func:`forgeflow.training.burst.resolve_lineage_inputs`, :func:`forgeflow.training.burst.publish_adapter`): the
adapter folder gets a ``lineage.json`` naming the algorithm, the base model digest, the parent
adapter digest, the dataset digest, the hyperparameters and the run id — written only after the
health gates passed.

Trainer: TRL 1.16 ``GRPOTrainer`` (group-relative advantages, Shao et al. 2024, DeepSeekMath) or
``RLOOTrainer`` (leave-one-out baseline, Ahmadian et al. 2024), chosen by
:attr:`RLBurstConfig.algorithm`, with a peft LoRA adapter, on CPU here and on a GPU unchanged.

Reward (:class:`forgeflow.training.rewards.VerifierReward`): each completion is parsed into a
patch (:func:`forgeflow.training.rewards.extract_patch`: the model's unified diff, what
mini-swe-agent submits as ``git diff``), and :func:`forgeflow.sandbox.scoring.verify_submission`
— the same verifier agent trials use — screens it (a completion that changes the task's tests,
conftest, test configuration or start-up hooks is tampering: reward 0, counted per step), applies
it in a fresh container of the pristine task image, runs the tests with the pinned environment and
reads the structured report, graded with the strict resolution rule: reward 1.0 (resolved) or 0.0
(not resolved, patch empty or not applying, a report that disagrees with the exit status: the
model's outcomes; so is a completion that is not text or holds no diff, and a run the submission
itself hung or exhausted, which the verifier attributes to it on evidence: reward 0, counted per kind).
An infrastructure failure (podman failure, missing image, OOM or timeout without the submission's
evidence, unparseable output, a lost Ray node) gives **None**, never 0: TRL 1.16 turns None into NaN
(``GRPOTrainer._calculate_rewards``: ``reward if reward is not None else torch.nan``), marks a
completion whose every reward is NaN as unscorable (``unscorable_mask``), leaves it out of the
group mean/std or leave-one-out baseline (``nanmean``/``nanstd``) and sets its advantage to 0
(``torch.nan_to_num(advantages, nan=0.0)``), so it does not move the policy. ``RLOOTrainer``
does the same. One completion never loses the batch (:class:`forgeflow.training.rewards.VerifierReward`).

The verifier timeout for training (:func:`forgeflow.training.rewards.training_timeout_s`) is the task's
original per-task timeout (:attr:`RLTask.task_timeout_s`, default SWE-smith's 3000 s) times
:attr:`RLBurstConfig.verifier_timeout_multiplier` (default 0.06: the seeds' 180 s), never below
:data:`forgeflow.training.rewards.PRISTINE_SAFETY_FACTOR` (5) times the task's recorded pristine
(Oracle) run (:attr:`RLTask.pristine_duration_s`), which the verifier also reads to attribute a
timeout to the submission. Curation's own timeout is a separate cap and plays no part. Rewards,
the submission's own failures by kind and exceptions by type are counted per optimizer step
(:class:`forgeflow.training.rewards.StepRewardCounts`, with the Ray nodes they ran on) and stored
in ``lineage.json`` and the returned :class:`RLBurstRecord`.

Agentic mode (:attr:`RLBurstConfig.episode`): each rollout is a multi-turn episode in a fresh sandbox of
the task image (:mod:`forgeflow.training.episodes_run`), fed to the same GRPO trainer through its
``rollout_func`` with the episodes' sampled ids and loss masks (:mod:`forgeflow.training.episodes_grpo`);
the reward is the verifier's on the episode's final change, and the lineage also keeps the per-step
``episode_stats``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_file, sha256_json
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
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
from forgeflow.training.burst import TRAINER_RUN_ARGS
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
from forgeflow.training.rewards import StepRewardCounts, VerifierReward, VerifierSpec, training_timeout_s
from forgeflow.training.staging import StagingDir, remove_dead_staging_dirs

DEFAULT_PROMPT_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "rl_prompt.md"
"""The user prompt of an RL rollout; ``{problem_statement}`` is replaced by the task's text."""

PROMPT_PLACEHOLDER = "{problem_statement}"



# --- tasks and data ----------------------------------------------------------------------------
class RLTask(VerifierSpec):
    """One task an RL burst samples fixes for: the verifier's spec plus the problem statement
    the model sees (never the patch).

    Stricter than :class:`~forgeflow.training.rewards.VerifierSpec`, because a reward is credited on it:
    ``fail_to_pass`` must name at least one test (without one, a completion that changes nothing passes
    every remaining test and is rewarded 1), and an unknown field is refused (a misspelt
    ``FAIL_TO_PASS`` would otherwise leave ``fail_to_pass`` empty, unseen).

    Its timeouts (seconds): ``task_timeout_s``, the task's original per-task timeout (default SWE-smith's
    3000 s; a row may still name it ``verifier_timeout_s``, its former name), and ``pristine_duration_s``,
    the longest recorded pristine (Oracle) run of its tests (the Oracle trials' ``verifier_s``), if
    known. Training runs the tests for ``task_timeout_s`` x the burst's multiplier, never below 5 x the
    pristine run (:func:`forgeflow.training.rewards.training_timeout_s`).
    ``known_tests``: every test id the task's pristine runs collected, if recorded (a run that reports
    another is tampering). :func:`forgeflow.training.freeze_tasks.rl_tasks_from_freeze` fills both from
    the store for the tasks of a freeze.

    Raises:
        pydantic.ValidationError: a missing or empty ``fail_to_pass``, an unknown field, or any
            field of the verifier's spec out of bounds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem_statement: str = Field(min_length=1)
    fail_to_pass: tuple[str, ...]

    @field_validator("fail_to_pass")
    @classmethod
    def _a_failing_test(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("no test: an RL task needs at least one FAIL_TO_PASS test (without one, a completion "
                             "that changes nothing is rewarded)")
        return value


class RLData(BaseModel):
    """An RL prompt dataset and the digest that identifies it.

    Attributes:
        dataset: a ``datasets.Dataset`` with ``prompt`` (one user message, conversational) and the
            task columns TRL hands to the reward function: ``instance_id``, ``image_ref``,
            ``test_command``, ``fail_to_pass``, ``pass_to_pass``, ``task_timeout_s`` (seconds),
            ``pristine_duration_s`` (seconds, None where not recorded), and ``known_tests`` (the task's
            known test ids, None where not recorded) when any task has them (without, the rows and their
            digest are what they were before the column existed).
        sha256: sha256 of the canonical JSON of the rows, in order (covers the rendered prompts,
            hence the template).
        prompt_template: the template file the prompts were rendered from.
        prompt_template_sha256: its file digest.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    dataset: Any
    sha256: str = Field(min_length=64, max_length=64)
    prompt_template: Path
    prompt_template_sha256: str = Field(min_length=64, max_length=64)


def build_rl_dataset(tasks: Sequence[RLTask | dict], prompt_template: Path = DEFAULT_PROMPT_TEMPLATE) -> RLData:
    """Render each task's prompt from ``prompt_template`` into a ``datasets.Dataset``.

    Args:
        tasks: :class:`RLTask` objects or dicts of their fields.
        prompt_template: a non-empty text file containing ``{problem_statement}`` (replaced
            verbatim; other braces are left alone).

    Raises:
        InputError: ``tasks`` is empty, a task is malformed (the message names its index and
            field), ``instance_id`` repeats, or the template lacks the placeholder.
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
            "fail_to_pass": list(task.fail_to_pass),
            "pass_to_pass": list(task.pass_to_pass),
            "task_timeout_s": float(task.task_timeout_s),
            "pristine_duration_s": None if task.pristine_duration_s is None else float(task.pristine_duration_s),
        })
    if any(task.known_tests for task in valid):  # the column only where recorded: older datasets keep their digest
        for task, row in zip(valid, rows):
            row["known_tests"] = list(task.known_tests) if task.known_tests else None
    return RLData(dataset=Dataset.from_list(rows), sha256=sha256_json(rows), prompt_template=Path(prompt_template),
                  prompt_template_sha256=sha256_file(prompt_template))


# --- the burst ---------------------------------------------------------------------------------
def _rl_gates() -> HealthGates:
    """RL default gates: the loss trend is off — the GRPO/RLOO loss is a policy surrogate whose
    level says nothing about progress (it is 0 whenever the advantages are)."""
    return HealthGates(loss_trend_window=0)


class RLBurstConfig(LoraSettings):
    """Hyperparameters of one RL burst (flat, TRL-style names; translated in :func:`_trl_objects`).

    Attributes:
        algorithm: ``grpo`` (``trl.GRPOTrainer``) or ``rloo`` (``trl.RLOOTrainer``).
        lora_*: the LoRA adapter (peft ``LoraConfig``), as in :class:`forgeflow.training.burst.BurstConfig`.
        learning_rate: optimizer learning rate (constant schedule, no warm-up).
        max_steps: optimizer steps.
        prompts_per_step: distinct prompts per step; the per-device batch is
            ``prompts_per_step * num_generations`` completions.
        num_generations: completions sampled per prompt (the group), >= 2.
        max_completion_length: tokens per completion.
        temperature: sampling temperature of the rollouts.
        beta: KL coefficient against the base policy (0: no reference model).
        seed: training and sampling seed.
        verifier_timeout_multiplier: training verifier timeout = the task's original per-task timeout
            (:attr:`RLTask.task_timeout_s`) x this, never below 5 x its pristine run
            (:func:`forgeflow.training.rewards.training_timeout_s`); the seeds' 0.06.
        verifier_memory_mb / verifier_cpus: limits of each verifier container.
        verifier_concurrency: verifier containers at once.
        verifier_backend: the sandbox backend kind of the verifier containers
            (:data:`forgeflow.sandbox.backends.BACKENDS`), or a
            :class:`~forgeflow.sandbox.backends.SandboxTarget` (a ``forgeflow-sandbox`` block's).
        min_scored_fraction: least fraction of completions that must get a reward (not an
            exception); below it the burst fails (it learned from too little).
        gates: health gates; by default the loss trend gate is off (see :func:`_rl_gates`).
        episode: the agentic mode (:class:`forgeflow.training.episodes.EpisodeSettings`: turns, tokens, wall
            clock, tools, concurrency, the step's wall bound): each rollout a multi-turn episode in a fresh
            sandbox of the task image, rewarded by the verifier on its final change
            (:mod:`forgeflow.training.episodes_grpo`; ``grpo`` only: TRL's RLOOTrainer takes no rollout
            function). None: single-turn rollouts (a completion holding a diff). Not dumped while None.
    """

    model_config = ConfigDict(frozen=True)

    algorithm: Literal["grpo", "rloo"] = "grpo"
    learning_rate: float = Field(default=1e-4, gt=0.0)
    max_steps: int = Field(default=2, ge=1)
    prompts_per_step: int = Field(default=1, ge=1)
    num_generations: int = Field(default=2, ge=2)
    max_completion_length: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, gt=0.0, le=2.0)
    beta: float = Field(default=0.0, ge=0.0)
    seed: int = 0
    verifier_timeout_multiplier: float = Field(default=0.06, gt=0.0, le=10.0)
    verifier_memory_mb: int = Field(default=1024, ge=64)
    verifier_cpus: float = Field(default=1.0, gt=0)
    verifier_concurrency: int = Field(default=1, ge=1, le=32)
    verifier_backend: str | SandboxTarget = "podman"
    min_scored_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    gates: HealthGates = Field(default_factory=_rl_gates)
    device: DeviceChoice = "auto"
    episode: EpisodeSettings | None = Field(default=None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _agentic_needs_grpo(self) -> "RLBurstConfig":
        if self.episode is not None and self.algorithm != "grpo":
            raise ValueError("episode (the agentic mode) needs algorithm 'grpo': TRL's RLOOTrainer takes no "
                             "rollout function")
        return self


class RLBurstRecord(BaseModel):
    """An RL burst's adapter and its reward counts.

    Attributes:
        adapter: the :class:`~forgeflow.training.burst.AdapterRecord` (lineage algorithm ``grpo``/``rloo``).
        reward_counts: one :class:`StepRewardCounts` per optimizer step, in step order.
        episode_stats: per step, the agentic mode's :class:`forgeflow.training.episodes_grpo.EpisodeStepStats`
            (rewards, exceptions, refused prefixes, supervision stops, end reasons, turns); empty otherwise.
        weights_changed: False when training left the trainable weights exactly as they started (the
            parent adapter's, or a new adapter's initialisation): every group of generations got equal
            rewards, so every GRPO/RLOO advantage was 0 and no gradient flowed (TRL's default ``beta`` 0
            adds no KL term). Such an adapter learned nothing: for a parent it is the parent, for a new
            adapter it is peft's initialisation (the same for any dataset of that seed), not a lineage
            step. Measured by :func:`trainable_digest` before and after training, kept in
            ``lineage.json``.
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
                 plan: DevicePlan | None = None) -> tuple[Any, Any]:
    """Translate :class:`RLBurstConfig` into ``(trl.GRPOConfig | trl.RLOOConfig, peft.LoraConfig | None)``."""
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
    return args, (lora_config(config) if with_lora else None)


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
    """sha256 (64 hex) of a model's trainable parameters (``requires_grad``): each name and its values as
    float32, in ``named_parameters`` order. Two digests of one model are equal exactly when no trainable
    weight moved between them (bfloat16 and float16 values are exact in float32)."""
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
    data: RLData,
    out_dir: Path,
    config: RLBurstConfig,
    parent_adapter_dir: Path | None = None,
    run_id: str | None = None,
    verifier_backend: "str | SandboxTarget | None" = None,
    ray: RayPlacement | None = None,
    policy: Policy | None = None,
) -> RLBurstRecord:
    """Train a LoRA adapter with GRPO or RLOO, rewarded by the verifier in each task's container.

    Continues ``parent_adapter_dir`` (``PeftModel.from_pretrained(..., is_trainable=True)``;
    same base model and LoRA rank) or starts a new adapter. Order: lineage inputs, reuse of a
    finished identical burst, removal of dead bursts' staging folders
    (:func:`forgeflow.training.burst.remove_dead_staging_dirs`), preflight
    (:func:`forgeflow.training.burst.burst_preflight`: chat template and prompt template non-empty, disk
    space for the adapter), then training with the health callback, then the health gates and the
    scored-fraction gate, and only then the adapter folder with ``lineage.json`` (which also
    holds ``reward_counts``).

    Args:
        base_model_dir: HF model folder with tokenizer and chat template.
        data: from :func:`build_rl_dataset`.
        out_dir: the adapter folder to create.
        config: hyperparameters.
        parent_adapter_dir: an adapter folder written by an earlier (SFT or RL) burst, or None.
        run_id: recorded in the lineage; a uuid4 hex when None.
        verifier_backend: where this run's verifier containers run, when it differs from
            ``config.verifier_backend`` only by what the lineage must not record (e.g. the flow
            run's label on the pods); None: ``config.verifier_backend``.
        ray: score the rollouts as Ray tasks on this cluster's sandbox nodes
            (:class:`forgeflow.sandbox.dispatch.RayPlacement`); where they ran is counted per step
            (``StepRewardCounts.nodes``), not in the lineage's inputs. None: in this process.
        policy: the agentic mode's policy (a :class:`forgeflow.training.episodes.ScriptedPolicy` checks the
            mechanics); None: the trainer's own generator. Ignored without ``config.episode``.

    Agentic mode (``config.episode``): ``data`` built with
    :data:`forgeflow.training.episodes.EPISODE_PROMPT_TEMPLATE`; each rollout an episode
    (:mod:`forgeflow.training.episodes_grpo`) whose trajectories go to ``<out_dir's parent>/rl-episodes/<run_id>/``;
    the lineage also keeps ``episode_stats`` per step.

    Returns:
        The :class:`RLBurstRecord`.

    Raises:
        InputError: a folder is missing or the parent does not fit.
        PreflightError: a template is missing or empty, or disk space is short.
        BurstDivergedError / BurstHealthError: a gate failed (no adapter is written), including
            fewer than ``min_scored_fraction`` of the completions scored.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model_dir, out_dir = Path(base_model_dir), Path(out_dir).resolve()
    base_sha, parent_sha = resolve_lineage_inputs(base_model_dir, parent_adapter_dir, config.lora_r)
    hyperparameters = config.model_dump(mode="json")
    expected = {"algorithm": config.algorithm, "base_model_sha256": base_sha, "parent_adapter_sha256": parent_sha,
                "dataset_sha256": data.sha256, "hyperparameters": hyperparameters}
    existing = _reusable_rl(out_dir, expected)
    if existing is not None:
        return existing
    remove_dead_staging_dirs(out_dir)  # a killed burst's leftovers: free their disk before measuring it
    burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [data.prompt_template])
    if sha256_file(data.prompt_template) != data.prompt_template_sha256:
        raise errors.InputError(f"prompt template {data.prompt_template} changed since the dataset was built")

    plan = device_plan(config.device)
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=plan.torch_dtype())
    if parent_adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
    if config.algorithm == "grpo":
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOTrainer as Trainer
    run_id = run_id or uuid.uuid4().hex
    backend = verifier_backend if verifier_backend is not None else config.verifier_backend
    reward, rollout = _reward_source(config, data, backend, ray, out_dir.parent / "rl-episodes" / run_id, policy)
    with StagingDir(out_dir) as tmp:
        args, lora = _trl_objects(config, tmp / "trainer", with_lora=parent_adapter_dir is None, plan=plan)
        agentic = {"rollout_func": rollout} if rollout is not None else {}
        trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=data.dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[health_callback(config.gates)],
                          **agentic)
        before = trainable_digest(trainer.model)
        trainer.train()
        changed = trainable_digest(trainer.model) != before
        report = check_health(trainer.state.log_history, config.gates)
        enforce_health(report, hyperparameters)
        stats = list(rollout.stats) if rollout is not None else []
        counts = [s.reward_counts() for s in stats] if rollout is not None else [
            reward.counts[s] for s in sorted(reward.counts)]
        _check_scored(counts, config, report)
        lineage = Lineage(algorithm=config.algorithm, base_model_sha256=base_sha, parent_adapter_sha256=parent_sha,
                          dataset_sha256=data.sha256, hyperparameters=hyperparameters,
                          run_id=run_id, created_at=datetime.now(timezone.utc),
                          device=plan.device, dtype=plan.dtype,
                          gradient_checkpointing=bool(trainer.args.activation_checkpointing))
        extra = {"reward_counts": [c.model_dump(mode="json") for c in counts], "weights_changed": changed}
        if stats:
            extra["episode_stats"] = [s.model_dump(mode="json") for s in stats]
        adapter = publish_adapter(trainer, tmp, out_dir, lineage, report, extra=extra)
    return RLBurstRecord(adapter=adapter, reward_counts=counts, weights_changed=changed, episode_stats=stats)


def _reward_source(config: RLBurstConfig, data: RLData, backend: "str | SandboxTarget", ray: RayPlacement | None,
                   episodes_dir: Path, policy: Policy | None = None) -> tuple[Any, EpisodeRollout | None]:
    """The trainer's reward function and, in the agentic mode, its rollout function: single-turn, the
    verifier's reward on each completion's diff (:class:`VerifierReward`); agentic, each episode's own reward
    (:func:`forgeflow.training.episodes_grpo.episode_reward`) from :class:`EpisodeRollout` (episodes in
    ``episodes_dir``, their verifier timeouts by :func:`forgeflow.training.rewards.training_timeout_s`)."""
    if config.episode is None:
        return VerifierReward(verifier_timeout_multiplier=config.verifier_timeout_multiplier,
                              memory_mb=config.verifier_memory_mb, cpus=config.verifier_cpus,
                              concurrency=config.verifier_concurrency, backend=backend, ray=ray), None
    rows = [{**row, "verifier_timeout_s": training_timeout_s(row["task_timeout_s"], config.verifier_timeout_multiplier,
                                                             row["pristine_duration_s"])} for row in data.dataset]
    return episode_reward, EpisodeRollout(rows, config.episode, episodes_dir, {"backend": backend, "ray": ray},
                                          policy=policy)
