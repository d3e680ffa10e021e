"""A multimodal model's projector through the stages a user reaches: ``forgeflow lineage`` shows it under its
GGUF, and the lifecycle's serve stages serve a package's GGUF with that package's ``mmproj`` artifact.

No Prefect server and no model: the store is filled by the test (as the package stage records a multimodal
package, ``tasks.packaging.record_package``), and the serve wiring is checked on the backend it hands over."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.common.errors import InputError
from forgeflow.ledger.records import ModelArtifactRecord
from forgeflow.ledger.store import Store
from forgeflow.packaging.gguf import GGUFArtifact
from forgeflow.serving.backend import BackendConfig


def test_lineage_shows_the_projector_under_its_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("FORGEFLOW_STORE_URL", raising=False)
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    base, projector, text = "a" * 64, "e" * 64, "c" * 64
    store.record_model_artifact(ModelArtifactRecord(sha256=base, kind="base", path="/m/base-vl"))
    store.record_model_artifact(ModelArtifactRecord(sha256=projector, kind="gguf", path="/m/mmproj-f16.gguf",
                                                    quantization="mmproj", parent_sha256=base,
                                                    lineage={"role": "mmproj", "serves_with": {"Q4_K_M": text}}))
    store.record_model_artifact(ModelArtifactRecord(sha256=text, kind="gguf", path="/m/q4.gguf",
                                                    quantization="Q4_K_M", parent_sha256=base,
                                                    lineage={"mmproj_sha256": projector,
                                                             "mmproj_path": "/m/mmproj-f16.gguf"}))
    result = CliRunner().invoke(app, ["lineage", text[:12], "--no-verify"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("gguf"))
    assert lines[at + 1].split() == ["projector", projector[:16], "/m/mmproj-f16.gguf"], result.output
    plain = CliRunner().invoke(app, ["lineage", base[:12], "--no-verify"])  # the base: no projector line
    assert plain.exit_code == 0 and "projector" not in plain.output


class _Captured(Exception):
    """Raised by the stand-ins once they hold what the stage handed over (nothing is served)."""


class _Log:
    """A StageLog stand-in: stages open and close; ``call`` keeps its arguments and stops the stage."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @contextmanager
    def stage(self, name: str):
        yield {}

    def call(self, fn, *args):
        self.calls.append((fn.__name__, args))
        raise _Captured


def test_serve_stages_serve_a_package_with_its_own_projector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows import lifecycle
    from flows.lifecycle import _projector
    from flows.stages import PublishParams, ServeParams, with_projector

    def artifact(name: str) -> GGUFArtifact:
        return GGUFArtifact(path=tmp_path / name, type="Q8_0", sha256="f" * 64, size_bytes=1)

    server = BackendConfig(kind="llama-server", image_min_tokens=None)
    package = {"Q8_0": artifact("q8.gguf"), "mmproj": artifact("mmproj-f16.gguf")}
    assert _projector(package) == tmp_path / "mmproj-f16.gguf"
    assert _projector({"Q8_0": package["Q8_0"]}) is None  # a text-only package
    served = with_projector(server, _projector(package))
    assert served.mmproj == tmp_path / "mmproj-f16.gguf" and served.kind == "llama-server"
    assert f"--mmproj {tmp_path / 'mmproj-f16.gguf'}" in served.describe()
    assert with_projector(server, None) is server
    with pytest.raises(InputError, match="kind 'llama-server'"):  # llama-cpp-python takes no projector
        with_projector(BackendConfig(), _projector(package))
    # the lifecycle's stages: the candidate staged with the candidate package's projector, the baseline
    # served (the serve flow) with the base package's
    run = SimpleNamespace(log=_Log(), state_path=tmp_path / "state.json", serving=server,
                          config=SimpleNamespace(serving=SimpleNamespace(ports=(8801, 8802), block="vl")))
    with pytest.raises(_Captured):
        lifecycle._stage_and_promote(run, package["Q8_0"], "baseline-job", _projector(package))
    (name, args), = run.log.calls
    assert name == "stage_server" and args[-1].mmproj == tmp_path / "mmproj-f16.gguf"
    served_with: list = []
    monkeypatch.setattr(lifecycle, "serve_flow", lambda params: served_with.append(params) or _raise())
    with pytest.raises(_Captured):
        lifecycle._serve_baseline(run, package["Q8_0"], tmp_path, _projector(package))
    assert served_with[0].mmproj_path == tmp_path / "mmproj-f16.gguf" and served_with[0].block == "vl"
    # the serve and publish flows take the projector as a parameter a user can give
    assert ServeParams(gguf_path=tmp_path / "q8.gguf", mmproj_path=tmp_path / "p.gguf").mmproj_path.name == "p.gguf"
    assert PublishParams(gguf_path=tmp_path / "q8.gguf", hf_dir=tmp_path,
                         mmproj_path=tmp_path / "p.gguf").mmproj_path.name == "p.gguf"


def _raise() -> None:
    raise _Captured
