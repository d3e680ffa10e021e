"""The model chain end to end with the real tools: tiny model -> SFT bursts (TRL + peft) ->
merge (peft) -> convert (llama.cpp's convert_hf_to_gguf.py) -> quantize (llama_cpp) ->
metadata check (gguf-py) -> load (llama_cpp.Llama). About a minute on 2 CPU cores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import GGUFError
from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.packaging.gguf import (
    check_gguf,
    convert_to_gguf,
    load_gguf,
    merge_adapter,
    quantize,
)
from forgeflow.training.adapters import LINEAGE_FILE, adapter_sha256
from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst

pytestmark = pytest.mark.slow

SAMPLES = [
    {
        "instance_id": f"toolz__{i}",
        "source": "unit-test",
        "messages": [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": f"Tests fail in module {i}."},
            {
                "role": "assistant",
                "content": f"--- a/m{i}.py\n+++ b/m{i}.py\n-    return x\n+    return x + 1",
            },
        ],
    }
    for i in range(3)
]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Base model, two chained bursts, merged checkpoint and an f16 GGUF, built once."""
    root = tmp_path_factory.mktemp("chain")
    base = build_tiny_model(root / "base", seed=0)
    data = build_sft_dataset(SAMPLES)
    config = BurstConfig(max_steps=2)
    first = run_sft_burst(base.path, data, root / "adapter-1", config, run_id="run-1")
    second = run_sft_burst(
        base.path, data, root / "adapter-2", config, parent_adapter_dir=first.path, run_id="run-2"
    )
    merged = merge_adapter(base.path, second.path, root / "merged")
    f16 = convert_to_gguf(merged, root / "model-f16.gguf", outtype="f16")
    return {"root": root, "base": base, "data": data, "first": first, "second": second,
            "merged": merged, "f16": f16}


def test_burst_writes_adapter_and_lineage(chain: dict) -> None:
    first = chain["first"]
    assert (first.path / "adapter_model.safetensors").is_file()
    lineage = json.loads((first.path / LINEAGE_FILE).read_text())
    assert lineage["sha256"] == first.sha256 == adapter_sha256(first.path)
    assert lineage["lineage"]["base_model_sha256"] == chain["base"].sha256
    assert lineage["lineage"]["dataset_sha256"] == chain["data"].sha256
    assert lineage["lineage"]["parent_adapter_sha256"] is None
    assert lineage["lineage"]["run_id"] == "run-1"
    assert first.steps == 2 and 0 < first.final_loss < 20  # ln(151936) = 11.9 for a random model


def test_continued_burst_records_parent_and_changes_weights(chain: dict) -> None:
    first, second = chain["first"], chain["second"]
    assert second.lineage.parent_adapter_sha256 == first.sha256
    assert json.loads((second.path / LINEAGE_FILE).read_text())["lineage"][
        "parent_adapter_sha256"
    ] == first.sha256
    assert second.sha256 != first.sha256


def test_rerun_of_a_finished_burst_reuses_it(chain: dict) -> None:
    first = chain["first"]
    again = run_sft_burst(
        chain["base"].path, chain["data"], first.path, BurstConfig(max_steps=2), run_id="other"
    )
    assert again == first  # same inputs: not retrained, lineage (run id, time) unchanged


def test_merge_folds_the_adapter_into_attention_only(chain: dict) -> None:
    from safetensors.torch import load_file

    base = load_file(str(chain["base"].path / "model.safetensors"))
    merged = load_file(str(chain["merged"] / "model.safetensors"))
    assert set(merged) == set(base)  # plain Qwen2 tensors, no lora_A/lora_B left
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not base[q_proj].equal(merged[q_proj])
    assert base["model.embed_tokens.weight"].equal(merged["model.embed_tokens.weight"])
    assert base["model.layers.0.mlp.up_proj.weight"].equal(merged["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_gguf_checks_and_loads(chain: dict, qtype: str) -> None:
    f16 = chain["f16"]
    q = quantize(f16.path, chain["root"] / f"model-{qtype}.gguf", qtype)
    assert q.type == qtype and 0 < q.size_bytes < f16.size_bytes
    check = check_gguf(q.path, chain["merged"])
    assert (check.architecture, check.block_count, check.vocab_size) == ("qwen2", 2, 151936)
    assert (check.head_count, check.head_count_kv, check.file_type) == (4, 2, qtype)
    load_gguf(q.path)


def test_f16_gguf_checks_and_loads(chain: dict) -> None:
    check = check_gguf(chain["f16"].path, chain["merged"])
    assert check.file_type == "F16" and check.context_length == 32768
    load_gguf(chain["f16"].path)


def test_truncated_gguf_raises_naming_the_path(chain: dict, tmp_path: Path) -> None:
    data = chain["f16"].path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated.gguf"):
        load_gguf(truncated)
    with pytest.raises(GGUFError, match="truncated.gguf"):
        check_gguf(truncated, chain["merged"])


def test_gguf_against_config_with_other_layer_count_names_block_count(
    chain: dict, tmp_path: Path
) -> None:
    other = tmp_path / "hf"
    shutil.copytree(chain["merged"], other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFError, match=r"'qwen2.block_count' expected 3 .* found 2"):
        check_gguf(chain["f16"].path, other)
