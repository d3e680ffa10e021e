"""The verifier's reward for RL rollouts: :func:`score_completion` per completion (None on an
infrastructure failure, never 0) and the TRL reward function :class:`VerifierReward`.
"""

from __future__ import annotations

import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from forgeflow.common import errors
from forgeflow.common.names import sanitize_name
from forgeflow.sandbox.backends import SandboxTarget, backend_kind
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement, verify_on
from forgeflow.sandbox.limits import SandboxLimits
from forgeflow.sandbox.submission import TamperPolicy
from forgeflow.sandbox.verifier import TaskTests

RL_VERIFIER_LIMITS = SandboxLimits(memory_mb=1024)
"""A training verifier container's limits where neither the ``rl-burst`` stage nor its sandbox block sets
them: 1024 MiB (one test run of one task, beside many at once), 1 CPU."""

TASK_TIMEOUT_S = 3000.0
"""A task's original per-task timeout when its row gives none, seconds: SWE-smith's tasks carry 3000 s
(their Harbor export's ``[verifier] timeout_sec = 3000``, https://harborframework.com/docs); the seeds'
training timeout was it x 0.06 = 180 s (issue 33). Not curation's cap, which is a separate limit."""

PRISTINE_SAFETY_FACTOR = 5.0
"""The training timeout is never below this many times the task's pristine (Oracle) run.

Why 5: the pristine duration is one run measured at curation, the training run is the same suite
with a submission applied, on a machine that may be busier. On the 2-core machines of FACTS.md the
demo's tabulate suite takes 2.6 s alone and its correct fixes took 8.3-9.8 s under the shared load of
a training step (issue 33): a 3-4x slowdown. 5x covers that, and a run cut at 5x its pristine time
is one the verifier attributes to the submission without a pristine re-run (:mod:`forgeflow.sandbox.scoring`
reads ``TaskTests.pristine_duration_s``: a pristine run within half the timeout fits well inside it)."""

_FENCED_DIFF = re.compile(r"```(?:diff|patch)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DIFF_START = re.compile(r"^(diff --git |--- a/|--- /dev/null)", re.MULTILINE)


class VerifierSpec(TaskTests):
    """What the RL verifier needs of a task: its :class:`~forgeflow.sandbox.verifier.TaskTests` (FAIL_TO_PASS and
    PASS_TO_PASS not both empty, else ``pydantic.ValidationError``) and its original timeout (default SWE-smith's
    3000 s; also read as ``verifier_timeout_s``); the pristine duration floors the training timeout."""

    task_timeout_s: float = Field(default=TASK_TIMEOUT_S, gt=0, le=7 * 24 * 3600,
                                  validation_alias=AliasChoices("task_timeout_s", "verifier_timeout_s"),
                                  description="The task's original per-task timeout, seconds.")
    pristine_duration_s: float | None = Field(default=None, ge=0, le=7 * 24 * 3600, exclude_if=lambda v: v is None,
                                              description="The longest recorded pristine (Oracle) run of the "
                                                          "tests, seconds; None: not recorded.")

    @model_validator(mode="after")
    def _something_to_grade(self) -> "VerifierSpec":
        if not self.graded_tests():
            raise ValueError("FAIL_TO_PASS and PASS_TO_PASS are both empty: nothing to grade")
        return self


def training_timeout_s(task_timeout_s: float, multiplier: float, pristine_duration_s: float | None = None,
                       pristine_factor: float = PRISTINE_SAFETY_FACTOR) -> float:
    """The training verifier's timeout of one task, seconds: ``task_timeout_s x multiplier`` (SWE-smith's
    3000 s x 0.06 = 180 s), raised to ``pristine_factor x pristine_duration_s`` where that is longer.

    Raises:
        InputError: a timeout or multiplier <= 0, a negative pristine duration, or a factor < 1.
    """
    if task_timeout_s <= 0 or multiplier <= 0:
        raise errors.InputError(f"task_timeout_s ({task_timeout_s}) and verifier_timeout_multiplier ({multiplier}) "
                                "must be > 0")
    if pristine_factor < 1 or (pristine_duration_s is not None and pristine_duration_s < 0):
        raise errors.InputError(f"pristine_factor must be >= 1 (got {pristine_factor}) and pristine_duration_s >= 0 "
                                f"(got {pristine_duration_s})")
    timeout_s = task_timeout_s * multiplier
    if pristine_duration_s is not None:
        timeout_s = max(timeout_s, pristine_factor * pristine_duration_s)
    return timeout_s


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or a list of messages (the assistant contents joined).

    Raises:
        InputError: the completion is neither (:func:`score_completion` scores it 0).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "\n".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    raise errors.InputError(f"completion must be a string or a list of messages, got {type(completion).__name__}")


def extract_patch(text: str) -> str:
    """The unified diff in an answer (the last fenced ``diff``/``patch`` block, else from the first ``diff --git``
    / ``--- a/`` line), newline-terminated, never repaired; ``""`` when there is none.
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
    """The verifier's verdict on one completion: ``reward`` 1.0 or 0.0 (the model's outcomes), None iff
    ``exception_type`` names an infrastructure or unexpected error; ``node_id`` None when scored in-process.
    """

    model_config = ConfigDict(frozen=True)

    reward: float | None = Field(default=None, ge=0.0, le=1.0)
    exception_type: str | None = None
    exception_message: str | None = None
    note: str = ""
    verifier_timeout_s: float = Field(gt=0)
    tampering: bool = False
    submission_failure: str | None = None
    node_id: str | None = None


def _failure_kind(evidence: dict[str, Any]) -> str | None:
    """The kind of the submission's own failure in a verdict's evidence (``evidence["submission_failure"]``:
    a kind, or a record with ``kind``), or None when the verdict names none."""
    failure = evidence.get("submission_failure")
    if not failure:
        return None
    if isinstance(failure, dict):
        return str(failure.get("kind") or failure.get("type") or "unknown")
    return str(failure)


def score_completion(
    completion: Any, task: VerifierSpec, *, verifier_timeout_multiplier: float = 0.06,
    memory_mb: int = RL_VERIFIER_LIMITS.memory_mb, cpus: float = RL_VERIFIER_LIMITS.cpus, name: str | None = None,
    tamper_policy: TamperPolicy = "reject",
    backend: "str | SandboxTarget" = "podman", ray: RayPlacement | None = None,
) -> RewardOutcome:
    """Apply a completion's patch in a fresh container of the task image (``memory_mb`` MiB, ``cpus``) and grade.

    No text or diff, or an ``InputError`` screening or applying: 0 with a note; an infrastructure or any
    other error: ``reward=None`` with its class name, never 0.

    Raises:
        InputError: the scorer's own settings are wrong (a multiplier <= 0, an unknown policy or backend).
    """
    timeout_s = training_timeout_s(task.task_timeout_s, verifier_timeout_multiplier, task.pristine_duration_s)
    if tamper_policy not in get_args(TamperPolicy):
        raise errors.InputError(f"unknown tamper policy {tamper_policy!r}; valid: {', '.join(get_args(TamperPolicy))}")
    backend_kind(backend)  # an unknown kind is the scorer's error, not this completion's

    def zero(note: str) -> RewardOutcome:
        return RewardOutcome(reward=0.0, note=note, verifier_timeout_s=timeout_s)

    try:
        text = completion_text(completion)
    except errors.InputError as exc:
        return zero(f"not credited: the completion is not text ({exc})")
    patch = extract_patch(text)
    if not patch:
        return zero("not credited: no diff in the completion")
    name = name or sanitize_name(f"ff-rl-{task.instance_id}-{uuid.uuid4().hex[:12]}")
    try:
        verdict = verify_on(
            ray, task, patch, timeout_s=timeout_s, spec=SandboxSpec(memory_mb=memory_mb, cpus=cpus), name=name,
            tamper_policy=tamper_policy, backend=backend,
        )
    except errors.InputError as exc:  # the completion's diff: refused by the screen or by git
        return zero(f"not credited: the completion's diff did not apply: {exc}")
    except Exception as exc:  # infrastructure, or anything else: this completion's, never the batch's
        return RewardOutcome(exception_type=type(exc).__name__, exception_message=str(exc) or repr(exc),
                             verifier_timeout_s=timeout_s)
    return RewardOutcome(reward=verdict.reward, note="; ".join(verdict.notes), verifier_timeout_s=timeout_s,
                         tampering=bool(verdict.evidence.get("submission", {}).get("tampering")),
                         submission_failure=(getattr(verdict, "submission_failure", None)
                                             or _failure_kind(verdict.evidence)) if verdict.reward == 0.0 else None,
                         node_id=verdict.evidence.get("node_id"))


class StepRewardCounts(BaseModel):
    """Rewards of one optimizer step's completions (``unresolved`` includes tampering and the submission's own
    failures; ``exceptions`` got no reward).
    """

    model_config = ConfigDict(frozen=True)

    step: int = Field(ge=1)
    completions: int = Field(default=0, ge=0)
    resolved: int = Field(default=0, ge=0)
    unresolved: int = Field(default=0, ge=0)
    submission_failures: int = Field(default=0, ge=0)
    exceptions: int = Field(default=0, ge=0)
    tampering: int = Field(default=0, ge=0)
    submission_failure_kinds: dict[str, int] = Field(default_factory=dict)
    exception_types: dict[str, int] = Field(default_factory=dict)
    nodes: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def total(cls, counts: "list[StepRewardCounts]", step: int | None = None) -> "StepRewardCounts":
        """``counts`` summed (per-kind and per-node maps merged); ``step``: the result's step, default the
        last of ``counts`` (1 when empty)."""
        maps: dict[str, dict[str, int]] = {"submission_failure_kinds": {}, "exception_types": {}, "nodes": {}}
        for c in counts:
            for field, merged in maps.items():
                for k, v in getattr(c, field).items():
                    merged[k] = merged.get(k, 0) + v
        numbers = ("completions", "resolved", "unresolved", "submission_failures", "exceptions", "tampering")
        return cls(step=step if step is not None else max((c.step for c in counts), default=1),
                   **{n: sum(getattr(c, n) for c in counts) for n in numbers},
                   **{f: dict(sorted(m.items())) for f, m in maps.items()})

    @classmethod
    def of(cls, step: int, outcomes: "list[RewardOutcome]") -> "StepRewardCounts":
        """The counts of ``outcomes`` scored for ``step``."""
        def tally(keys: list[str | None]) -> dict[str, int]:
            out: dict[str, int] = {}
            for k in keys:
                if k:
                    out[k] = out.get(k, 0) + 1
            return dict(sorted(out.items()))

        return cls(step=step, completions=len(outcomes), resolved=sum(o.reward == 1.0 for o in outcomes),
                   unresolved=sum(o.reward == 0.0 for o in outcomes),
                   submission_failures=sum(o.submission_failure is not None for o in outcomes),
                   exceptions=sum(o.reward is None for o in outcomes), tampering=sum(o.tampering for o in outcomes),
                   submission_failure_kinds=tally([o.submission_failure for o in outcomes]),
                   exception_types=tally([o.exception_type for o in outcomes]),
                   nodes=tally([o.node_id for o in outcomes]))


def _column(values: list | None, i: int) -> Any:
    return values[i] if values is not None and i < len(values) else None


class VerifierReward:
    """A TRL reward function (``reward_funcs``) backed by the verifier: 1.0, 0.0 or None per completion, with
    up to ``concurrency`` containers; ``counts`` per step and every outcome in ``outcomes``. TRL hands it the
    dataset's columns (:func:`~forgeflow.training.rl.build_rl_dataset`) as keyword arguments, ``FAIL_TO_PASS`` and
    ``PASS_TO_PASS`` among them.

    Raises:
        InputError: a multiplier <= 0 or ``concurrency`` < 1 (at construction); an unknown policy or
            backend (at the first call, before any completion is scored).
    """

    __name__ = "verifier"

    def __init__(self, *, verifier_timeout_multiplier: float = 0.06, memory_mb: int = RL_VERIFIER_LIMITS.memory_mb,
                 cpus: float = RL_VERIFIER_LIMITS.cpus, concurrency: int = 1, tamper_policy: TamperPolicy = "reject",
                 backend: "str | SandboxTarget" = "podman", ray: RayPlacement | None = None) -> None:
        if verifier_timeout_multiplier <= 0:
            raise errors.InputError(f"verifier_timeout_multiplier must be > 0, got {verifier_timeout_multiplier}")
        if concurrency < 1:
            raise errors.InputError(f"concurrency must be >= 1, got {concurrency}")
        self.verifier_timeout_multiplier = verifier_timeout_multiplier
        self.memory_mb, self.cpus, self.concurrency = memory_mb, cpus, concurrency
        self.tamper_policy, self.backend, self.ray = tamper_policy, backend, ray
        self.nonce = uuid.uuid4().hex[:8]
        self.counts: dict[int, StepRewardCounts] = {}
        self.outcomes: list[tuple[int, str, RewardOutcome]] = []
        self._lock = threading.Lock()

    def __call__(self, prompts: list, completions: list, *, instance_id: list[str], image_ref: list[str],
                 test_command: list[str], FAIL_TO_PASS: list[list[str]], PASS_TO_PASS: list[list[str]],
                 trainer_state: Any = None, **columns: Any) -> list[float | None]:
        step = int(getattr(trainer_state, "global_step", 0)) + 1
        timeouts = columns.get("task_timeout_s", columns.get("verifier_timeout_s"))
        pristine_duration_s = columns.get("pristine_duration_s")
        known_tests = columns.get("known_tests")
        if self.tamper_policy not in get_args(TamperPolicy):
            raise errors.InputError(f"unknown tamper policy {self.tamper_policy!r}; valid: "
                                    f"{', '.join(get_args(TamperPolicy))}")
        backend_kind(self.backend)

        def one(i: int) -> RewardOutcome:
            timeout = _column(timeouts, i)
            try:
                task = VerifierSpec(instance_id=instance_id[i], image_ref=image_ref[i],
                                    test_command=test_command[i], FAIL_TO_PASS=FAIL_TO_PASS[i],
                                    PASS_TO_PASS=PASS_TO_PASS[i],
                                    task_timeout_s=TASK_TIMEOUT_S if timeout is None else timeout,
                                    pristine_duration_s=_column(pristine_duration_s, i),
                                    known_tests=_column(known_tests, i))
            except Exception as exc:  # a bad task row: this completion's exception, never the batch's
                return RewardOutcome(exception_type=type(exc).__name__, exception_message=str(exc) or repr(exc),
                                     verifier_timeout_s=TASK_TIMEOUT_S * self.verifier_timeout_multiplier)
            name = sanitize_name(f"ff-rl-{instance_id[i]}-{self.nonce}-s{step}-{i}")
            return score_completion(completions[i], task, verifier_timeout_multiplier=self.verifier_timeout_multiplier,
                                    memory_mb=self.memory_mb, cpus=self.cpus, name=name,
                                    tamper_policy=self.tamper_policy, backend=self.backend, ray=self.ray)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            outcomes = list(pool.map(one, range(len(completions))))
        self._count(step, [str(_column(instance_id, i)) for i in range(len(outcomes))], outcomes)
        return [o.reward for o in outcomes]

    def _count(self, step: int, ids: list[str], outcomes: list[RewardOutcome]) -> None:
        with self._lock:
            earlier = [self.counts[step]] if step in self.counts else []
            self.counts[step] = StepRewardCounts.total([*earlier, StepRewardCounts.of(step, outcomes)], step)
            self.outcomes.extend((step, iid, o) for iid, o in zip(ids, outcomes))
