"""The cache key of the validation task (tasks.curation.validate_candidate), computed with its own
cache policy and no Prefect run: every input that changes a validation's result keys it (the image's
digest, the test command, the run key, the verifier's limit, the memory, the checks, the sandbox
block); where its trials are recorded (``sink``) and on which Ray node it runs (``ray``) do not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.trial import ValidationChecks, ValidationSettings
from tasks.curation import SandboxChoice, TrialSink, validate_candidate


class Bug:
    instance_id = "pkg.bug-1"
    patch = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"

    def __repr__(self) -> str:
        return f"Bug({self.instance_id})"


BASE = {"candidate": Bug(), "image_ref": "localhost/task:1", "image_digest": "a" * 64, "test_command": "pytest",
        "settings": ValidationSettings(verifier_timeout_s=120.0, memory_mb=1024), "run_key": "curate-a0",
        "sink": None, "sandbox": None, "ray": None}


def _key(**changes: object) -> str:
    inputs = {**BASE, **changes}
    return validate_candidate.cache_policy.compute_key(SimpleNamespace(task=validate_candidate), inputs, {})


@pytest.mark.parametrize("change", [
    {"image_digest": "b" * 64},
    {"test_command": "pytest -x"},
    {"run_key": "curate-a1"},
    {"settings": ValidationSettings(verifier_timeout_s=121.0, memory_mb=1024)},
    {"settings": ValidationSettings(verifier_timeout_s=120.0, memory_mb=2048)},
    {"settings": ValidationSettings(verifier_timeout_s=120.0, memory_mb=1024,
                                    checks=ValidationChecks(oracle_runs=3))},
    {"settings": ValidationSettings(verifier_timeout_s=120.0, memory_mb=1024,
                                    checks=ValidationChecks(log_parser="parse_log_django"))},
    {"sandbox": SandboxChoice(block="k8s", kind="kubernetes", memory_mb=1024, cpus=1.0)},
])
def test_an_input_that_changes_the_result_changes_the_key(change: dict) -> None:
    assert _key() is not None and _key(**change) != _key()


def test_where_trials_are_recorded_or_run_does_not_change_the_key() -> None:
    assert _key(sink=TrialSink(store_url="sqlite:///other.db", job_id="curate", batch_id="b", run_id="r")) == _key()
    assert _key(ray=RayPlacement(address="10.0.0.1:6379")) == _key()
    assert _key(settings=ValidationSettings(verifier_timeout_s=120.0, memory_mb=1024)) == _key()  # equal values
