"""Trials spread over a Ray cluster: one validation (NOP + Oracle runs), or one verifier run (an agent
trial's or an RL reward's, :func:`verify_on`), as one Ray task on a node that declares the sandbox
resource."""

from __future__ import annotations

import threading
import time
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
    """Where validations run on a Ray cluster; the ``forgeflow-dispatcher`` block
    (:class:`blocks.core.TrialDispatcher`) extends it."""

    model_config = ConfigDict(frozen=True)

    address: str = Field(min_length=1,
                         description="the cluster's GCS address (host:port, what ray start --head --port printed).")
    resource: str = Field(default="sandbox", min_length=1, description="the custom resource a sandbox node declares.")
    per_trial: float = Field(default=1.0, gt=0, description="how much of it one validation takes.")
    max_retries: int = Field(default=3, ge=0, description="Ray's re-runs of a validation whose worker or node died.")


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
                                      "nop_repeats": [tag(r) for r in outcome.nop_repeats],
                                      "oracle_repeats": [tag(r) for r in outcome.oracle_repeats]})


def run_on_ray(placement: RayPlacement, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, str]:
    """Run ``fn(*args, **kwargs)`` as a Ray task on a sandbox node; returns its result and the node id.

    Raises:
        TransientInfraError: the cluster cannot be reached, or the node died over ``placement.max_retries`` times.
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
    """:func:`forgeflow.sandbox.trial.validate_candidate` on a sandbox node (each trial's ``verifier`` has ``node_id``).
    """
    outcome, node_id = run_on_ray(placement, f"validation of {candidate.instance_id}", trial.validate_candidate,
                                  candidate, image_ref, test_command, **kwargs)
    return with_node(outcome, node_id)


def verify_on(placement: RayPlacement | None, tests: TaskTests, submission: str, **kwargs: Any) -> SubmissionVerdict:
    """:func:`forgeflow.sandbox.scoring.verify_submission` here (``placement`` None) or as a Ray task on a sandbox
    node, whose id the verdict's ``evidence["node_id"]`` carries; a lost node is a TransientInfraError, never 0."""
    if placement is None:
        return verify_submission(tests, submission, **kwargs)
    verdict, node_id = run_on_ray(placement, f"verifier of {tests.image_ref}", verify_submission, tests, submission,
                                  **kwargs)
    return verdict.model_copy(update={"evidence": {**verdict.evidence, "node_id": node_id}})


def sweep_node(key: str | None, value: str) -> list[str]:
    """A Ray task's body on one node: end the containers labelled ``key=value`` there (``key`` None: the one
    named ``value``), at every layer; their names."""
    from forgeflow.common.settings import apply_container_env
    from forgeflow.sandbox.podman_layers import sweep_containers, sweep_labelled

    apply_container_env()
    found = sweep_labelled(key, value) if key is not None else sweep_containers(value.__eq__)
    return sorted({*found.podman, *(n for *_, n in found.runtime), *(n for _, n in found.conmon)})


class NodeSweep(BaseModel):
    """What :func:`sweep_ray_nodes` did: ``ended`` node id -> names of the containers ended there; ``failed``
    node id -> why its sweep failed (the node died, the task timed out)."""

    model_config = ConfigDict(frozen=True)

    ended: dict[str, list[str]]
    failed: dict[str, str]


def sweep_ray_nodes(placement: RayPlacement, key: str, value: str, timeout_s: float = 120.0) -> NodeSweep:
    """End the containers labelled ``key=value`` (a cancelled run's) on every alive node of the cluster that
    declares ``placement.resource``: a Ray task pinned to each node (no resource taken, so busy nodes sweep too).

    Args:
        placement: the cluster and the sandbox resource.
        key / value: the label (``forgeflow.dev/flow-run`` = the run's id).
        timeout_s: seconds to wait for all nodes' sweeps together.

    Raises:
        TransientInfraError: the cluster cannot be reached.
    """
    ray = connect(placement.address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and placement.resource in (n.get("Resources") or {})]
    task = ray.remote(sweep_node)
    refs = {node: task.options(name=f"sweep {key}={value}", num_cpus=0, max_retries=0, scheduling_strategy=
                               NodeAffinitySchedulingStrategy(node, soft=False)).remote(key, value) for node in nodes}
    ended, failed, deadline = {}, {}, time.monotonic() + timeout_s
    for node, ref in refs.items():
        try:
            ended[node] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.RayError as exc:  # the node died meanwhile, or its sweep timed out or failed
            failed[node] = f"{type(exc).__name__}: {exc}"
    return NodeSweep(ended=ended, failed=failed)
