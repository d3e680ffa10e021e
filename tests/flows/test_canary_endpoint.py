"""Which served model a canary runs against (``tasks.evaluation.resolve_endpoint``): the serving state file's
active server, or ``base_url`` + ``model_sha256`` checked against the state file when it records a live
server at that URL. A server staged on the idle port (the lifecycle's candidate) is not the recorded one and is
taken with the sha256 given; a model other than the one the state records serving at the URL is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import atomic_write_json
from forgeflow.evaluation.canary_params import CanaryEndpoint
from forgeflow.serving.bluegreen import ServingState
from tasks.evaluation import resolve_endpoint

ACTIVE, STAGED = "http://127.0.0.1:8801/v1", "http://127.0.0.1:8802/v1"
SERVED, CANDIDATE = "a" * 64, "b" * 64


def _state(path: Path, pid: int | None = 4242) -> Path:
    """A serving state at ``path``: generation 3 serving ``SERVED`` at ``ACTIVE`` (stopped when ``pid`` is None)."""
    atomic_write_json(path, ServingState(generation=3, active_port=8801, gguf_path=Path("/models/base.gguf"),
                                         gguf_sha256=SERVED, pid=pid, model_alias="coder",
                                         base_url=ACTIVE).model_dump(mode="json"))
    return path


def test_base_url_and_model_sha256_are_checked_against_the_state_that_records_the_url(tmp_path: Path) -> None:
    state = _state(tmp_path / "state.json")
    # the state's own endpoint: the state's active server, or the same URL and model given explicitly
    assert resolve_endpoint(CanaryEndpoint(state_path=state)) == (ACTIVE, SERVED, "coder")
    assert resolve_endpoint(CanaryEndpoint(state_path=state, base_url=ACTIVE + "/", model_sha256=SERVED,
                                           model_alias="forgeflow")) == (ACTIVE, SERVED, "forgeflow")
    # another model at the URL the state records serving: refused, both models and the file named
    with pytest.raises(InputError, match=rf"model_sha256 {CANDIDATE} differs from the GGUF {SERVED} "
                                         rf"\(/models/base.gguf\) that {state} records serving at {ACTIVE} "
                                         r"\(generation 3\)"):
        resolve_endpoint(CanaryEndpoint(state_path=state, base_url=ACTIVE, model_sha256=CANDIDATE))
    # the candidate staged on the idle port: not the recorded endpoint, taken with the sha256 given
    assert resolve_endpoint(CanaryEndpoint(state_path=state, base_url=STAGED, model_sha256=CANDIDATE)) == (
        STAGED, CANDIDATE, "forgeflow")
    # the state's own check: a model_sha256 other than the active one's
    with pytest.raises(InputError, match=f"model_sha256 {CANDIDATE} differs from the served GGUF {SERVED}"):
        resolve_endpoint(CanaryEndpoint(state_path=state, model_sha256=CANDIDATE))
    with pytest.raises(InputError, match="needs params.endpoint.model_sha256"):
        resolve_endpoint(CanaryEndpoint(state_path=state, base_url=STAGED))


def test_without_state_path_the_default_state_file_is_the_one_checked(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    # no state file: nothing recorded, the endpoint taken as given (a server of no state file)
    assert resolve_endpoint(CanaryEndpoint(base_url=ACTIVE, model_sha256=CANDIDATE)) == (ACTIVE, CANDIDATE, "forgeflow")
    default = _state(tmp_path / "home" / "serving" / "state.json")
    with pytest.raises(InputError, match=f"differs from the GGUF {SERVED} .* that {default} records serving"):
        resolve_endpoint(CanaryEndpoint(base_url=ACTIVE, model_sha256=CANDIDATE))
    # a stopped generation serves nothing: its URL is no longer a claim about the model there
    _state(default, pid=None)
    assert resolve_endpoint(CanaryEndpoint(base_url=ACTIVE, model_sha256=CANDIDATE)) == (ACTIVE, CANDIDATE, "forgeflow")
    with pytest.raises(PreflightError, match="is stopped"):
        resolve_endpoint(CanaryEndpoint())
    # a state file that cannot be read is refused, not skipped
    default.write_text("{not json")
    with pytest.raises(InputError, match="is not valid"):
        resolve_endpoint(CanaryEndpoint(base_url=STAGED, model_sha256=CANDIDATE))
