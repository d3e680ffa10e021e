"""Mixed per-tensor quantization (llama.cpp tt_overrides) and metadata edits on the real tiny
Qwen2 GGUF (built once per machine under cache_dir(), as in test_serving.py); then the synthetic
benchmark at a small size."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.common.settings import cache_dir
from forgeflow.packaging.gguf import (
    MIXED_ATTN_EMBD_OUTPUT_Q8_0,
    load_gguf,
    quantize,
)
from forgeflow.packaging.gguf_metadata import MetadataEdit, apply_metadata_edits
from forgeflow.packaging.gguf_reader import read_metadata, tensor_sha256
from tests.helpers import tensor_types_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def f16() -> Path:
    from forgeflow.packaging.base_model import build_tiny_model
    from forgeflow.packaging.gguf import convert_to_gguf

    root = cache_dir() / "test-fixtures" / "tiny-seed0"
    path = root / "tiny-f16.gguf"
    if not path.is_file():
        record = build_tiny_model(root / "hf", seed=0)
        convert_to_gguf(record.path, path, outtype="f16")
    return path


@pytest.fixture(scope="module")
def mixed(f16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    artifact = quantize(f16, out, "Q4_K_M", tensor_types=MIXED_ATTN_EMBD_OUTPUT_Q8_0)
    assert artifact.type == "Q4_K_M+mixed" and artifact.tensor_types == MIXED_ATTN_EMBD_OUTPUT_Q8_0
    return artifact.path


def test_mixed_quantization_gives_each_tensor_its_override(mixed: Path, f16: Path) -> None:
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(mixed)).tensors}
    assert types == tensor_types_of(mixed)
    attn = [n for n in types if re.search(r"attn_(q|k|v|output)\.weight$", n)]
    assert len(attn) == 8 and all(types[n] == "Q8_0" for n in attn)
    assert types["token_embd.weight"] == "Q8_0"
    ffn = [n for n in types if re.search(r"ffn_(up|gate|down)\.weight$", n)]
    assert len(ffn) == 6 and {types[n] for n in ffn} <= {"Q4_K", "Q6_K"}  # Q4_K_M's own mixture
    assert "Q4_K" in {types[n] for n in ffn}
    assert all(types[n] == "F32" for n in types if n.endswith("_norm.weight"))
    assert mixed.stat().st_size < f16.stat().st_size
    load_gguf(mixed)


def test_uniform_q4_k_m_differs_from_mixed(mixed: Path, f16: Path, tmp_path: Path) -> None:
    uniform = quantize(f16, tmp_path / "q4.gguf", "Q4_K_M")
    types = tensor_types_of(uniform.path)
    assert types["blk.0.attn_q.weight"] != "Q8_0"  # the override is what made it Q8_0
    assert uniform.size_bytes < mixed.stat().st_size


def test_override_errors_are_explicit(f16: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="'Q9_X' is not a ggml type"):
        quantize(f16, tmp_path / "x.gguf", "Q4_K_M", tensor_types={"attn_q": "Q9_X"})
    with pytest.raises(InputError, match="not a regex"):
        quantize(f16, tmp_path / "x.gguf", "Q4_K_M", tensor_types={"attn_(q": "Q8_0"})
    with pytest.raises(GGUFError, match=r"\['no_such_tensor'\] matched no quantizable tensor"):
        quantize(f16, tmp_path / "x.gguf", "Q4_K_M", tensor_types={"no_such_tensor": "Q8_0"})
    assert not (tmp_path / "x.gguf").exists()


def test_metadata_edits_on_the_real_model_keep_it_loadable(mixed: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(mixed, path)
    before = tensor_sha256(path)
    same = apply_metadata_edits(path, [MetadataEdit(op="set", key="qwen2.context_length", value=4096)])
    assert same.old_values[same.edits[0].key] == 32768 and same.data_offset_after == same.data_offset_before
    grown = apply_metadata_edits(
        path, [MetadataEdit(op="set", key="general.name", value="forgeflow tiny qwen2 " * 200)])
    assert grown.data_offset_after > grown.data_offset_before and grown.tensors_verified == 26
    assert read_metadata(path, "qwen2.context_length") == 4096
    assert tensor_sha256(path) == before
    template = read_metadata(path, "tokenizer.chat_template")
    assert "im_start" in template  # the 151,936-token tokenizer survived the rewrite
    load_gguf(path)


def test_benchmark_prints_json_last_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gguf_edit", "--size-gb", "0.1"],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.09 <= summary["file_gb"] <= 0.11
    assert 0 < summary["peak_rss_mb"] <= 256
    assert summary["time_vs_cp"] > 0 and summary["time_vs_cp_unverified"] > 0
    assert summary["time_vs_bare_cp"] > 0 and summary["time_vs_cp_full_verify"] > 0
