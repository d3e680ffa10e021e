"""The canary flows' parameter groups (forgeflow.evaluation.canary_params): defaults, bounds, JSON in."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings


def test_defaults_are_the_flows_former_defaults():
    assert CanaryEndpoint().model_dump() == {"state_path": None, "base_url": None, "model_sha256": None,
                                             "model_alias": None, "api_key_secret": None}
    run = CanaryRunSettings()
    assert (run.concurrency, run.profile, run.verifier_timeout_s, run.sample, run.sample_seed) == \
        (1, "default", 180.0, None, 0)
    assert run.agent_config == AgentConfig()


def test_groups_read_the_json_a_deployment_or_the_ui_gives():
    endpoint = CanaryEndpoint.model_validate({"state_path": "/srv/state.json", "model_alias": "m"})
    assert endpoint.state_path == Path("/srv/state.json") and endpoint.model_alias == "m"
    run = CanaryRunSettings.model_validate({"concurrency": 2, "profile": "verified", "sample": 3, "sample_seed": 7,
                                            "agent_config": {"step_limit": 5, "agent_timeout_s": 120}})
    assert run.agent_config.step_limit == 5 and run.agent_config.agent_timeout_s == 120.0
    assert (run.concurrency, run.sample, run.sample_seed) == (2, 3, 7)


@pytest.mark.parametrize("bad", [{"concurrency": 0}, {"verifier_timeout_s": 0}, {"sample": 0}, {"sample_seed": -1},
                                 {"concurrency": 2, "concurency": 3}, {"agent_config": {"step_limit": 0}}])
def test_run_settings_refuse_values_out_of_bounds_and_unknown_fields(bad):
    with pytest.raises(ValidationError):
        CanaryRunSettings.model_validate(bad)


@pytest.mark.parametrize("bad", [{"model_sha256": "D" * 64}, {"model_sha256": "d" * 63}, {"base_url": ""},
                                 {"url": "http://127.0.0.1:8801/v1"}])
def test_endpoint_refuses_a_malformed_digest_an_empty_url_and_unknown_fields(bad):
    with pytest.raises(ValidationError):
        CanaryEndpoint.model_validate(bad)


def test_groups_are_frozen():
    with pytest.raises(ValidationError):
        CanaryRunSettings().concurrency = 2  # type: ignore[misc]
    with pytest.raises(ValidationError):
        CanaryEndpoint().base_url = "http://x/v1"  # type: ignore[misc]
