"""``forgeflow demo --base-model tiny-vl``: the second demo profile builds the multimodal lifecycle config
(the tiny VL base, a llama-server serving block it saves) and the text demo stays the default.

The lifecycle is replaced by one that records its config and stops (a full tiny-vl run is the demo
itself, measured by hand); the block is really saved on the test harness's Prefect API and read back
as the lifecycle's preflight reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app


def test_tiny_vl_profile_builds_a_llama_server_config_the_lifecycle_accepts(
        prefect_harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.lifecycle
    from flows.stages import with_projector
    from forgeflow.common.errors import SandboxError
    from forgeflow.config import DEMO_VL_SERVING_BLOCK, LifecycleConfig
    from tasks.serving import serving_backend

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("FORGEFLOW_STORE_URL", raising=False)
    seen: list[LifecycleConfig] = []

    def recording(config: LifecycleConfig) -> None:
        seen.append(config)
        raise SandboxError("stopped after the config was seen")

    monkeypatch.setattr(flows.lifecycle, "lifecycle", recording)
    runner = CliRunner()
    refused = runner.invoke(app, ["demo", "--base-model", "tiny-xl"])
    said = " ".join(refused.output.replace("│", " ").split())
    assert refused.exit_code == 2 and "unknown demo profile 'tiny-xl'; known: tiny, tiny-vl" in said, said
    assert not seen and not (tmp_path / "demo-tiny-xl").exists()

    for argv in (["demo", "--base-model", "tiny-vl", "--keep-serving"], ["demo"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 1 and "stopped after the config was seen" in result.output, result.output
    vl, text = seen
    assert vl.base_model.kind == "tiny-vl" and vl.serving.block == DEMO_VL_SERVING_BLOCK
    assert vl.serving.keep_running is True and vl.output_dir == tmp_path / "demo-tiny-vl"
    assert text.base_model.kind == "tiny" and text.serving.block is None and text.output_dir == tmp_path / "demo"
    same = {"base_model", "serving", "output_dir"}
    assert vl.model_dump(exclude=same) == text.model_dump(exclude=same) == LifecycleConfig().model_dump(exclude=same)
    # the saved block as the lifecycle's preflight loads it: llama-server with the seeds' options on the
    # config's ports, and it takes the package's projector (a text backend is refused there)
    backend = serving_backend.fn(vl.serving.block, vl.serving.ports, started_only=True)
    assert (backend.kind, backend.ports, backend.n_ctx) == ("llama-server", vl.serving.ports, 4096)
    assert (backend.cache_type_k, backend.cache_type_v, backend.flash_attn) == ("q8_0", "q8_0", "on")
    projector = tmp_path / "mmproj-f16.gguf"
    assert with_projector(backend, projector).mmproj == projector
