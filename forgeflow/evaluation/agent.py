"""One agent trial (Harbor's and SWE-bench's shape): agent, submission, verifier.

1. **agent**: mini-swe-agent 2.4.6 (:mod:`forgeflow.evaluation.mswea`), its commands in a no-network container
   of the task image on ``AgentConfig.sandbox_backend``; prompts from its ``swebench_backticks.yaml``.
2. **submission**: taken where the agent has no hand (:func:`take_submission`).
3. **verifier**: :func:`forgeflow.sandbox.scoring.verify_submission` in a fresh container of the pristine
   image, here or on a Ray node (``AgentConfig.verifier_ray``).

Outcomes versus breakage (docs/architecture.md): format errors, the step limit, a context overflow or an
empty patch are the model's outcomes (reward 0 or 1); an endpoint failure is a ``ModelEndpointError`` (reward
None, no verifier run); an overrun of ``agent_timeout_s`` is an ``AgentTimeoutError`` recorded *with* the
verifier's reward (Harbor's convention), as are the supervisor's ``AgentLoopError`` / ``AgentHangError``
(:mod:`forgeflow.evaluation.supervision`); sandbox failures are the exception with reward None."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_write_text, sha256_json
from forgeflow.common.names import sanitize_name
from forgeflow.evaluation import chat_images
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.chat_images import ImageRef
from forgeflow.evaluation.mswea import (
    MODEL_API_KEY_ENV,
    endpoint_model_class,
    mswea_config,
    prepare_mswea_env,
    supervised_agent_class,
    usage_totals,
)
from forgeflow.evaluation.sandbox_env import SandboxEnvironment, environment_config
from forgeflow.evaluation.supervision import (
    HangCheck,
    HangWatchdog,
)
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement, run_on_ray, verify_on
from forgeflow.sandbox.limits import DEFAULT_VERIFIER_TIMEOUT_S
from forgeflow.sandbox.scoring import SubmissionVerdict
from forgeflow.sandbox.tree import TreeTooLargeError, export_tree
from forgeflow.sandbox.trial import TrialResult, VerifierEvidence, container_name, make_trial_id
from forgeflow.sandbox.verifier import LOG_TAIL_CHARS, TaskTests

# --- problem statements ----------------------------------------------------------------------
MAX_TESTS_LISTED = 10
"""Failing tests named in a problem statement; the rest are counted (keeps prompts short)."""


def problem_statement_for(candidate_patch: str, failing_tests: list[str]) -> str:
    """An issue-like task text naming the failing tests, with nothing of the patch in it.

    SWE-smith's static "failing tests" template (``swesmith.issue_gen.get_static``: ``PROMPT_TESTS_F2P``); no
    changed code line of the patch may appear in the text. At most :data:`MAX_TESTS_LISTED` tests are named.

    Raises:
        InputError: ``failing_tests`` is empty or ``candidate_patch`` is not a unified diff.
    """
    from swesmith.issue_gen.get_static import PROMPT_TESTS_F2P, print_list
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    tests = sorted({t.strip() for t in failing_tests if t and t.strip()})
    if not tests:
        raise errors.InputError("failing_tests is empty: a problem statement needs at least one FAIL_TO_PASS test")
    try:
        patch = PatchSet(candidate_patch)
    except UnidiffParseError as exc:
        raise errors.InputError(f"candidate_patch is not a unified diff: {exc}") from exc
    if len(patch) == 0:
        raise errors.InputError("candidate_patch is empty (no file changed)")
    listed = tests[:MAX_TESTS_LISTED]
    more = f"\n- ... and {len(tests) - len(listed)} more" if len(tests) > len(listed) else ""
    text = PROMPT_TESTS_F2P.format(f2p_list=print_list(listed) + more)
    changed = {
        line.value.strip()
        for pfile in patch for hunk in pfile for line in hunk
        if (line.is_added or line.is_removed) and len(line.value.strip()) >= 8
    }
    leaked = [c for c in changed if c in text]
    if leaked:  # a test id that quotes code: drop the test names rather than leak the patch
        text = PROMPT_TESTS_F2P.format(f2p_list=f"- {len(tests)} test(s) in the test suite")
    return text


# --- the trial -------------------------------------------------------------------------------
@dataclass
class AgentPhase:
    """What an agent's run in its container left behind (the canary's agent phase; an RL episode's grading).

    Attributes:
        exit_status: the agent's exit status (``Submitted``, ``LimitsExceeded``, an exception's class name).
        submission: the agent's own diff text (the verifier's git diff replaces it when graded).
        tree: the repository tree taken from the stopped container (a tar, bytes), or None.
        error: the infrastructure failure that ended the phase (a lost container, the endpoint), or None.
        env_setup_s: seconds to start the container.
        agent_s: seconds the agent ran.
        n_steps: model calls.
        n_input_tokens / n_output_tokens: token usage the endpoint reported.
        notes: for a person.
        supervision: ``{kind, evidence, trajectory_path}`` of a dead-loop or hang stop, or None.
    """

    exit_status: str = ""
    submission: str = ""
    tree: bytes | None = None
    error: BaseException | None = None
    env_setup_s: float = 0.0
    agent_s: float = 0.0
    n_steps: int = 0
    n_input_tokens: int = 0
    n_output_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    supervision: dict[str, Any] | None = None


def agent_container_name(instance_id: str, trial_id: str) -> str:
    """The agent's container (pod) name: ``ff-agentenv-<instance id>-<trial id[:10]>``, sanitized (a
    DNS label of <= 63 chars; distinct from the verifier's
    :func:`forgeflow.sandbox.trial.container_name`)."""
    return sanitize_name(f"ff-agentenv-{instance_id}-{trial_id[:10]}")


def _run_agent_phase(
    trial_id: str, instance_id: str, image_ref: str, problem_statement: str, base_url: str,
    model_alias: str, config: AgentConfig, traj_path: Path, images: Sequence[ImageRef] = (),
) -> AgentPhase:
    """Run mini-swe-agent in a container of ``image_ref``, take the submission, remove the container; endpoint,
    overrun and sandbox failures go to ``AgentPhase.error``."""
    phase = AgentPhase()
    t0 = time.monotonic()
    deadline = t0 + config.agent_timeout_s
    cfg = mswea_config(image_ref, base_url, model_alias, config)
    env_config = environment_config(cfg["environment"], image=image_ref, backend=config.sandbox_backend,
                                    name=agent_container_name(instance_id, trial_id), **config.over().model_dump())
    watchdog = HangWatchdog(config.hang_idle_s)
    model = endpoint_model_class()(deadline_monotonic=deadline, action_format=config.action_format,
                                    watchdog=watchdog, images=list(images), **cfg["model"])
    agent = None
    env = None
    try:
        env = SandboxEnvironment.start(config.sandbox_backend, env_config)
        env.git("rev-parse", "HEAD")  # the task's repository is a git work tree: fails before the agent starts
        phase.env_setup_s = time.monotonic() - t0
        agent = supervised_agent_class()(model, env, output_path=traj_path, loop_threshold=config.loop_threshold,
                                      watchdog=watchdog, **cfg["agent"])

        def on_hang(check: HangCheck) -> None:
            env.interrupt()

        watchdog.on_hang = on_hang
        watchdog.start()
        try:
            result = agent.run(problem_statement)
            phase.exit_status = str(result.get("exit_status", ""))
            if phase.exit_status == "ContextWindowExceeded":  # the model's outcome
                phase.notes.append(f"context window exceeded: {result.get('exception_str', '')}")
        except (errors.ModelEndpointError, errors.AgentTimeoutError) as exc:
            if watchdog.hung and not isinstance(exc, errors.AgentHangError):
                exc = model._hang_error("a model call")  # the endpoint error came from the hang
            phase.error = exc
            phase.exit_status = type(exc).__name__
            if isinstance(exc, errors.AgentLoopError | errors.AgentHangError):
                phase.supervision = {
                    "kind": "dead_loop" if isinstance(exc, errors.AgentLoopError) else "hang",
                    "evidence": exc.evidence, "trajectory_path": str(traj_path),
                }
        finally:
            watchdog.stop()
        phase.agent_s = time.monotonic() - t0
        if phase.error is None and (phase.exit_status == "TimeExceeded" or time.monotonic() > deadline):
            phase.error = errors.AgentTimeoutError(
                f"agent exceeded its {config.agent_timeout_s:.0f} s budget ({phase.agent_s:.1f} s)"
            )
        if not isinstance(phase.error, errors.ModelEndpointError):
            take_submission(env, phase)
    except errors.ModelRequestError:  # a malformed request is a configuration bug, not an outcome
        raise
    except errors.InfraError as exc:  # sandbox broke (image missing, container or pod gone, podman failure)
        phase.error = exc
    finally:
        watchdog.stop()
        model.close()
        if env is not None:
            try:
                env.stop()
            except errors.InfraError as exc:  # the trial's result stands; the pod's deadline bounds a leftover
                phase.notes.append(f"could not remove the agent's container: {type(exc).__name__}: {exc}")
        phase.agent_s = phase.agent_s or time.monotonic() - t0
        if agent is not None:
            _save_trajectory(agent, phase, traj_path, {"trial_id": trial_id, "instance_id": instance_id,
                                                       "image_ref": image_ref})
    return phase


def take_submission(env: SandboxEnvironment, phase: AgentPhase) -> None:
    """Take the agent's submission into ``phase.tree`` (a tar of the repository, bytes) where the agent has
    no hand; raises nothing: a lost sandbox goes to ``phase.error``, an oversized tree to ``phase.notes``.

    On podman the tree is copied out of the stopped container from the host; on Kubernetes the same ``tar``
    runs in the pod's ``tree`` sidecar. A vanished container or pod is an infrastructure fault, never the agent's."""
    try:
        if env.config.backend == "podman":
            phase.tree = export_tree(env.config.name, env.config.cwd)
        else:
            env.interrupt()
            phase.tree = env.sandbox.export_tree()  # type: ignore[attr-defined]
    except TreeTooLargeError as exc:  # the agent's own doing: graded as no change
        phase.notes.append(f"could not take the submission: {exc}")
    except errors.SandboxError as exc:  # the container or pod vanished: infrastructure
        phase.error = exc


def _record_submission(traj_path: Path, patch: str) -> None:
    """Replace the trajectory's ``info.submission`` with the submission as the verifier's git wrote it."""
    try:
        data = json.loads(traj_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    info = data.setdefault("info", {})
    info["submission"] = patch
    info.setdefault("forgeflow", {})["submission_source"] = "git diff in the verifier's pristine sandbox"
    atomic_write_text(traj_path, json.dumps(data, indent=2))


def _save_trajectory(agent: Any, phase: AgentPhase, traj_path: Path, ids: dict[str, str]) -> None:
    """Count the run's steps and tokens into ``phase`` and save the trajectory with forgeflow's
    ``info`` (exit status, submission, ``forgeflow``: ``ids`` plus the counts, time, error, supervision)."""
    phase.n_steps = int(agent.n_calls)
    phase.n_input_tokens, phase.n_output_tokens = usage_totals(agent.messages)
    agent.save(traj_path, {
        "info": {
            "exit_status": phase.exit_status,
            "submission": phase.submission,
            "forgeflow": {
                **ids, "n_steps": phase.n_steps, "n_input_tokens": phase.n_input_tokens,
                "n_output_tokens": phase.n_output_tokens, "agent_s": phase.agent_s,
                "error": f"{type(phase.error).__name__}: {phase.error}" if phase.error else None,
                "supervision": phase.supervision,
                "supervision_work": {"calls_checked": agent.loop_detector.n_calls,
                                     "signatures_computed": agent.loop_detector.signatures_computed,
                                     "comparisons": agent.loop_detector.comparisons},
                "stream": dict(agent.stream_stats),
            },
        },
        "instance_id": ids["instance_id"],
    })


def _record(
    *, trial_id: str, instance_id: str, started_at: datetime, phase: AgentPhase,
    reward: float | None, error: BaseException | None, verdict: SubmissionVerdict | None, notes: list[str],
) -> TrialResult:
    """Build the agent's TrialRecord (costs, verifier evidence; an AgentTimeoutError keeps the verifier's reward)."""
    message = "\n".join([str(error) or repr(error), *notes]) if error is not None else None
    verifier = verdict.result if verdict is not None else None
    evidence = {**verdict.evidence, "notes": verdict.notes} if verdict is not None else None
    fields: dict[str, Any] = {
        "trial_id": trial_id, "instance_id": instance_id, "kind": "agent",
        "reward": reward, "exception_type": type(error).__name__ if error is not None else None,
        "exception_message": message, "started_at": started_at, "env_setup_s": phase.env_setup_s,
        "agent_s": phase.agent_s, "verifier_s": verifier.duration_s if verifier else None,
        "tests": verifier.tests if verifier else {},
        "log_tail": (verifier.log_tail if verifier else "") or "\n".join(notes)[-LOG_TAIL_CHARS:],
        "agent_steps": phase.n_steps, "input_tokens": phase.n_input_tokens,
        "output_tokens": phase.n_output_tokens, "supervision": phase.supervision, "verifier": evidence,
        "submission": _graded_submission(phase, verdict),
    }
    return TrialResult(**fields)


def _graded_submission(phase: AgentPhase, verdict: SubmissionVerdict | None) -> str | None:
    """The submission as the verifier graded it: git's own patch when it put the agent's tree in place,
    else the diff taken from the agent (None when the verifier never ran and no diff was taken)."""
    if verdict is not None and (phase.tree is not None or verdict.submission_patch):
        return verdict.submission_patch
    if phase.tree is None and (verdict is not None or phase.submission):
        return phase.submission
    return None


def supervision_event(record: TrialResult, job_id: str | None = None, run_id: str | None = None) -> Any:
    """The store row (keyed ``<trial_id>:<kind>``) of a supervisor stop, or None when the supervisor did not stop
    ``record``."""
    from forgeflow.ledger.records import SupervisionEventRecord

    if record.supervision is None:
        return None
    kind = record.supervision.kind
    return SupervisionEventRecord(
        event_id=f"{record.trial_id}:{kind}", trial_id=record.trial_id, job_id=job_id, kind=kind,
        evidence={**record.supervision.evidence, "exception_type": record.exception_type,
                  "reward": record.reward},
        trajectory_path=record.supervision.trajectory_path, run_id=run_id,
    )


def default_run_key(problem_statement: str, model_alias: str, base_url: str, config: AgentConfig,
                    images: Sequence[ImageRef] = ()) -> str:
    """The run key of an agent trial: sha256 of everything that changes its result but the image.

    ``verifier_ray`` is left out, as are ``sandbox_backend`` ``podman`` and ``screen_policy`` ``reject`` (the
    defaults), so the trial ids of configs from before those fields existed stay what they were."""
    exclude = ({"verifier_ray"} | ({"sandbox_backend"} if config.sandbox_backend == "podman" else set())
               | ({"screen_policy"} if config.screen_policy == "reject" else set()))
    return sha256_json({
        "problem_statement": problem_statement, "model_alias": model_alias, "base_url": base_url,
        "config": config.resolved().model_dump(mode="json", exclude=exclude),  # where it runs is not what
        **({"images": [ref.sha256 for ref in images]} if images else {}),  # a text task's key is what it was
    })


def run_agent_trial(
    task: TaskTests,
    base_url: str,
    model_alias: str,
    config: AgentConfig,
    out_dir: Path,
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S,
    run_key: str | None = None,
) -> TrialResult:
    """Run one agent trial: mini-swe-agent in the task image, then the verifier in a fresh one.

    Args:
        base_url: OpenAI-compatible endpoint, e.g. ``http://127.0.0.1:8801/v1``.
        out_dir: where ``<trial_id>.traj.json`` is written when the run ends (each step's messages are
            appended to ``<trial_id>.messages.jsonl`` meanwhile).
        verifier_timeout_s: timeout of the test run in seconds.
        run_key: distinguishes repeated trials of the same inputs; default :func:`default_run_key`.

    Returns:
        The ``agent`` TrialRecord: reward 1.0/0.0 when the verifier ran; reward None with the exception
        (``ModelEndpointError``, a sandbox error); an ``AgentTimeoutError`` (or the supervisor's
        ``AgentLoopError`` / ``AgentHangError`` with ``supervision``) together with the verifier's reward.

    Raises:
        InputError: ``base_url`` or ``model_alias`` is malformed, or ``task`` has no test to grade or no problem
            statement.
        ModelRequestError: the endpoint rejected the request with a 4xx (other than a context overflow).
    """
    instance_id, image_ref, problem_statement = task.instance_id, task.image_ref, task.problem_statement
    for arg_name, value in (("base_url", base_url), ("model_alias", model_alias)):
        if not isinstance(value, str) or not value.strip():
            raise errors.InputError(f"{arg_name} must be a non-empty string, got {value!r}")
    if not base_url.startswith(("http://", "https://")):
        raise errors.InputError(f"base_url must be an http(s) URL, got {base_url!r}")
    if not task.graded_tests():
        raise errors.InputError("FAIL_TO_PASS and PASS_TO_PASS are both empty: nothing to grade")
    if not task.problem_statement:
        raise errors.InputError(f"task {task.instance_id!r} has no problem statement: nothing to give the agent")
    if verifier_timeout_s <= 0:
        raise errors.InputError(f"verifier_timeout_s must be > 0, got {verifier_timeout_s}")

    prepare_mswea_env()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [chat_images.image_ref(source, out_dir / "images") for source in getattr(task, "images", ())]
    key = run_key or default_run_key(problem_statement, model_alias, base_url, config, images)
    trial_id = make_trial_id(instance_id, "agent", image_ref, key)
    started_at = datetime.now(timezone.utc)
    traj_path = out_dir / f"{trial_id}.traj.json"

    phase = _run_agent_phase(trial_id, instance_id, image_ref, problem_statement, base_url,
                             model_alias, config, traj_path, images)
    notes = list(phase.notes)
    error = phase.error
    reward: float | None = None
    verdict: SubmissionVerdict | None = None
    if error is None or isinstance(error, errors.AgentTimeoutError):
        try:
            verdict = verify_on(
                config.verifier_ray, task, phase.submission,
                timeout_s=verifier_timeout_s, spec=SandboxSpec.of(config.over()),
                name=container_name(instance_id, "agent", trial_id), tamper_policy=config.tamper_policy,
                screen_policy=config.screen_policy, backend=config.verifier_backend, tree=phase.tree,
            )
            reward = verdict.reward
            notes.extend(verdict.notes)
            if phase.tree is not None:
                _record_submission(traj_path, verdict.submission_patch)
        except errors.InfraError as exc:  # the verifier broke: no reward, never 0
            reward = None
            notes.append(f"verifier failed: {type(exc).__name__}: {exc}")
            error = error or exc
    notes.append(f"agent exit status: {phase.exit_status or 'none'}; steps {phase.n_steps}; "
                 f"input tokens {phase.n_input_tokens}")
    return _record(trial_id=trial_id, instance_id=instance_id, started_at=started_at, phase=phase,
                   reward=reward, error=error, verdict=verdict, notes=notes)


def run_agent_trial_on(placement: RayPlacement | None, task: TaskTests, base_url: str, model_alias: str,
                       config: AgentConfig, out_dir: Path, verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S,
                       run_key: str | None = None) -> TrialResult:
    """:func:`run_agent_trial` here (``placement`` None) or, whole, as one Ray task on a sandbox node.

    On Ray the node must reach ``base_url`` and write ``out_dir`` (shared storage on a multi-machine cluster);
    ``$FORGEFLOW_MODEL_API_KEY`` goes with the task. An unreachable cluster or a node lost past
    ``placement.max_retries`` gives the trial's exception (``TransientInfraError``, no reward, never 0).

    Raises:
        As :func:`run_agent_trial`, also when raised on the node.
    """
    if placement is None:
        return run_agent_trial(task, base_url, model_alias, config, out_dir, verifier_timeout_s, run_key)
    local = config.model_copy(update={"verifier_ray": None})
    started_at = datetime.now(timezone.utc)
    try:
        record, node_id = run_on_ray(placement, f"agent trial of {task.instance_id}", _agent_trial_with_key,
                                     os.environ.get(MODEL_API_KEY_ENV), task, base_url, model_alias, local,
                                     Path(out_dir), verifier_timeout_s, run_key)
    except (errors.InputError, errors.ModelRequestError):
        raise
    except errors.InfraError as exc:  # cluster or node lost: the trial's exception
        key = run_key or default_run_key(task.problem_statement, model_alias, base_url, local)
        return TrialResult(trial_id=make_trial_id(task.instance_id, "agent", task.image_ref, key),
                           instance_id=task.instance_id, kind="agent", exception_type=type(exc).__name__,
                           exception_message=str(exc), started_at=started_at, env_setup_s=0.0)
    evidence = (record.verifier or VerifierEvidence()).model_copy(update={"node_id": node_id})
    return record.model_copy(update={"verifier": evidence})


def _agent_trial_with_key(api_key: str | None, *args: Any) -> TrialResult:
    """:func:`run_agent_trial` with ``$FORGEFLOW_MODEL_API_KEY`` = ``api_key`` for its duration (a Ray
    task's body: the driver's environment does not reach the node's worker process)."""
    previous = os.environ.get(MODEL_API_KEY_ENV)
    if api_key is not None:
        os.environ[MODEL_API_KEY_ENV] = api_key
    try:
        return run_agent_trial(*args)
    finally:
        if api_key is not None:
            if previous is None:
                os.environ.pop(MODEL_API_KEY_ENV, None)
            else:
                os.environ[MODEL_API_KEY_ENV] = previous
