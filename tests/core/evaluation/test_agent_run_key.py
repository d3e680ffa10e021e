"""An agent trial's run key (its trial id) names what changes the result, not where the verifier runs:
the same trial on a Ray cluster is the same trial, and its recorded trials keep their ids (the
Prefect cache ignores the placement too: tests/flows/test_agent_trial_task.py)."""

from forgeflow.evaluation.agent import AgentConfig, default_run_key
from forgeflow.sandbox.dispatch import RayPlacement


def test_the_verifier_placement_is_not_in_the_run_key_but_the_agent_settings_are() -> None:
    here = AgentConfig()
    on_ray = AgentConfig(verifier_ray=RayPlacement(address="10.0.0.1:6379"))
    key = default_run_key("fix add", "forgeflow", "http://127.0.0.1:8801/v1", here)
    assert default_run_key("fix add", "forgeflow", "http://127.0.0.1:8801/v1", on_ray) == key
    assert default_run_key("fix add", "forgeflow", "http://127.0.0.1:8801/v1", AgentConfig(step_limit=9)) != key


def test_an_agent_on_podman_keeps_the_run_key_it_had_before_sandbox_backend_existed() -> None:
    """``sandbox_backend`` (where the agent's container runs) is left out of the key when it is
    ``podman``, the default and where every agent ran before the field existed: those trials keep
    their ids. Any other backend is part of the key. The pinned digest is the key of ``AgentConfig()``
    computed by the code before the field was added (commit ed5987f)."""
    from forgeflow.sandbox.backends import SandboxTarget

    args = ("fix add", "forgeflow", "http://x/v1")
    key = default_run_key(*args, AgentConfig())
    assert key == "ad269e110c5854ec9c5bd66bdd34ed180dac9faf144dee2e6ebf09fa0a7676ac"
    assert default_run_key(*args, AgentConfig(sandbox_backend="podman")) == key
    on_cluster = default_run_key(*args, AgentConfig(sandbox_backend="kubernetes"))
    assert on_cluster != key
    assert default_run_key(*args, AgentConfig(sandbox_backend=SandboxTarget(kind="kubernetes"))) not in (key, on_cluster)
    # a job's recorded agent_config from before the field reads as podman
    recorded = AgentConfig().model_dump(mode="json")
    recorded.pop("sandbox_backend")
    assert AgentConfig.model_validate(recorded).sandbox_backend == "podman"
