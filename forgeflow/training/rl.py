"""RL bursts: GRPO (or RLOO) with LoRA, rewarded by the task's verifier in its container.

One RL burst continues an adapter lineage exactly as an SFT burst does
(:func:`forgeflow.training.burst.resolve_lineage_inputs`, :func:`forgeflow.training.burst.publish_adapter`): the
adapter folder gets a ``lineage.json`` naming the algorithm, the base model digest, the parent
adapter digest, the dataset digest, the hyperparameters and the run id — written only after the
health gates passed.

Trainer: TRL 1.16 ``GRPOTrainer`` (group-relative advantages, Shao et al. 2024, DeepSeekMath) or
``RLOOTrainer`` (leave-one-out baseline, Ahmadian et al. 2024), chosen by
:attr:`RLBurstConfig.algorithm`, with a peft LoRA adapter, on CPU here and on a GPU unchanged.

Reward (:class:`VerifierReward`): each completion is parsed into a patch
(:func:`extract_patch`: the model's unified diff, what mini-swe-agent submits as ``git diff``),
and :func:`forgeflow.sandbox.verifier.verify_submission` — the same verifier agent trials use — screens it
(a completion that changes the task's tests, conftest, test configuration or start-up hooks is
tampering: reward 0, counted per step), applies it in a fresh container of the pristine task image,
runs the tests with the pinned environment and reads the structured report, graded with the strict
resolution rule: reward 1.0 (resolved) or 0.0 (not resolved, patch empty or not applying, a report
that disagrees with the exit status: the model's outcomes). An infrastructure failure (podman failure, missing image,
OOM, verifier
timeout, unparseable output) gives **None**, never 0: TRL 1.16 turns None into NaN
(``GRPOTrainer._calculate_rewards``: ``reward if reward is not None else torch.nan``), marks a
completion whose every reward is NaN as unscorable (``unscorable_mask``), leaves it out of the
group mean/std or leave-one-out baseline (``nanmean``/``nanstd``) and sets its advantage to 0
(``torch.nan_to_num(advantages, nan=0.0)``), so it does not move the policy. ``RLOOTrainer``
does the same.

The verifier timeout for training is the task's own (curation) verifier timeout times
:attr:`RLBurstConfig.verifier_timeout_multiplier` (default 0.06): a training rollout whose
tests are slow is cut short and counted as an exception, without changing the timeout
curation used to accept the task. Rewards and exceptions are counted per optimizer step
(:class:`StepRewardCounts`) and stored in ``lineage.json`` and the returned
:class:`RLBurstRecord`.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_file, sha256_json
from forgeflow.common.names import sanitize_name
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.submission import TamperPolicy
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
from forgeflow.training.health import (
    BurstHealthError,
    HealthGates,
    check_health,
    enforce_health,
    health_callback,
)
from forgeflow.training.preflight import burst_preflight, preflight
from forgeflow.training.staging import StagingDir, remove_dead_staging_dirs

DEFAULT_PROMPT_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "rl_prompt.md"
"""The user prompt of an RL rollout; ``{problem_statement}`` is replaced by the task's text."""

PROMPT_PLACEHOLDER = "{problem_statement}"

_FENCED_DIFF = re.compile(r"```(?:diff|patch)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DIFF_START = re.compile(r"^(diff --git |--- a/|--- /dev/null)", re.MULTILINE)


# --- tasks and data ----------------------------------------------------------------------------
class VerifierSpec(BaseModel):
    """What the verifier needs of a task.

    Attributes:
        instance_id: the task's id.
        image_ref: the task image (bug applied at ``/testbed``, a git repository).
        test_command: the verifier's command (``pytest -rA`` output), run in ``/testbed``.
        fail_to_pass / pass_to_pass: the task's test ids (SWE-bench grading); not both empty.
        verifier_timeout_s: the task's own verifier timeout in seconds (the one curation used);
            training uses it times :attr:`RLBurstConfig.verifier_timeout_multiplier`.
    """

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(min_length=1)
    image_ref: str = Field(min_length=1)
    test_command: str = Field(min_length=1)
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    verifier_timeout_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _something_to_grade(self) -> "VerifierSpec":
        if not self.fail_to_pass and not self.pass_to_pass:
            raise ValueError("fail_to_pass and pass_to_pass are both empty: nothing to grade")
        return self


class RLTask(VerifierSpec):
    """One task an RL burst samples fixes for: the verifier's spec plus the problem statement
    the model sees (never the patch)."""

    problem_statement: str = Field(min_length=1)


class RLData(BaseModel):
    """An RL prompt dataset and the digest that identifies it.

    Attributes:
        dataset: a ``datasets.Dataset`` with ``prompt`` (one user message, conversational) and the
            task columns TRL hands to the reward function: ``instance_id``, ``image_ref``,
            ``test_command``, ``fail_to_pass``, ``pass_to_pass``, ``verifier_timeout_s``.
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
    rows, seen = [], set()
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
        rows.append({
            "prompt": [{"role": "user", "content": template.replace(PROMPT_PLACEHOLDER, task.problem_statement)}],
            "instance_id": task.instance_id,
            "image_ref": task.image_ref,
            "test_command": task.test_command,
            "fail_to_pass": list(task.fail_to_pass),
            "pass_to_pass": list(task.pass_to_pass),
            "verifier_timeout_s": float(task.verifier_timeout_s),
        })
    return RLData(dataset=Dataset.from_list(rows), sha256=sha256_json(rows), prompt_template=Path(prompt_template),
                  prompt_template_sha256=sha256_file(prompt_template))


# --- reward ------------------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or a conversational list of messages (the
    assistant contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "\n".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    raise errors.InputError(f"completion must be a string or a list of messages, got {type(completion).__name__}")


def extract_patch(text: str) -> str:
    """The unified diff in a model's answer, or ``""`` when there is none.

    The last fenced block tagged ``diff`` or ``patch`` wins (a model may show the broken code
    first); without one, the text from the first ``diff --git`` / ``--- a/`` line on. The patch
    ends with a newline, as ``git apply`` wants. No attempt is made to repair a malformed diff:
    one that does not apply is the model's outcome (reward 0).
    """
    blocks = _FENCED_DIFF.findall(text)
    if blocks:
        patch = blocks[-1]
    else:
        match = _DIFF_START.search(text)
        patch = text[match.start():] if match else ""
        patch = patch.split("\n```", 1)[0]
    patch = patch.strip("\n")
    return patch + "\n" if patch.strip() else ""


class RewardOutcome(BaseModel):
    """The verifier's verdict on one completion.

    Attributes:
        reward: 1.0 resolved, 0.0 not resolved (or no patch, or a patch that does not apply);
            None iff ``exception_type`` is set.
        exception_type: class name of the infrastructure error (``ImageNotFoundError``,
            ``VerifierTimeoutError``, ...), else None.
        exception_message: its message.
        note: the verifier's notes (``empty submission``, ``did not apply``, ``tampering: ...``), if any.
        verifier_timeout_s: the timeout the test run had (task timeout x multiplier), seconds.
        tampering: True when the completion changed the task's own files (reward 0).
    """

    model_config = ConfigDict(frozen=True)

    reward: float | None = Field(default=None, ge=0.0, le=1.0)
    exception_type: str | None = None
    exception_message: str | None = None
    note: str = ""
    verifier_timeout_s: float = Field(gt=0)
    tampering: bool = False


def score_completion(
    completion: Any, task: VerifierSpec, *, verifier_timeout_multiplier: float = 0.06,
    memory_mb: int = 1024, cpus: float = 1.0, name: str | None = None, tamper_policy: TamperPolicy = "reject",
    backend: "str | SandboxTarget" = "podman",
) -> RewardOutcome:
    """Apply a completion's patch in a fresh container of the task image and grade the tests.

    Runs :func:`forgeflow.sandbox.verifier.verify_submission` (the agent trials' verifier: screening by
    ``tamper_policy``, ``git apply`` in a fresh container of the pristine image, the pinned test
    run, the strict resolution rule) with a timeout of
    ``task.verifier_timeout_s * verifier_timeout_multiplier`` seconds.

    Args:
        completion: a TRL completion (string or list of messages).
        task: the task (an :class:`RLTask` or its :class:`VerifierSpec`).
        verifier_timeout_multiplier: training timeout / the task's timeout (> 0).
        memory_mb: memory limit of the verifier container, MiB.
        cpus: CPU quota of the verifier container.
        name: container name (default: derived from the instance id and a random nonce).
        tamper_policy: ``reject`` or ``drop`` (:mod:`forgeflow.sandbox.submission`).
        backend: the sandbox backend kind the verifier runs in (``podman``, ``kubernetes``).

    Returns:
        The outcome; an :class:`~forgeflow.common.errors.InfraError` becomes ``reward=None`` with its
        class name, never 0.

    Raises:
        InputError: ``verifier_timeout_multiplier`` <= 0 or a malformed completion.
    """
    from forgeflow.sandbox.verifier import verify_submission

    if verifier_timeout_multiplier <= 0:
        raise errors.InputError(f"verifier_timeout_multiplier must be > 0, got {verifier_timeout_multiplier}")
    timeout_s = task.verifier_timeout_s * verifier_timeout_multiplier
    patch = extract_patch(completion_text(completion))
    name = name or sanitize_name(f"ff-rl-{task.instance_id}-{uuid.uuid4().hex[:12]}")
    try:
        verdict = verify_submission(
            task.image_ref, patch, task.test_command, list(task.fail_to_pass), list(task.pass_to_pass),
            timeout_s=timeout_s, spec=SandboxSpec(memory_mb=memory_mb, cpus=cpus), name=name,
            tamper_policy=tamper_policy, backend=backend,
        )
    except errors.InfraError as exc:
        return RewardOutcome(exception_type=type(exc).__name__, exception_message=str(exc) or repr(exc),
                             verifier_timeout_s=timeout_s)
    return RewardOutcome(reward=verdict.reward, note="; ".join(verdict.notes), verifier_timeout_s=timeout_s,
                         tampering=bool(verdict.evidence.get("submission", {}).get("tampering")))


class StepRewardCounts(BaseModel):
    """Rewards of the completions scored for one optimizer step.

    Attributes:
        step: the optimizer step the completions trained (1-based).
        completions: completions scored.
        resolved: reward 1.0.
        unresolved: reward 0.0 (tests fail, no patch, or a patch that does not apply).
        exceptions: infrastructure errors (no reward).
        exception_types: exception class name -> count.
        tampering: completions that changed the task's own files (among ``unresolved``).
    """

    model_config = ConfigDict(frozen=True)

    step: int = Field(ge=1)
    completions: int = Field(default=0, ge=0)
    resolved: int = Field(default=0, ge=0)
    unresolved: int = Field(default=0, ge=0)
    exceptions: int = Field(default=0, ge=0)
    tampering: int = Field(default=0, ge=0)
    exception_types: dict[str, int] = Field(default_factory=dict)


class VerifierReward:
    """A TRL reward function (``GRPOTrainer``/``RLOOTrainer`` ``reward_funcs``) backed by the verifier.

    Called with the batch's ``completions`` and the dataset columns of :class:`RLData` (TRL passes
    every extra column as a keyword list, plus ``trainer_state``); returns one reward per
    completion: 1.0, 0.0 or None (see :func:`score_completion`). Up to ``concurrency`` verifier
    containers run at once. ``counts`` holds a :class:`StepRewardCounts` per optimizer step and
    ``outcomes`` every :class:`RewardOutcome` with its step and instance id.
    """

    __name__ = "verifier"

    def __init__(self, *, verifier_timeout_multiplier: float = 0.06, memory_mb: int = 1024,
                 cpus: float = 1.0, concurrency: int = 1, tamper_policy: TamperPolicy = "reject",
                 backend: "str | SandboxTarget" = "podman") -> None:
        if verifier_timeout_multiplier <= 0:
            raise errors.InputError(f"verifier_timeout_multiplier must be > 0, got {verifier_timeout_multiplier}")
        if concurrency < 1:
            raise errors.InputError(f"concurrency must be >= 1, got {concurrency}")
        self.verifier_timeout_multiplier = verifier_timeout_multiplier
        self.memory_mb, self.cpus, self.concurrency = memory_mb, cpus, concurrency
        self.tamper_policy, self.backend = tamper_policy, backend
        self.nonce = uuid.uuid4().hex[:8]
        self.counts: dict[int, StepRewardCounts] = {}
        self.outcomes: list[tuple[int, str, RewardOutcome]] = []
        self._lock = threading.Lock()

    def __call__(self, prompts: list, completions: list, *, instance_id: list[str], image_ref: list[str],
                 test_command: list[str], fail_to_pass: list[list[str]], pass_to_pass: list[list[str]],
                 verifier_timeout_s: list[float], trainer_state: Any = None, **_: Any) -> list[float | None]:
        step = int(getattr(trainer_state, "global_step", 0)) + 1

        def one(i: int) -> RewardOutcome:
            task = VerifierSpec(instance_id=instance_id[i], image_ref=image_ref[i],
                                test_command=test_command[i], fail_to_pass=tuple(fail_to_pass[i]),
                                pass_to_pass=tuple(pass_to_pass[i]), verifier_timeout_s=verifier_timeout_s[i])
            name = sanitize_name(f"ff-rl-{instance_id[i]}-{self.nonce}-s{step}-{i}")
            return score_completion(completions[i], task, verifier_timeout_multiplier=self.verifier_timeout_multiplier,
                                    memory_mb=self.memory_mb, cpus=self.cpus, name=name,
                                    tamper_policy=self.tamper_policy, backend=self.backend)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            outcomes = list(pool.map(one, range(len(completions))))
        self._count(step, [instance_id[i] for i in range(len(outcomes))], outcomes)
        return [o.reward for o in outcomes]

    def _count(self, step: int, ids: list[str], outcomes: list[RewardOutcome]) -> None:
        with self._lock:
            old = self.counts.get(step) or StepRewardCounts(step=step)
            types = dict(old.exception_types)
            for o in outcomes:
                if o.exception_type:
                    types[o.exception_type] = types.get(o.exception_type, 0) + 1
            self.counts[step] = StepRewardCounts(
                step=step, completions=old.completions + len(outcomes),
                resolved=old.resolved + sum(o.reward == 1.0 for o in outcomes),
                unresolved=old.unresolved + sum(o.reward == 0.0 for o in outcomes),
                exceptions=old.exceptions + sum(o.reward is None for o in outcomes),
                tampering=old.tampering + sum(o.tampering for o in outcomes),
                exception_types=dict(sorted(types.items())),
            )
            self.outcomes.extend((step, iid, o) for iid, o in zip(ids, outcomes))


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
        verifier_timeout_multiplier: training verifier timeout = the task's verifier timeout x this
            (kept apart from the curation timeout).
        verifier_memory_mb / verifier_cpus: limits of each verifier container.
        verifier_concurrency: verifier containers at once.
        verifier_backend: the sandbox backend kind of the verifier containers
            (:data:`forgeflow.sandbox.backends.BACKENDS`), or a
            :class:`~forgeflow.sandbox.backends.SandboxTarget` (a ``forgeflow-sandbox`` block's).
        min_scored_fraction: least fraction of completions that must get a reward (not an
            exception); below it the burst fails (it learned from too little).
        gates: health gates; by default the loss trend gate is off (see :func:`_rl_gates`).
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


class RLBurstRecord(BaseModel):
    """An RL burst's adapter and its reward counts.

    Attributes:
        adapter: the :class:`~forgeflow.training.burst.AdapterRecord` (lineage algorithm ``grpo``/``rloo``).
        reward_counts: one :class:`StepRewardCounts` per optimizer step, in step order.
    """

    model_config = ConfigDict(frozen=True)

    adapter: AdapterRecord
    reward_counts: list[StepRewardCounts]

    @property
    def weights_changed(self) -> bool:
        """False when the burst left its parent adapter's weights as they were (same
        :func:`~forgeflow.training.adapters.adapter_sha256`): every group of generations got equal rewards, so
        every GRPO/RLOO advantage was 0 and no gradient flowed (TRL's default ``beta`` 0 adds no KL
        term). Such an adapter is its parent, not a new lineage step. True for a burst that
        started a new adapter."""
        return self.adapter.lineage.parent_adapter_sha256 != self.adapter.sha256

    def totals(self) -> StepRewardCounts:
        """The counts summed over steps (``step`` is the last step)."""
        types: dict[str, int] = {}
        for c in self.reward_counts:
            for k, v in c.exception_types.items():
                types[k] = types.get(k, 0) + v
        return StepRewardCounts(
            step=max((c.step for c in self.reward_counts), default=1),
            completions=sum(c.completions for c in self.reward_counts),
            resolved=sum(c.resolved for c in self.reward_counts),
            unresolved=sum(c.unresolved for c in self.reward_counts),
            exceptions=sum(c.exceptions for c in self.reward_counts),
            exception_types=dict(sorted(types.items())),
        )


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
        counts = json.loads((out_dir / LINEAGE_FILE).read_text(encoding="utf-8")).get("reward_counts")
    except (errors.InputError, KeyError, ValueError):
        return None
    lineage = record.lineage
    found = {"algorithm": lineage.algorithm, "base_model_sha256": lineage.base_model_sha256,
             "parent_adapter_sha256": lineage.parent_adapter_sha256, "dataset_sha256": lineage.dataset_sha256,
             "hyperparameters": lineage.hyperparameters}
    if found != expected or not record.promotable or counts is None:
        return None
    return RLBurstRecord(adapter=record, reward_counts=[StepRewardCounts.model_validate(c) for c in counts])


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
    reward = VerifierReward(verifier_timeout_multiplier=config.verifier_timeout_multiplier,
                            memory_mb=config.verifier_memory_mb, cpus=config.verifier_cpus,
                            concurrency=config.verifier_concurrency,
                            backend=verifier_backend if verifier_backend is not None else config.verifier_backend)
    with StagingDir(out_dir) as tmp:
        args, lora = _trl_objects(config, tmp / "trainer", with_lora=parent_adapter_dir is None, plan=plan)
        trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=data.dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[health_callback(config.gates)])
        trainer.train()
        report = check_health(trainer.state.log_history, config.gates)
        enforce_health(report, hyperparameters)
        counts = [reward.counts[s] for s in sorted(reward.counts)]
        _check_scored(counts, config, report)
        lineage = Lineage(algorithm=config.algorithm, base_model_sha256=base_sha, parent_adapter_sha256=parent_sha,
                          dataset_sha256=data.sha256, hyperparameters=hyperparameters,
                          run_id=run_id or uuid.uuid4().hex, created_at=datetime.now(timezone.utc),
                          device=plan.device, dtype=plan.dtype)
        adapter = publish_adapter(trainer, tmp, out_dir, lineage, report,
                                  extra={"reward_counts": [c.model_dump(mode="json") for c in counts]})
    return RLBurstRecord(adapter=adapter, reward_counts=counts)
