"""The multimodal slice end to end: tiny-vl -> LoRA merge -> GGUF + mmproj -> Q4_K_M -> llama-server --mmproj -> gate.

Real components only: transformers builds the tiny Qwen3.5 model, peft merges a LoRA through
``AutoModelForImageTextToText``, the sdist's converter writes the text GGUF and the projector, llama.cpp
quantizes, the ``llama-server`` built at set-up serves both on free loopback ports (stopped by PID), and the
gate sends a red square. The model is built and packaged once for the module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forgeflow.common.errors import GGUFError, InputError, SwapRolledBackError
from forgeflow.common.settings import cache_dir
from forgeflow.ledger.store import Store
from forgeflow.packaging import mmproj as projector
from forgeflow.packaging import vl_model
from forgeflow.packaging.checkpoint import BaseModelSource
from forgeflow.packaging.gguf import check_gguf, load_gguf, merge_adapter, quantize
from forgeflow.serving.backend import BackendConfig, LlamaServer
from forgeflow.serving.bluegreen import read_state, stop_active, swap
from forgeflow.serving.health import gate
from forgeflow.serving.llama_server import ensure_llama_server
from tests.helpers import free_port, pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]
_FIXTURES = cache_dir() / "test-fixtures"


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny-vl built, a random LoRA on its language model merged, converted, quantized; the projector checked."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("vl")
    base = vl_model.build_tiny_vl_model(_FIXTURES / "tiny-vl-seed0", seed=0)  # reused while its digest holds
    model = AutoModelForImageTextToText.from_pretrained(str(base.path), dtype=torch.float32)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(str(root / "adapter"))
    merged = merge_adapter(base.path, root / "adapter", root / "merged")
    f16 = projector.convert_text(merged, root / "model-f16.gguf")
    q4 = quantize(f16.path, root / "model-Q4_K_M.gguf", "Q4_K_M")
    mm = projector.convert_mmproj(merged, root / "mmproj-f16.gguf")
    return {"root": root, "base": base.path, "merged": merged, "q4": q4.path, "mmproj": mm.path,
            "vision_sha256": Path(base.vision_sha256)}


def test_tiny_vl_packages_into_a_text_gguf_and_a_projector_of_the_same_vision_tower(packaged: dict[str, Path]) -> None:
    assert BaseModelSource.model_validate("tiny-vl").kind == "tiny-vl"
    assert BaseModelSource.model_validate("tiny").kind == "tiny"
    merged = packaged["merged"]
    assert {"preprocessor_config.json", "chat_template.jinja"} <= {p.name for p in merged.iterdir()}
    # the LoRA changed the language model, not the frozen vision tower
    assert vl_model.vision_tower_sha256(merged) == str(packaged["vision_sha256"])
    text = check_gguf(packaged["q4"], merged)
    assert (text.architecture, text.file_type, text.block_count, text.embedding_length) == ("qwen35", "Q4_K_M", 2, 256)
    load_gguf(packaged["q4"])
    check = projector.check_mmproj(packaged["mmproj"], merged)
    assert (check.projector_type, check.block_count, check.projection_dim) == ("qwen3vl_merger", 1, 256)
    assert check.tensors_compared == 22 and check.vision_sha256 == str(packaged["vision_sha256"])
    # a projector checked against another vision tower (another seed) is refused tensor by tensor
    other = vl_model.build_tiny_vl_model(_FIXTURES / "tiny-vl-seed1", seed=1)
    with pytest.raises(GGUFError, match="differs from"):
        projector.check_mmproj(packaged["mmproj"], other.path)


def test_llama_server_with_the_projector_uses_the_image_and_without_it_fails_the_gate(
        packaged: dict[str, Path], tmp_path: Path) -> None:
    q4, mm = packaged["q4"], packaged["mmproj"]
    config = BackendConfig(kind="llama-server", model_alias="forgeflow", n_ctx=2048, mmproj=mm, image_min_tokens=16,
                           cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", binary=ensure_llama_server(),
                           n_threads=2)
    with LlamaServer(q4, free_port(), config, log_path=tmp_path / "vl.log") as server:
        argv = server.argv()
        for flag, value in (("--mmproj", str(mm)), ("--image-min-tokens", "16"), ("--cache-type-k", "q8_0"),
                            ("--cache-type-v", "q8_0"), ("--flash-attn", "on")):
            assert argv[argv.index(flag) + 1] == value
        assert server.props is not None and server.props.vision is True
        result = gate(server.base_url, "forgeflow", image=True)
        assert result.passed, result.error
        assert result.image is not None and result.image.image_tokens >= 16  # --image-min-tokens 16
        pid = server.pid
    assert not pid_alive(pid)
    text_only = config.model_copy(update={"mmproj": None, "image_min_tokens": None})
    with LlamaServer(q4, free_port(), text_only, log_path=tmp_path / "text.log") as server:
        assert gate(server.base_url, "forgeflow").passed  # text still answers
        result = gate(server.base_url, "forgeflow", image=True)
        assert not result.passed and "modalities.vision false" in result.error and "image smoke answered" in result.error
    # a projector that is not a vision projector (the text GGUF itself) is refused before any start
    with pytest.raises(InputError, match="not a vision projector"):
        LlamaServer(q4, free_port(), BackendConfig(kind="llama-server", model_alias="forgeflow", n_ctx=2048, mmproj=q4))


def test_swap_gates_with_an_image_and_rolls_back_a_server_that_dropped_its_projector(
        packaged: dict[str, Path], tmp_path: Path) -> None:
    q4, mm = packaged["q4"], packaged["mmproj"]
    state = tmp_path / "state.json"
    ports = (free_port(), free_port())
    backend = BackendConfig(kind="llama-server", ports=ports, n_ctx=2048, mmproj=mm, image_min_tokens=16,
                            n_threads=2, binary=ensure_llama_server())
    from forgeflow.common.fsutil import sha256_file

    sha = sha256_file(q4)
    try:
        first = swap(state, q4, sha, backend)
        assert not first.rolled_back and first.gate is not None and first.gate.image is not None
        assert first.gate.image.image_tokens >= 16
        # the same swap on a server that silently drops --mmproj (a wrapper around the real binary)
        wrapper = tmp_path / "llama-server"
        wrapper.write_text('#!/bin/bash\na=(); skip=0\nfor x in "$@"; do\n  if [ $skip = 1 ]; then skip=0; continue; fi\n'
                           '  if [ "$x" = --mmproj ]; then skip=1; continue; fi\n  a+=("$x")\ndone\n'
                           f'exec {ensure_llama_server()} "${{a[@]}}"\n')
        os.chmod(wrapper, 0o755)
        dropping = backend.model_copy(update={"binary": wrapper, "image_min_tokens": None})
        with pytest.raises(SwapRolledBackError, match="gate failed") as caught:
            swap(state, q4, sha, dropping)
        assert caught.value.result.gate is not None and not caught.value.result.gate.passed
        after = read_state(state)
        assert after is not None and after.generation == first.current.generation and pid_alive(after.pid)
    finally:
        stop_active(state)


def test_a_gguf_packaged_with_a_projector_is_refused_without_it_before_a_start(
        packaged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forgeflow.common import settings
    from forgeflow.common.fsutil import sha256_file, sha256_tree
    from forgeflow.packaging.gguf import GGUFArtifact
    from tasks.packaging import record_package
    from tasks.serving import check_projector_pairing

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    q4, mm, merged = packaged["q4"], packaged["mmproj"], packaged["merged"]
    artifacts = {"Q4_K_M": GGUFArtifact(path=q4, sha256=sha256_file(q4), size_bytes=q4.stat().st_size, type="Q4_K_M"),
                 "mmproj": GGUFArtifact(path=mm, sha256=sha256_file(mm), size_bytes=mm.stat().st_size, type="F16")}
    store = Store(settings.store_url())
    store.upgrade()
    try:
        record_package(store, artifacts, sha256_tree(merged), tmp_path, None, None, merged)
        mm_rows = store.producers(artifacts["mmproj"].sha256)
        q4_rows = store.producers(artifacts["Q4_K_M"].sha256)
    finally:
        store.dispose()
    assert mm_rows[0].lineage["vision_sha256"] == str(packaged["vision_sha256"])
    assert mm_rows[0].lineage["serves_with"] == {"Q4_K_M": artifacts["Q4_K_M"].sha256}
    assert q4_rows[0].lineage["mmproj_sha256"] == artifacts["mmproj"].sha256
    text_only = BackendConfig(kind="llama-server", ports=(free_port(), free_port()))
    with pytest.raises(InputError, match="packaged with a vision projector"):
        check_projector_pairing(q4, artifacts["Q4_K_M"].sha256, text_only)
    with_projector = text_only.model_copy(update={"mmproj": mm})
    check_projector_pairing(q4, artifacts["Q4_K_M"].sha256, with_projector)
    # a GGUF the store records as packaged text-only is refused where the block requires a projector
    text_gguf = tmp_path / "text-only.gguf"
    text_gguf.write_bytes(q4.read_bytes()[: 1 << 20])
    store = Store(settings.store_url())
    try:
        record_package(store, {"Q4_K_M": GGUFArtifact(path=text_gguf, sha256=sha256_file(text_gguf), size_bytes=1 << 20,
                                                       type="Q4_K_M")}, "b" * 64, tmp_path, None, None)
    finally:
        store.dispose()
    with pytest.raises(InputError, match="is a text-only GGUF"):
        check_projector_pairing(text_gguf, sha256_file(text_gguf), with_projector)
