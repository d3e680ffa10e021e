"""The container of an agentic RL episode: a fresh sandbox of the task image with mini-swe-agent's command
environment, as the canary agent's (:mod:`forgeflow.training.episodes_run` starts it here,
:mod:`forgeflow.training.episodes_ray` on a Ray sandbox node)."""

from __future__ import annotations

from forgeflow.evaluation.mswea import prepare_mswea_env
from forgeflow.evaluation.sandbox_env import SandboxEnvironment, environment_config
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.training.episodes import EpisodeSettings

MSWEA_CONFIG = "swebench_backticks.yaml"
"""mini-swe-agent's config whose ``environment`` section (``env``, ``interpreter``) the episode's commands get,
as the canary agent's do."""


def start_episode_env(task: TaskTests, settings: EpisodeSettings, backend: str | SandboxTarget,
                      name: str) -> SandboxEnvironment:
    """Start the episode's container ``name`` of ``task.image_ref`` on ``backend`` with mini-swe-agent's command
    environment (as the canary agent's; ``settings``' memory MiB, CPUs, command timeout seconds).

    Raises:
        SandboxError / InfraError: the container did not start, or its ``/testbed`` is no git work tree (the
            container is removed first).
    """
    prepare_mswea_env()
    from minisweagent.config import get_config_from_spec

    section = {**get_config_from_spec(MSWEA_CONFIG)["environment"], "timeout": settings.command_timeout_s}
    config = environment_config(section, image=task.image_ref, backend=backend, name=name,
                                memory_mb=settings.memory_mb, cpus=settings.cpus)
    env = SandboxEnvironment.start(backend, config)
    try:
        env.git("rev-parse", "HEAD")  # the task's repository is a git work tree: fails before any turn
    except BaseException:
        env.stop()
        raise
    return env
