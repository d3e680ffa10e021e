"""The tiny Qwen2-shaped model forgeflow trains, packages and serves on a CPU-only machine.

Real Qwen2 vocabulary (llama.cpp's ``models/ggml-vocab-qwen2.gguf`` from the pinned sdist), random
seeded weights, row sizes multiples of 256 (as k-quants need). Known difference (docs/architecture.md):
a tokenizer reloaded from ``save_pretrained`` gets transformers' Qwen2 NFC normalizer, which llama.cpp
lacks; :func:`verify_tokenizer` counts such texts rather than hiding them.
"""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import settings
from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_folder, atomic_write_json, sha256_tree
from forgeflow.packaging.sdist import vocab_gguf_path

QWEN2_5_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""The official Qwen2.5 Instruct chat template, byte-identical to ``chat_template`` in
``tokenizer_config.json`` of the Qwen/Qwen2.5-*-Instruct repositories (as vendored by TRL 1.16 in
``trl/chat_templates/qwen2_5.jinja``). TRL recognizes it by exact comparison and swaps in its
generation-tagged training template for assistant-only loss, so it must not be edited."""

EOS_TOKEN = "<|im_end|>"
"""Qwen2.5 Instruct's eos token (id 151645): each chat turn ends with it."""
PAD_TOKEN = "<|endoftext|>"
"""Qwen2.5's pad token (id 151643), which is also its ``bos_token_id`` in ``config.json``."""
BOS_TOKEN_ID = 151643
"""Upstream Qwen2.5 ``bos_token_id``; without it llama.cpp picks token 11 as bos."""
EOS_TOKEN_ID = 151645
PAD_TOKEN_ID = 151643
MODEL_MAX_LENGTH = 131072
"""Qwen2.5 tokenizer ``model_max_length``."""

_TOKENIZER_MARKER = "forgeflow-tokenizer.json"
_MODEL_SIDECAR_SUFFIX = ".forgeflow-model.json"
_VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"


class TokenizerFailure(BaseModel):
    """One llama.cpp test vector the tokenizer did not reproduce."""

    model_config = ConfigDict(frozen=True)

    text: str
    expected: list[int] = Field(description="llama.cpp's token ids (from the .out file)")
    got: list[int] = Field(description="the tokenizer's ids (add_special_tokens=False)")
    nfc_changes_text: bool = Field(
        description="Unicode NFC changes the text: the known cause for a reloaded Qwen2 tokenizer")


class TokenizerCheck(BaseModel):
    """Result of :func:`verify_tokenizer` against llama.cpp's Qwen2 tokenizer test vectors."""

    model_config = ConfigDict(frozen=True)

    matched: int = Field(ge=0)
    total: int = Field(ge=1)
    failures: list[TokenizerFailure]

    @property
    def nfc_failures(self) -> int:
        """Failures explained by NFC normalization (the known reload difference)."""
        return sum(1 for f in self.failures if f.nfc_changes_text)

    @property
    def unexplained_failures(self) -> list[TokenizerFailure]:
        """Failures not explained by NFC normalization: each one is a real tokenizer bug."""
        return [f for f in self.failures if not f.nfc_changes_text]


class TinyModelConfig(BaseModel):
    """Shape of the tiny Qwen2 model (defaults quantize cleanly to Q8_0 and Q4_K_M).

    Defaults give 40.5 M parameters, 38.9 M of them the tied embedding.
    """

    model_config = ConfigDict(frozen=True)

    hidden_size: int = Field(default=256, ge=64)
    intermediate_size: int = Field(default=768, ge=64)
    num_hidden_layers: int = Field(default=2, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    vocab_size: int = Field(default=151936, ge=1)
    max_position_embeddings: int = Field(default=32768, ge=128)
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    tie_word_embeddings: bool = True


class TinyVLConfig(BaseModel):
    """Shape of the tiny Qwen3.5 multimodal model (row sizes quantize cleanly to Q4_K_M)."""

    model_config = ConfigDict(frozen=True)

    hidden_size: int = Field(default=256, ge=64,
        description="text model width (also the vision merger's out_hidden_size)")
    intermediate_size: int = Field(default=768, ge=64)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    head_dim: int = Field(default=256, ge=32,
        description="full-attention head width (a quarter rotated, MRoPE sections 11/11/10)")
    linear_num_heads: int = Field(default=4, ge=1)
    linear_head_dim: int = Field(default=64, ge=16)
    vocab_size: int = Field(default=151936, ge=1)
    max_position_embeddings: int = Field(default=32768, ge=128)
    vision_hidden_size: int = Field(default=128, ge=32)
    vision_intermediate_size: int = Field(default=512, ge=32)
    vision_depth: int = Field(default=1, ge=1, le=4)
    vision_heads: int = Field(default=2, ge=1)
    vision_position_embeddings: int = Field(default=1024, ge=16,
        description="learned position grid size ((image_size / patch)^2; 1024 = 512 px)")


class ModelRecord(BaseModel):
    """A built model folder (HF format, safetensors + tokenizer): the tiny text model, or the tiny multimodal
    model (:func:`forgeflow.packaging.vl_model.build_tiny_vl_model`, ``vision_sha256`` set). Persisted as the
    sidecar ``<folder>.forgeflow-model.json`` (``vision_sha256`` left out for a text model)."""

    model_config = ConfigDict(frozen=True)

    path: Path
    sha256: str = Field(min_length=64, max_length=64, description="sha256_tree of the folder")
    vision_sha256: str | None = Field(None, min_length=64, max_length=64,
                                      description="sha256 over the vision tower's tensors (None: a text-only model)")
    num_parameters: int = Field(ge=1, description="the model's parameters (tied embeddings counted once; text + "
                                                  "vision for a multimodal model)")
    seed: int = Field(description="the torch seed the weights were drawn with")
    config: TinyModelConfig | TinyVLConfig

    @property
    def provenance(self) -> dict[str, str | int]:
        """What the store records as the base artifact's lineage: ``source="tiny"``, the seed and
        ``model_type`` (the same keys as :attr:`forgeflow.packaging.checkpoint.CheckpointRecord.provenance`);
        a multimodal model: ``source="tiny-vl"``, ``model_type="qwen3_5"`` and its ``vision_sha256``."""
        if self.vision_sha256 is not None:
            return {"source": "tiny-vl", "seed": self.seed, "model_type": "qwen3_5",
                    "vision_sha256": self.vision_sha256}
        return {"source": "tiny", "seed": self.seed, "model_type": "qwen2"}


# --- tokenizer -------------------------------------------------------------------------------
def tokenizer_dir() -> Path:
    """Where :func:`ensure_tokenizer` keeps the saved tokenizer (inside ``cache_dir()``)."""
    return settings.cache_dir() / f"qwen2-tokenizer-llama-cpp-python-{settings.LLAMA_CPP_PYTHON_VERSION}"


def read_test_vectors(vocab_gguf: Path) -> list[tuple[str, list[int]]]:
    """Read llama.cpp's tokenizer test vectors beside ``vocab_gguf`` as ``(text, ids)`` pairs in file order.

    Format (llama.cpp ``tests/test-tokenizer-0.cpp``, ``read_tests``): ``<gguf>.inp`` texts separated by
    ``"\\n__ggml_vocab_test__\\n"``; ``<gguf>.out`` one line of space-separated ids per text.

    Raises:
        InputError: a file is missing or the two files disagree in the number of tests.
    """
    inp, out = Path(f"{vocab_gguf}.inp"), Path(f"{vocab_gguf}.out")
    for path in (inp, out):
        if not path.is_file():
            raise InputError(f"tokenizer test vector file {path} does not exist")
    raw = inp.read_bytes().decode("utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(_VECTOR_SEPARATOR, pos)
        if nxt == -1:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(_VECTOR_SEPARATOR)
    lines = out.read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise InputError(
            f"{inp} holds {len(texts)} texts but {out} holds {len(lines)} id lines"
        )
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def _check_tokenizer(tokenizer: Any, vocab_gguf: Path) -> TokenizerCheck:
    vectors = read_test_vectors(vocab_gguf)
    failures = []
    for text, expected in vectors:
        got = list(tokenizer.encode(text, add_special_tokens=False))
        if got != expected:
            failures.append(
                TokenizerFailure(
                    text=text,
                    expected=expected,
                    got=got,
                    nfc_changes_text=unicodedata.normalize("NFC", text) != text,
                )
            )
    return TokenizerCheck(matched=len(vectors) - len(failures), total=len(vectors), failures=failures)


def verify_tokenizer(tokenizer_dir: Path) -> TokenizerCheck:
    """Tokenize llama.cpp's Qwen2 test vectors (``add_special_tokens=False``) with the tokenizer in ``tokenizer_dir``.

    Raises:
        InputError: ``tokenizer_dir`` holds no tokenizer.
    """
    from transformers import AutoTokenizer

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise InputError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return _check_tokenizer(tokenizer, vocab_gguf_path())


def _configure_qwen25(tokenizer: Any) -> Any:
    """Set the Qwen2.5 Instruct chat template and special tokens (as its tokenizer_config does)."""
    tokenizer.chat_template = QWEN2_5_CHAT_TEMPLATE
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.bos_token = None
    tokenizer.model_max_length = MODEL_MAX_LENGTH
    return tokenizer


def ensure_tokenizer() -> Path:
    """Return a folder with the Qwen2 tokenizer built from the sdist's vocabulary (built once, 16-20 s).

    It must match all of llama.cpp's test vectors when fresh; it gets the Qwen2.5 chat template, eos
    ``<|im_end|>`` and pad ``<|endoftext|>``, and is saved atomically under ``cache_dir()``.

    Raises:
        InputError: the freshly built tokenizer does not reproduce llama.cpp's vectors.
        InfraError: the sdist could not be fetched.
    """
    from transformers import AutoTokenizer

    target = tokenizer_dir()
    if (target / _TOKENIZER_MARKER).is_file():
        return target
    vocab = vocab_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name)
    check = _check_tokenizer(tokenizer, vocab)
    if check.failures:
        raise InputError(
            f"the tokenizer built from {vocab} differs from llama.cpp on "
            f"{len(check.failures)}/{check.total} test vectors, first: {check.failures[0]}"
        )
    _configure_qwen25(tokenizer)
    # a folder another process saved meanwhile holds the same tokenizer: replacing it is harmless
    with atomic_folder(target) as tmp:
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(
            tmp / _TOKENIZER_MARKER,
            {
                "source": str(vocab),
                "llama_cpp_python_version": settings.LLAMA_CPP_PYTHON_VERSION,
                "fresh_check": {"matched": check.matched, "total": check.total},
            },
        )
    return target


# --- tiny model ------------------------------------------------------------------------------
def _sidecar(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + _MODEL_SIDECAR_SUFFIX)


def read_model_record(out_dir: Path) -> ModelRecord | None:
    """The record stored beside ``out_dir`` (text or multimodal) if the folder still has the recorded digest; None
    when there is no folder, no readable sidecar, or the digest moved."""
    sidecar = _sidecar(Path(out_dir))
    if not sidecar.is_file() or not Path(out_dir).is_dir():
        return None
    try:
        record = ModelRecord.model_validate(json.loads(sidecar.read_text(encoding="utf-8")))
    except ValueError:
        return None
    return record if sha256_tree(out_dir) == record.sha256 else None


def write_model_record(record: ModelRecord) -> Path:
    """Write ``record`` as the sidecar beside ``record.path`` (``vision_sha256`` left out when None); its path."""
    return atomic_write_json(_sidecar(Path(record.path)), record.model_dump(mode="json", exclude_none=True))


def build_tiny_model(
    out_dir: Path, seed: int = 0, config: TinyModelConfig | None = None
) -> ModelRecord:
    """Build (or reuse) a randomly initialised tiny ``Qwen2ForCausalLM`` with the Qwen2 tokenizer.

    The same seed and config give the same bytes (float32 safetensors, ~162 MB). A sidecar
    ``<out_dir>.forgeflow-model.json`` holds the record; a folder whose digest still matches is reused.

    Raises:
        InputError: ``config`` is inconsistent (heads do not divide the hidden size, vocab smaller
            than the tokenizer).
    """
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out_dir = Path(out_dir).resolve()
    cfg = config or TinyModelConfig()
    if cfg.hidden_size % cfg.num_attention_heads:
        raise InputError(
            f"config.hidden_size {cfg.hidden_size} is not divisible by "
            f"num_attention_heads {cfg.num_attention_heads}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise InputError(
            f"config.num_attention_heads {cfg.num_attention_heads} is not divisible by "
            f"num_key_value_heads {cfg.num_key_value_heads}"
        )
    existing = read_model_record(out_dir)
    if existing is not None and existing.seed == seed and existing.config == cfg:
        return existing

    tok_dir = ensure_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    if len(tokenizer) > cfg.vocab_size:
        raise InputError(
            f"config.vocab_size {cfg.vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )
    hf_config = Qwen2Config(
        **cfg.model_dump(),
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=[EOS_TOKEN_ID, PAD_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
    )
    num_parameters = model.num_parameters()

    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(str(tmp))
        for name in os.listdir(tok_dir):
            if name != _TOKENIZER_MARKER:
                shutil.copy2(tok_dir / name, tmp / name)
        digest = sha256_tree(tmp)
    record = ModelRecord(
        path=out_dir, sha256=digest, num_parameters=num_parameters, seed=seed, config=cfg
    )
    write_model_record(record)
    return record
