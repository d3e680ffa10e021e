"""The verifier's reward for RL rollouts: a completion parsed into a patch (:func:`extract_patch`),
graded by :func:`forgeflow.sandbox.scoring.verify_submission` in a fresh container of the task
image (:func:`score_completion`), here or as a Ray task on a sandbox node
(:func:`forgeflow.sandbox.dispatch.verify_on`), and the TRL reward function that scores a batch and
counts rewards, exceptions and the nodes they ran on per optimizer step (:class:`VerifierReward`).

An infrastructure failure gives reward None, never 0 (the burst's docstring,
:mod:`forgeflow.training.rl`, says how TRL leaves such a completion out of the advantages).
"""

from __future__ import annotations

import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common import errors
from forgeflow.common.names import sanitize_name
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement, verify_on
from forgeflow.sandbox.submission import TamperPolicy
from forgeflow.sandbox.verifier import TaskTests

_FENCED_DIFF = re.compile(r"```(?:diff|patch)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DIFF_START = re.compile(r"^(diff --git |--- a/|--- /dev/null)", re.MULTILINE)


class VerifierSpec(BaseModel):
    """What the verifier needs of a task.

    Attributes:
        instance_id: the task's id.
        image_ref: the task image (bug applied at ``/testbed``, a git repository).
        test_command: the verifier's command (``pytest -rA`` output), run in ``/testbed``.
        fail_to_pass / pass_to_pass: the task's test ids (SWE-bench grading); not both empty.
        verifier_timeout_s: the task's own verifier timeout in seconds (the one curation used);
            training uses it times :attr:`forgeflow.training.rl.RLBurstConfig.verifier_timeout_multiplier`.
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
        node_id: the Ray node the verifier ran on; None when it ran in this process.
    """

    model_config = ConfigDict(frozen=True)

    reward: float | None = Field(default=None, ge=0.0, le=1.0)
    exception_type: str | None = None
    exception_message: str | None = None
    note: str = ""
    verifier_timeout_s: float = Field(gt=0)
    tampering: bool = False
    node_id: str | None = None


def score_completion(
    completion: Any, task: VerifierSpec, *, verifier_timeout_multiplier: float = 0.06,
    memory_mb: int = 1024, cpus: float = 1.0, name: str | None = None, tamper_policy: TamperPolicy = "reject",
    backend: "str | SandboxTarget" = "podman", ray: RayPlacement | None = None,
) -> RewardOutcome:
    """Apply a completion's patch in a fresh container of the task image and grade the tests.

    Runs :func:`forgeflow.sandbox.scoring.verify_submission` (the agent trials' verifier: screening by
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
        ray: run the verifier as a Ray task on a sandbox node of this cluster
            (:func:`forgeflow.sandbox.dispatch.verify_on`); None: here.

    Returns:
        The outcome (with the Ray ``node_id`` it was scored on); an
        :class:`~forgeflow.common.errors.InfraError` (a lost Ray node included) becomes
        ``reward=None`` with its class name, never 0.

    Raises:
        InputError: ``verifier_timeout_multiplier`` <= 0 or a malformed completion.
    """
    if verifier_timeout_multiplier <= 0:
        raise errors.InputError(f"verifier_timeout_multiplier must be > 0, got {verifier_timeout_multiplier}")
    timeout_s = task.verifier_timeout_s * verifier_timeout_multiplier
    patch = extract_patch(completion_text(completion))
    name = name or sanitize_name(f"ff-rl-{task.instance_id}-{uuid.uuid4().hex[:12]}")
    tests = TaskTests(image_ref=task.image_ref, test_command=task.test_command,
                      fail_to_pass=list(task.fail_to_pass), pass_to_pass=list(task.pass_to_pass))
    try:
        verdict = verify_on(
            ray, tests, patch, timeout_s=timeout_s, spec=SandboxSpec(memory_mb=memory_mb, cpus=cpus), name=name,
            tamper_policy=tamper_policy, backend=backend,
        )
    except errors.InfraError as exc:
        return RewardOutcome(exception_type=type(exc).__name__, exception_message=str(exc) or repr(exc),
                             verifier_timeout_s=timeout_s)
    return RewardOutcome(reward=verdict.reward, note="; ".join(verdict.notes), verifier_timeout_s=timeout_s,
                         tampering=bool(verdict.evidence.get("submission", {}).get("tampering")),
                         node_id=verdict.evidence.get("node_id"))


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
        nodes: Ray node id -> completions scored there (empty when the verifier ran in-process).
    """

    model_config = ConfigDict(frozen=True)

    step: int = Field(ge=1)
    completions: int = Field(default=0, ge=0)
    resolved: int = Field(default=0, ge=0)
    unresolved: int = Field(default=0, ge=0)
    exceptions: int = Field(default=0, ge=0)
    tampering: int = Field(default=0, ge=0)
    exception_types: dict[str, int] = Field(default_factory=dict)
    nodes: dict[str, int] = Field(default_factory=dict)


class VerifierReward:
    """A TRL reward function (``GRPOTrainer``/``RLOOTrainer`` ``reward_funcs``) backed by the verifier.

    Called with the batch's ``completions`` and the dataset columns of :class:`forgeflow.training.rl.RLData` (TRL passes
    every extra column as a keyword list, plus ``trainer_state``); returns one reward per
    completion: 1.0, 0.0 or None (see :func:`score_completion`). Up to ``concurrency`` verifier
    containers run at once, here or (``ray``) as Ray tasks on the cluster's sandbox nodes.
    ``counts`` holds a :class:`StepRewardCounts` per optimizer step and ``outcomes`` every
    :class:`RewardOutcome` with its step and instance id.

    Raises:
        InputError: ``verifier_timeout_multiplier`` <= 0 or ``concurrency`` < 1.
    """

    __name__ = "verifier"

    def __init__(self, *, verifier_timeout_multiplier: float = 0.06, memory_mb: int = 1024,
                 cpus: float = 1.0, concurrency: int = 1, tamper_policy: TamperPolicy = "reject",
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
                                    tamper_policy=self.tamper_policy, backend=self.backend, ray=self.ray)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            outcomes = list(pool.map(one, range(len(completions))))
        self._count(step, [instance_id[i] for i in range(len(outcomes))], outcomes)
        return [o.reward for o in outcomes]

    def _count(self, step: int, ids: list[str], outcomes: list[RewardOutcome]) -> None:
        with self._lock:
            old = self.counts.get(step) or StepRewardCounts(step=step)
            types, nodes = dict(old.exception_types), dict(old.nodes)
            for o in outcomes:
                if o.exception_type:
                    types[o.exception_type] = types.get(o.exception_type, 0) + 1
                if o.node_id:
                    nodes[o.node_id] = nodes.get(o.node_id, 0) + 1
            self.counts[step] = StepRewardCounts(
                step=step, completions=old.completions + len(outcomes),
                resolved=old.resolved + sum(o.reward == 1.0 for o in outcomes),
                unresolved=old.unresolved + sum(o.reward == 0.0 for o in outcomes),
                exceptions=old.exceptions + sum(o.reward is None for o in outcomes),
                tampering=old.tampering + sum(o.tampering for o in outcomes),
                exception_types=dict(sorted(types.items())), nodes=dict(sorted(nodes.items())),
            )
            self.outcomes.extend((step, iid, o) for iid, o in zip(ids, outcomes))
