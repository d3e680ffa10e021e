"""Trials spread over a Ray cluster: one validation (NOP + Oracle runs), or one verifier run (an agent
trial's or an RL reward's, :func:`verify_on`), as one Ray task on a node that declares the sandbox
resource.

Each node that can run sandboxes declares a custom resource (``ray start --resources='{"sandbox": N}'``:
N trials at once); a validation asks for ``per_trial`` of it, so Ray places it only on such nodes.
The Ray task runs :func:`forgeflow.sandbox.trial.validate_candidate` there and returns the outcome
and its node id; the caller (a Prefect task in the flow's process) records the trials, so the store is
written once per trial by the flow, never by the node. A node that dies mid-validation is an
infrastructure fault: Ray runs the task again on another node (``max_retries``, Ray's own retry of a
task whose worker or node died; the trial ids are the same, so the rerun's rows replace nothing but
themselves and a container the dead node left under the trial's name is removed first), and when
Ray gives up the validation raises :class:`~forgeflow.common.errors.TransientInfraError` (never a
verdict on the task). Ray is imported lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.sandbox import trial
from forgeflow.sandbox.scoring import SubmissionVerdict, verify_submission
from forgeflow.sandbox.verifier import TaskTests

T = TypeVar("T")

_LOCK = threading.Lock()
_REMOTE: dict[str, Any] = {}


class RayPlacement(BaseModel):
    """Where validations run on a Ray cluster.

    Attributes:
        address: the cluster's GCS address (``host:port``, what ``ray start --head --port`` printed).
        resource: the custom resource a sandbox node declares.
        per_trial: how much of it one validation takes.
        max_retries: Ray's re-runs of a validation whose worker or node died.
    """

    model_config = ConfigDict(frozen=True)

    address: str = Field(min_length=1)
    resource: str = Field(default="sandbox", min_length=1)
    per_trial: float = Field(default=1.0, gt=0)
    max_retries: int = Field(default=3, ge=0)


def _remote_call(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[Any, str]:
    """The Ray task's body: ``fn(*args, **kwargs)`` on this node; returns its result and the node id."""
    import ray

    from forgeflow.common.settings import apply_container_env

    apply_container_env()
    return fn(*args, **kwargs), ray.get_runtime_context().get_node_id()


def connect(address: str) -> Any:
    """Ray, connected to ``address`` as a driver (once per process; the trials' and the RL episodes' one
    connection).

    Raises:
        ToolMissingError: Ray is not installed.
        TransientInfraError: the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a pinned dependency
        raise errors.ToolMissingError(f"Ray is not installed ({exc}); pip install 'ray[default]'") from exc
    with _LOCK:
        if not ray.is_initialized():
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False, namespace="forgeflow")
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise errors.TransientInfraError(f"cannot reach the Ray cluster at {address}: {exc}") from exc
        if "call" not in _REMOTE:
            _REMOTE["call"] = ray.remote(_remote_call)
    return ray


def disconnect() -> None:
    """Leave the Ray cluster (``ray.shutdown``) if this process joined one. A driver whose cluster
    goes away is ended by Ray itself (its core worker exits the process once the GCS stays
    unreachable), so a flow leaves as soon as its trials are done."""
    import sys

    ray = sys.modules.get("ray")
    with _LOCK:
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        _REMOTE.clear()


def with_node(outcome: trial.ValidationOutcome, node_id: str) -> trial.ValidationOutcome:
    """``outcome`` with ``node_id`` in each trial's ``verifier`` record (where it ran)."""
    def tag(result: trial.TrialResult | None) -> trial.TrialResult | None:
        if result is None:
            return None
        evidence = (result.verifier or trial.VerifierEvidence()).model_copy(update={"node_id": node_id})
        return result.model_copy(update={"verifier": evidence})

    return outcome.model_copy(update={"nop": tag(outcome.nop), "oracle": tag(outcome.oracle),
                                      "oracle_repeats": [tag(r) for r in outcome.oracle_repeats]})


def run_on_ray(placement: RayPlacement, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, str]:
    """Run ``fn(*args, **kwargs)`` as a Ray task on a sandbox node (``placement.resource``, no CPU
    reserved: the sandbox resource is what bounds the trials per node).

    Args:
        placement: the cluster and the resource (:class:`RayPlacement`).
        what: what runs: the Ray task's name (``ray list tasks``, the dashboard) and error messages
            (``validation of <instance id>``).
        fn: a module-level function (Ray pickles it by reference); args and kwargs must pickle.

    Returns:
        ``fn``'s result and the id of the node it ran on.

    Raises:
        TransientInfraError: the cluster cannot be reached, or the task's node died more than
            ``placement.max_retries`` times (Ray's own error in the message).
        ForgeflowError: what ``fn`` raised on the node (an InputError stays an InputError).
        InfraError: ``fn`` raised something else there.
    """
    ray = connect(placement.address)
    ref = _REMOTE["call"].options(name=what, resources={placement.resource: placement.per_trial},
                                  max_retries=placement.max_retries, retry_exceptions=False,
                                  num_cpus=0).remote(fn, args, kwargs)
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # the task itself raised: re-raise what it raised
        cause = exc.cause  # the node's exception itself (as_instanceof_cause would rename its class)
        if isinstance(cause, errors.ForgeflowError):
            raise cause from None
        raise errors.InfraError(f"{what} failed on Ray: {exc}") from exc
    except ray.exceptions.RayError as exc:  # worker or node lost, retries exhausted
        raise errors.TransientInfraError(f"{what} lost its Ray node {placement.max_retries + 1} times: "
                                         f"{type(exc).__name__}: {exc}") from exc


def validate_on_ray(placement: RayPlacement, candidate: Any, image_ref: str, test_command: str,
                    **kwargs: Any) -> trial.ValidationOutcome:
    """Run :func:`forgeflow.sandbox.trial.validate_candidate` as a Ray task on a sandbox node
    (:func:`run_on_ray`).

    Args:
        placement: the cluster and the resource (:class:`RayPlacement`).
        candidate / image_ref / test_command / kwargs: as ``validate_candidate`` (no ``on_trial``:
            the caller records the returned trials).

    Returns:
        The outcome, each trial's ``verifier`` carrying the ``node_id`` it ran on.

    Raises:
        As :func:`run_on_ray`.
    """
    outcome, node_id = run_on_ray(placement, f"validation of {candidate.instance_id}", trial.validate_candidate,
                                  candidate, image_ref, test_command, **kwargs)
    return with_node(outcome, node_id)


def verify_on(placement: RayPlacement | None, tests: TaskTests, submission: str, **kwargs: Any) -> SubmissionVerdict:
    """:func:`forgeflow.sandbox.scoring.verify_submission` here (``placement`` None) or as a Ray
    task on a sandbox node, whose id the verdict's ``evidence["node_id"]`` then carries.

    Args:
        placement: the cluster and the resource (:class:`RayPlacement`); None: in this process.
        tests: the task's image, test command, test ids and log parser
            (:class:`forgeflow.sandbox.verifier.TaskTests`, pickled to the node).
        submission: the submission's unified diff.
        kwargs: as ``verify_submission`` (``timeout_s``, ``spec``, ``name``, ``tamper_policy``,
            ``backend``).

    Raises:
        As ``verify_submission``; on Ray also as :func:`run_on_ray` (a lost node is a
        TransientInfraError: no reward, never 0).
    """
    if placement is None:
        return verify_submission(tests, submission, **kwargs)
    verdict, node_id = run_on_ray(placement, f"verifier of {tests.image_ref}", verify_submission, tests, submission,
                                  **kwargs)
    return verdict.model_copy(update={"evidence": {**verdict.evidence, "node_id": node_id}})
