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
