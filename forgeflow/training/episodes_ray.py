"""Agentic RL episodes on Ray nodes: the episode's container on a sandbox node, the policy here.

When the burst's dispatcher is a Ray cluster (a ``forgeflow-dispatcher`` block of kind ``ray``,
:class:`forgeflow.sandbox.dispatch.RayPlacement`), :func:`forgeflow.training.episodes_run.run_episode` starts
the episode's container on a node that declares the sandbox resource, inside a Ray actor
(:class:`NodeEpisodeEnv`, threaded so the hang watchdog's interrupt reaches a command still running), and
drives it from the trainer's process through :class:`RayEpisodeEnv`: the policy samples here (the model lives
in the trainer), each command runs there, the tree is taken there, and the verifier runs as a Ray task on a
sandbox node (:func:`forgeflow.sandbox.dispatch.verify_on`), so only the tree's bytes cross the wire.

A node or actor lost mid-episode is a :class:`~forgeflow.common.errors.SandboxError` (no reward, never 0), and
so is an episode no node takes by its deadline. The container carries the run's label on its node;
:func:`forgeflow.sandbox.dispatch.sweep_ray_nodes` ends a cancelled run's containers on every sandbox node.
"""

from __future__ import annotations

from typing import Any

from forgeflow.common import errors
from forgeflow.evaluation.agent import AgentPhase, take_submission
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement, sweep_node
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.training.episodes import EpisodeSettings
from forgeflow.training.episodes_env import start_episode_env


class NodeEpisodeEnv:
    """The actor's body on the sandbox node: the episode's container
    (:class:`~forgeflow.evaluation.sandbox_env.SandboxEnvironment`).

    Args:
        task: the task (its image).
        settings: the episode's limits (memory MiB, CPUs, the command timeout seconds).
        backend: the node's sandbox backend (kind or :class:`SandboxTarget`, with the run's label).
        name: the container's name.

    Raises:
        SandboxError / InfraError: the container did not start (or has no git work tree).
    """

    def __init__(self, task: TaskTests, settings: EpisodeSettings, backend: str | SandboxTarget, name: str) -> None:
        from forgeflow.common.settings import apply_container_env

        apply_container_env()
        self.env = start_episode_env(task, settings, backend, name)

    def node_id(self) -> str:
        """The Ray node id this actor (and the container) runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def execute(self, command: str, timeout: int) -> dict[str, Any]:
        """Run ``command`` (timeout seconds); ``{"output": {...}}`` or ``{"submitted": [messages]}``."""
        from minisweagent.exceptions import Submitted

        try:
            return {"output": self.env.execute({"command": command}, timeout=timeout)}
        except Submitted as exc:
            return {"submitted": list(exc.messages)}

    def interrupt(self) -> None:
        """Kill the episode's commands still running (the watchdog's hang stop)."""
        self.env.interrupt()

    def take_tree(self) -> tuple[bytes | None, list[str], BaseException | None]:
        """The repository's tree (a tar, bytes) taken where the policy has no hand; (tree, notes, error)."""
        phase = AgentPhase()
        take_submission(self.env, phase)
        return phase.tree, phase.notes, phase.error

    def stop(self) -> None:
        """Remove the container (idempotent)."""
        self.env.stop()


class RayEpisodeEnv:
    """The trainer's side of an episode's container on a Ray node (the surface :func:`run_episode` uses).

    Args:
        placement: the cluster and the sandbox resource.
        task / settings / backend / name: as :class:`NodeEpisodeEnv`.
        start_timeout_s: seconds the container may wait for a node with the resource free and start there
            (the episode's deadline); None: no bound.

    Attributes:
        node_id: the node the container runs on.

    Raises:
        TransientInfraError: the cluster cannot be reached.
        SandboxError: the container did not start on the node, no node took it within ``start_timeout_s``,
            or the node was lost.
    """

    def __init__(self, placement: RayPlacement, task: TaskTests, settings: EpisodeSettings,
                 backend: str | SandboxTarget, name: str, start_timeout_s: float | None = None) -> None:
        from forgeflow.sandbox import dispatch

        self._ray = dispatch.connect(placement.address)  # dispatch's one connection per process
        actor_class = self._ray.remote(NodeEpisodeEnv)
        self._actor = actor_class.options(resources={placement.resource: placement.per_trial}, num_cpus=0,
                                          max_concurrency=4, max_restarts=0).remote(task, settings, backend, name)
        self.name, self._stopped, self._resource = name, False, placement.resource
        try:
            self.node_id = self._call("node_id", timeout_s=start_timeout_s)
        except BaseException:
            self._kill()
            raise

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        ray = self._ray
        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:  # no node took it (all lost, or all busy) in time
            raise errors.SandboxError(f"episode container {self.name}: no Ray node with {self._resource!r} free "
                                      f"started it within {timeout_s:.0f} s") from exc
        except ray.exceptions.RayTaskError as exc:  # the node's own exception (the container failed)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, errors.ForgeflowError):
                raise cause from None
            raise errors.SandboxError(f"episode container {self.name} failed on Ray: {exc}") from exc
        except ray.exceptions.RayError as exc:  # the actor or its node died
            raise errors.SandboxError(f"episode container {self.name} vanished with its Ray actor (its node lost, "
                                      f"or the container failed to start): {type(exc).__name__}: {exc}") from exc

    def execute(self, action: dict[str, Any], timeout: int) -> dict[str, Any]:
        """Run ``action["command"]`` on the node; raises mini-swe-agent's ``Submitted`` on the marker, as
        :meth:`SandboxEnvironment.execute` does."""
        from minisweagent.exceptions import Submitted

        out = self._call("execute", action["command"], timeout)
        if "submitted" in out:
            raise Submitted(*out["submitted"])
        return out["output"]

    def interrupt(self) -> None:
        """Kill the commands still running on the node (best effort: errors are swallowed)."""
        try:
            self._call("interrupt")
        except errors.ForgeflowError:
            pass

    def take_submission(self, phase: AgentPhase) -> None:
        """Fill ``phase.tree`` / ``notes`` / ``error`` from the node, as :func:`take_submission` does here."""
        try:
            tree, notes, error = self._call("take_tree")
        except errors.SandboxError as exc:
            phase.error = exc
            return
        phase.tree, phase.error = tree, error
        phase.notes.extend(notes)

    def _kill(self) -> None:
        try:
            self._ray.kill(self._actor)
        except Exception:  # noqa: BLE001 - the actor may already be gone with its node
            pass

    def stop(self) -> None:
        """Remove the container on the node and end the actor (idempotent).

        Raises:
            SandboxError: the node could not remove the container.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            self._call("stop")
        except errors.SandboxError:  # the actor died (its worker killed): its node, if alive, removes the container
            if not self._remove_on_node():
                raise
        finally:
            self._kill()

    def _remove_on_node(self, timeout_s: float = 120.0) -> bool:
        """End the container by name on :attr:`node_id` by a Ray task pinned there; False when that failed."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self._ray
        task = ray.remote(sweep_node).options(name=f"remove {self.name}", num_cpus=0, max_retries=0,
                                               scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, False))
        try:
            ray.get(task.remote(None, self.name), timeout=timeout_s)
        except ray.exceptions.RayError:
            return False
        return True
