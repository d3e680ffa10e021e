"""The tiny Qwen3.5-shaped multimodal model (``base_model: tiny-vl``): a language model with a vision tower.

transformers 5.23's ``Qwen3_5ForConditionalGeneration``, random seeded weights: two text layers (one
Gated DeltaNet, one full attention) and a one-layer vision tower. The real Qwen2 vocabulary, with
reserved ids 151646-151656 named as Qwen2-VL/Qwen2.5 name them (``<|vision_start|>`` 151652, ...), as
the chat template, the HF processor and llama.cpp's ``mtmd`` need. The chat template is set
explicitly (a newer ``AutoProcessor`` no longer inherits it from the tokenizer).

Known difference (measured): transformers 5.23 loads ``Qwen3_5Tokenizer`` for ``qwen3_5``, whose
pre-tokenizer keeps combining marks with letters, while the converter labels the GGUF's pre-tokenizer
``qwen2``. The sdist's 46 Qwen2 test vectors tokenize identically; text with combining marks may not.
"""

from __future__ import annotations

import json
from pathlib import Path

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_folder, atomic_write_json, sha256_tree
from forgeflow.packaging import base_model as text_model

VISION_TOKENS: dict[int, str] = {
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>", 151652: "<|vision_start|>",
    151653: "<|vision_end|>", 151654: "<|vision_pad|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>",
}
"""Qwen2-VL / Qwen2.5's special tokens at the ids the sdist's Qwen2 vocabulary leaves as ``[PAD<id>]``
(``added_tokens`` of Qwen/Qwen2.5-VL-7B-Instruct's ``tokenizer.json``)."""
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656

VL_CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part['type'] == 'video' or 'video' in part %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""The Qwen2-VL chat template's structure (Qwen/Qwen2-VL-7B-Instruct ``chat_template.json``): string or
typed content; an image part becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor
expands ``<|image_pad|>`` to the image's merged-patch count); text parts are copied. llama-server hands
the template text parts only (it replaces each image by its media marker), so both paths render."""

def is_multimodal(hf_dir: Path) -> bool:
    """True when ``hf_dir/config.json`` has a ``vision_config`` (an image-text-to-text checkpoint).

    Raises:
        InputError: ``hf_dir`` holds no readable ``config.json``.
    """
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{hf_dir} holds no readable config.json: {exc}") from exc
    return isinstance(config.get("vision_config"), dict)


def vision_tower_sha256(hf_dir: Path) -> str:
    """sha256 over a safetensors checkpoint's vision tower: equal for a base and every merge of a LoRA that
    left the tower frozen (the scheme of :func:`forgeflow.training.vl_burst.vision_tower_sha256`).

    Raises:
        InputError: no safetensors file, or no vision tensor in them.
    """
    from forgeflow.training.vl_burst import vision_tower_sha256 as tower_sha256

    return tower_sha256(hf_dir)


def _vl_tokenizer(tok_dir: Path) -> object:
    """The Qwen2 tokenizer with the vision special tokens named: ``tokenizer.json`` edited in a copy, then loaded."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="forgeflow-vl-tokenizer-") as tmp:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(Path(tok_dir) / name, Path(tmp) / name)
        raw = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
        for entry in raw["added_tokens"]:
            if entry["id"] in VISION_TOKENS:
                entry["content"] = VISION_TOKENS[entry["id"]]
        vocab = raw["model"]["vocab"]
        for token_id, name in VISION_TOKENS.items():
            for stale in [k for k, v in vocab.items() if v == token_id]:
                del vocab[stale]
            vocab[name] = token_id
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(raw, ensure_ascii=False), encoding="utf-8")
        return AutoTokenizer.from_pretrained(tmp)


def build_tiny_vl_model(out_dir: Path, seed: int = 0, config: text_model.TinyVLConfig | None = None
                        ) -> text_model.ModelRecord:
    """Build (or reuse) a randomly initialised tiny ``Qwen3_5ForConditionalGeneration`` with its processor.

    As :func:`forgeflow.packaging.base_model.build_tiny_model`, plus a ``Qwen3VLProcessor`` (16 px patches,
    2x2 merge) with :data:`VL_CHAT_TEMPLATE`. Default shape: 81.3 M parameters (77.8 M the untied
    151,936-row embedding and head), 325 MB float32.

    Raises:
        InputError: heads do not divide the widths.
    """
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessorPil,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
    )

    out_dir = Path(out_dir).resolve()
    cfg = config or text_model.TinyVLConfig()
    if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.vision_hidden_size % cfg.vision_heads:
        raise InputError(f"config heads do not divide: {cfg}")
    existing = text_model.read_model_record(out_dir)
    if existing is not None and existing.seed == seed and existing.config == cfg:
        return existing
    tokenizer = _vl_tokenizer(text_model.ensure_tokenizer())
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    text_config = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "linear_num_key_heads": cfg.linear_num_heads,
        "linear_num_value_heads": cfg.linear_num_heads, "linear_key_head_dim": cfg.linear_head_dim,
        "linear_value_head_dim": cfg.linear_head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "bos_token_id": text_model.BOS_TOKEN_ID, "eos_token_id": text_model.EOS_TOKEN_ID,
        "pad_token_id": text_model.PAD_TOKEN_ID, "tie_word_embeddings": False,
    }
    vision_config = {
        "depth": cfg.vision_depth, "hidden_size": cfg.vision_hidden_size, "num_heads": cfg.vision_heads,
        "intermediate_size": cfg.vision_intermediate_size, "out_hidden_size": cfg.hidden_size,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "num_position_embeddings": cfg.vision_position_embeddings,
    }
    hf_config = Qwen3_5Config(text_config=text_config, vision_config=vision_config,
                              image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                              vision_start_token_id=VISION_START_TOKEN_ID, vision_end_token_id=VISION_END_TOKEN_ID,
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(hf_config)
    model.generation_config = GenerationConfig(bos_token_id=text_model.BOS_TOKEN_ID,
                                               eos_token_id=[text_model.EOS_TOKEN_ID, text_model.PAD_TOKEN_ID],
                                               pad_token_id=text_model.PAD_TOKEN_ID)
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                            size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512})
    num_parameters = model.num_parameters()
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(str(tmp))
        image_processor.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE, encoding="utf-8")
        atomic_write_json(tmp / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})
        vision_sha = vision_tower_sha256(tmp)
        digest = sha256_tree(tmp)
    record = text_model.ModelRecord(path=out_dir, sha256=digest, vision_sha256=vision_sha,
                                    num_parameters=num_parameters, seed=seed, config=cfg)
    text_model.write_model_record(record)
    return record
