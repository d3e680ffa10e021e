"""How a curate run validates (forgeflow.curation.curate_settings.CurateSettings): its defaults, the
bounds it refuses and what each validation of the run takes from it (the curate flow's parameter
shape built on it: tests/flows/test_curate.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.selection import DEFAULT_BATCH_SIZE
from forgeflow.sandbox.trial import ValidationChecks, ValidationSettings


def test_defaults_are_the_curate_flows_former_defaults() -> None:
    settings = CurateSettings()
    assert (settings.batch_size, settings.concurrency, settings.max_retries, settings.verifier_timeout_s,
            settings.validation().memory_mb, settings.seed, settings.checks) == (DEFAULT_BATCH_SIZE, 10, 2, 180.0,
                                                                                 2048, 0, ValidationChecks())
    assert settings.memory_mb is None  # none set: a sandbox block's, else 2048 (docs/verifier.md, "Sandbox limits")


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"concurrency": 0}, {"max_retries": -1},
                                 {"verifier_timeout_s": 0}, {"memory_mb": 8}, {"checks": {"oracle_runs": 0}},
                                 {"concurrency_limit": 3}])
def test_out_of_bounds_or_unknown_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        CurateSettings(**bad)


def test_settings_are_frozen_and_read_from_a_deployments_json() -> None:
    settings = CurateSettings.model_validate({"batch_size": 40, "concurrency": 10, "max_retries": 2,
                                              "verifier_timeout_s": 180.0, "seed": 0,
                                              "checks": {"oracle_runs": 3, "flaky_policy": "drop_flaky_pass_to_pass"}})
    assert settings.checks == ValidationChecks(oracle_runs=3, flaky_policy="drop_flaky_pass_to_pass")
    with pytest.raises(ValidationError):
        settings.seed = 1  # type: ignore[misc]


def test_each_validation_takes_the_timeout_memory_and_checks() -> None:
    checks = ValidationChecks(oracle_runs=3, log_parser="parse_log_django")
    settings = CurateSettings(verifier_timeout_s=90.5, memory_mb=512, checks=checks, seed=7, concurrency=3)
    assert settings.validation() == ValidationSettings(verifier_timeout_s=90.5, memory_mb=512, checks=checks)
    with pytest.raises(ValidationError):
        ValidationSettings(verifier_timeout_s=-1.0)

