"""Tests for the model chain's core pieces: tokenizer vectors, tiny model, SFT data, presets.

Unmarked tests need nothing but Python; ``slow`` ones build the tokenizer (cached in
FORGEFLOW_CACHE after the first run), the tiny model, or train.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.packaging.base_model import (
    QWEN2_5_CHAT_TEMPLATE,
    TinyModelConfig,
    build_tiny_model,
    ensure_tokenizer,
    read_test_vectors,
    verify_tokenizer,
)
from forgeflow.packaging.gguf import QUANT_PRESETS, quantize
from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst
from forgeflow.training.health import BurstDivergedError


def _samples(n: int = 3) -> list[dict]:
    return [
        {
            "instance_id": f"proj__{i}",
            "source": "unit-test",
            "messages": [
                {"role": "user", "content": f"Fix the off-by-one in function {i}."},
                {"role": "assistant", "content": f"--- a/f.py\n+++ b/f.py\n-    n - {i}\n+    n"},
            ],
        }
        for i in range(n)
    ]


# --- pure ------------------------------------------------------------------------------------
def test_read_test_vectors_splits_like_llama_cpp(tmp_path: Path) -> None:
    gguf = tmp_path / "ggml-vocab-x.gguf"
    sep = "\n__ggml_vocab_test__\n"
    # Texts may be empty or contain newlines; the file ends with a separator.
    Path(f"{gguf}.inp").write_text("a b" + sep + "" + sep + "\n\n" + sep, encoding="utf-8")
    Path(f"{gguf}.out").write_text(" 1 2 3\n\n 198 198\n", encoding="utf-8")
    assert read_test_vectors(gguf) == [("a b", [1, 2, 3]), ("", []), ("\n\n", [198, 198])]


def test_read_test_vectors_rejects_count_mismatch(tmp_path: Path) -> None:
    gguf = tmp_path / "v.gguf"
    Path(f"{gguf}.inp").write_text("a\n__ggml_vocab_test__\n", encoding="utf-8")
    Path(f"{gguf}.out").write_text(" 1\n 2\n", encoding="utf-8")
    with pytest.raises(InputError, match="1 texts but .* 2 id lines"):
        read_test_vectors(gguf)


def test_chat_template_is_the_one_trl_recognises_as_qwen2_5() -> None:
    from trl.chat_template_utils import qwen2_5_chat_template

    # TRL swaps in its generation-tagged template (assistant-only loss) only on an exact match.
    assert QWEN2_5_CHAT_TEMPLATE == qwen2_5_chat_template


def test_tiny_model_rejects_heads_that_do_not_divide_hidden(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="hidden_size 256 is not divisible by num_attention_heads 3"):
        build_tiny_model(tmp_path / "m", config=TinyModelConfig(num_attention_heads=3))


def test_sft_dataset_digest_is_stable_and_order_sensitive() -> None:
    samples = _samples()
    a, b = build_sft_dataset(samples), build_sft_dataset([dict(s) for s in samples])
    assert a.sha256 == b.sha256
    assert build_sft_dataset(samples[::-1]).sha256 != a.sha256
    assert a.dataset.column_names == ["messages", "instance_id", "source"]
    assert a.dataset[0]["instance_id"] == "proj__0"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("instance_id"), r"samples\[1\]\.instance_id"),
        (
            lambda s: s["messages"].append({"role": "robot", "content": "x"}),
            r"samples\[1\]\.messages\[2\]\.role",
        ),
        (lambda s: s.update(messages=[{"role": "user", "content": "hi"}]), "no assistant turn"),
    ],
)
def test_sft_dataset_names_the_bad_sample(mutate, message: str) -> None:
    samples = _samples()
    mutate(samples[1])
    with pytest.raises(InputError, match=message):
        build_sft_dataset(samples)


def test_quantize_unknown_preset_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"'Q3_X'.*\['Q4_K_M', 'Q8_0'\]"):
        quantize(tmp_path / "in.gguf", tmp_path / "out.gguf", "Q3_X")
    assert QUANT_PRESETS == {"Q8_0": 7, "Q4_K_M": 15}


# --- slow ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_saved_tokenizer_matches_llama_cpp_vectors() -> None:
    tok_dir = ensure_tokenizer()
    check = verify_tokenizer(tok_dir)
    assert check.total == 46  # texts in the 0.3.36 sdist's ggml-vocab-qwen2.gguf.inp
    assert check.unexplained_failures == []
    assert check.matched == check.total - check.nfc_failures
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")


@pytest.mark.slow
def test_tiny_model_same_seed_same_digest(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", seed=0)
    second = build_tiny_model(tmp_path / "b", seed=0)
    other = build_tiny_model(tmp_path / "c", seed=1)
    assert first.sha256 == second.sha256
    assert other.sha256 != first.sha256
    assert first.num_parameters == 40_470_784  # 40.5 M, tied embeddings counted once (docs/architecture.md)
    config = json.loads((first.path / "config.json").read_text())
    assert (config["bos_token_id"], config["num_hidden_layers"], config["vocab_size"]) == (151643, 2, 151936)
    weights = first.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a", seed=0) == first  # reused, not rebuilt
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_burst_on_a_nan_weight_raises_with_the_losses(tmp_path: Path) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "base", seed=0)
    broken = tmp_path / "broken"
    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # as an overflowed checkpoint would carry
    model.save_pretrained(str(broken))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base.path / name, broken / name)
    with pytest.raises(BurstDivergedError, match=r"not finite \(step, loss\): \[\(1, nan\)"):
        run_sft_burst(broken, build_sft_dataset(_samples()), tmp_path / "adapter", BurstConfig())
    assert not (tmp_path / "adapter").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".adapter")] == []


@pytest.mark.slow
def test_sdist_holds_the_vocab_and_converter_once_extracted() -> None:
    from forgeflow.common import settings
    from forgeflow.common.fsutil import sha256_file
    from forgeflow.packaging.sdist import (
        convert_script_path,
        ensure_llama_sdist,
        vocab_gguf_path,
    )

    root = ensure_llama_sdist()
    assert root.name == f"llama-cpp-python-{settings.LLAMA_CPP_PYTHON_VERSION}"
    assert vocab_gguf_path().read_bytes()[:4] == b"GGUF"
    assert (convert_script_path().parent / "gguf-py" / "gguf" / "__init__.py").is_file()
    assert (convert_script_path().parent / "conversion" / "qwen.py").is_file()
    marker = json.loads((root / "forgeflow-sdist.json").read_text())
    tarball = settings.cache_dir() / "sdist" / marker["sdist"]
    assert marker["sdist_sha256"] == sha256_file(tarball)
    assert ensure_llama_sdist() == root  # second call: no download, same folder


@pytest.mark.slow
def test_saved_tokenizer_agrees_with_llama_cpp_except_nfc() -> None:
    import llama_cpp
    from transformers import AutoTokenizer

    from forgeflow.packaging.sdist import vocab_gguf_path

    hf = AutoTokenizer.from_pretrained(str(ensure_tokenizer()))
    llm = llama_cpp.Llama(model_path=str(vocab_gguf_path()), vocab_only=True, verbose=False)
    try:
        def ll(text: str) -> list[int]:
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

        for text in ["def f(x):\n    return x + 1\n", "diff --git a/b.py b/b.py\n@@ -1 +1 @@", "  ÄÖ 123 🦙"]:
            assert hf.encode(text, add_special_tokens=False) == ll(text), text
        # Known, documented difference: transformers' reloaded Qwen2 tokenizer applies NFC.
        decomposed, composed = "cafe\u0301", "caf\u00e9"
        assert hf.encode(decomposed, add_special_tokens=False) == hf.encode(
            composed, add_special_tokens=False
        )
        assert ll(decomposed) != ll(composed)
    finally:
        llm.close()


@pytest.mark.slow
def test_burst_refuses_samples_that_truncation_would_strip_of_their_target(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", seed=0)
    data = build_sft_dataset(_samples(2))
    with pytest.raises(InputError, match=r"2 of 2 SFT samples exceed max_length=16 tokens.*proj__0 \(\d+ tokens\)"):
        run_sft_burst(base.path, data, tmp_path / "adapter", BurstConfig(max_length=16))
    assert not (tmp_path / "adapter").exists()
    # seven samples: five named, the rest counted, and the max_length that would take them all
    with pytest.raises(InputError) as refused:
        run_sft_burst(base.path, build_sft_dataset(_samples(7)), tmp_path / "adapter", BurstConfig(max_length=16))
    named = re.findall(r"\((\d+) tokens\)", str(refused.value))
    longest = int(re.search(r"the longest has (\d+) tokens: give max_length at least that", str(refused.value))[1])
    assert len(named) == 5 and str(refused.value).endswith(" and 2 more") and longest >= max(map(int, named))
