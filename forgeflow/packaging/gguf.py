"""Packaging: merge a LoRA adapter, convert to GGUF, quantize, check the metadata, load it.

Real tools only: peft ``merge_and_unload``; llama.cpp's ``convert_hf_to_gguf.py`` from the pinned
llama-cpp-python sdist (:mod:`forgeflow.packaging.sdist`), in a subprocess; ``llama_cpp.llama_model_quantize``
(ftype numbers from llama.cpp's ``enum llama_ftype`` in ``include/llama.h``); the check reads the header with
:mod:`forgeflow.packaging.gguf_reader` (held to gguf-py's ``GGUFReader`` by its tests); ``llama_cpp.Llama``.
``llama_cpp`` is imported lazily: importing this module needs no compiled library.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgeflow.common.errors import GGUFError, InfraError, InputError, ToolMissingError
from forgeflow.common.fsutil import (
    atomic_folder,
    atomic_output_file,
    disk_full_error,
    looks_full,
    raise_if_disk_full,
    sha256_bytes,
    sha256_file,
)
from forgeflow.packaging.sdist import convert_script_path

QUANT_PRESETS: dict[str, int] = {"Q8_0": 7, "Q4_K_M": 15}
"""Named quantization presets -> ``llama_ftype`` (LLAMA_FTYPE_MOSTLY_Q8_0 = 7,
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15 in llama.cpp ``include/llama.h``)."""

CONVERT_OUTTYPES: dict[str, str] = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
"""``convert_hf_to_gguf.py --outtype`` values forgeflow accepts -> the artifact's type name."""

_FILE_TYPE_NAMES: dict[int, str] = {0: "F32", 1: "F16", 7: "Q8_0", 15: "Q4_K_M", 32: "BF16"}
_CONVERT_TIMEOUT_S = 900
_CONVERTER_MODULES = ("sentencepiece", "torch", "numpy")
"""Modules ``convert_hf_to_gguf.py`` imports besides its own gguf-py (llama.cpp
``requirements/requirements-convert_legacy_llama.txt``); the Qwen2 converter tries the
sentencepiece vocabulary first and fails on a missing module instead of falling back."""
_DISK_FULL_SIGNS = ("No space left on device", "Not enough free space to write")
"""How the converter reports a full disk: the ENOSPC message, and numpy's ``tofile`` refusing a
write that ``fallocate`` finds no room for (numpy ``multiarray/convert.c``)."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja")
_GGUF_ARCH = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35"}
"""HF ``model_type`` -> llama.cpp architecture where the two names differ (the converter's ``MODEL_ARCH``)."""


class GGUFArtifact(BaseModel):
    """A GGUF file forgeflow wrote."""

    model_config = ConfigDict(frozen=True)

    path: Path
    sha256: str = Field(min_length=64, max_length=64)
    size_bytes: int = Field(ge=1)
    type: str = Field(
        description="tensor type of the bulk of the weights (F16, Q8_0, Q4_K_M; <preset>+mixed for per-tensor types)")
    tensor_types: dict[str, str] | None = Field(None,
        description="the per-tensor overrides (regex -> ggml type) of a mixed quantization")
    edit_lineage: dict[str, Any] = Field(default_factory=dict,
        description="for a file edited after quantization: the sha256 before the edits and the edits applied")


class GGUFCheck(BaseModel):
    """Metadata of a GGUF file that :func:`check_gguf` found consistent with its HF config."""

    model_config = ConfigDict(frozen=True)

    path: Path
    architecture: str
    block_count: int = Field(ge=1)
    context_length: int = Field(ge=1)
    embedding_length: int = Field(ge=1)
    head_count: int = Field(ge=1)
    head_count_kv: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    file_type: str
    chat_template_sha256: str


def _artifact(path: Path, type_name: str) -> GGUFArtifact:
    return GGUFArtifact(path=path, sha256=sha256_file(path), size_bytes=path.stat().st_size, type=type_name)


# --- merge -----------------------------------------------------------------------------------
def training_dtype(adapter_dir: Path) -> str:
    """The dtype an adapter was trained in, from its ``lineage.json`` (``lineage.dtype``):
    ``float32`` or ``bfloat16``; ``float32`` when the file or the field is absent or unknown."""
    try:
        dtype = json.loads((Path(adapter_dir) / "lineage.json").read_text(encoding="utf-8"))["lineage"].get("dtype")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "float32"
    return dtype if dtype in ("float32", "bfloat16") else "float32"


def merge_adapter(base_model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """Merge a LoRA adapter into its base model and save the result with the base's tokenizer.

    Merges in the dtype the adapter was trained in (``lineage.dtype``; float32 when none), through
    ``AutoModelForImageTextToText`` for a base with a ``vision_config``; written to a temporary sibling
    and renamed over ``out_dir``.

    Raises:
        InputError: a folder is missing or the adapter has no ``adapter_config.json``.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    base_model_dir, adapter_dir, out_dir = Path(base_model_dir), Path(adapter_dir), Path(out_dir)
    if not (base_model_dir / "config.json").is_file():
        raise InputError(f"base_model_dir {base_model_dir} holds no config.json")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise InputError(f"adapter_dir {adapter_dir} holds no adapter_config.json")
    multimodal = "vision_config" in json.loads((base_model_dir / "config.json").read_text(encoding="utf-8"))
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM  # keeps the vision tower
    base = auto.from_pretrained(str(base_model_dir), dtype=getattr(torch, training_dtype(adapter_dir)))
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    out_dir = out_dir.resolve()
    with atomic_folder(out_dir) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        for name in _PROCESSOR_FILES:  # an image-text-to-text base's processor and explicit chat template
            if (base_model_dir / name).is_file():
                (tmp / name).write_bytes((base_model_dir / name).read_bytes())
    return out_dir


# --- convert ---------------------------------------------------------------------------------
def convert_to_gguf(hf_dir: Path, out_path: Path, outtype: str = "f16", extra_args: Sequence[str] = ()) -> GGUFArtifact:
    """Convert an HF checkpoint folder to one GGUF file with llama.cpp's converter (replacing ``out_path``).

    Args:
        outtype: one of :data:`CONVERT_OUTTYPES`.
        extra_args: more converter flags (``--mmproj``: the vision projector; ``--no-mtp``).

    Raises:
        InputError: ``outtype`` is unknown or ``hf_dir`` holds no ``config.json``.
        ToolMissingError: a Python module the converter needs (sentencepiece) is not installed.
        GGUFError: the converter failed (its exit code and the tail of its log in the message).
        DiskFullError: the destination ran out of space; no file is left behind.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path).resolve()
    if outtype not in CONVERT_OUTTYPES:
        raise InputError(f"outtype {outtype!r} is not one of {sorted(CONVERT_OUTTYPES)}")
    if not (hf_dir / "config.json").is_file():
        raise InputError(f"hf_dir {hf_dir} holds no config.json")
    missing = [m for m in _CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ToolMissingError(
            f"convert_hf_to_gguf.py needs the Python modules {missing}; pip install them "
            "(llama.cpp requirements/requirements-convert_legacy_llama.txt)"
        )
    script = convert_script_path()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    try:
        with atomic_output_file(out_path) as tmp:
            cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(tmp), "--outtype", outtype, *extra_args]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_CONVERT_TIMEOUT_S,
                                      check=False, cwd=str(script.parent))
            except subprocess.TimeoutExpired as exc:
                raise InfraError(f"convert_hf_to_gguf.py on {hf_dir} exceeded {_CONVERT_TIMEOUT_S} s") from exc
            if proc.returncode != 0 or tmp.stat().st_size == 0:
                log = (proc.stdout + proc.stderr).strip()
                if any(sign in log for sign in _DISK_FULL_SIGNS) or looks_full(out_path.parent):
                    raise disk_full_error(out_path, f"converting {hf_dir} to", log[-500:])
                raise GGUFError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {proc.returncode}): {log[-3000:]}")
    except OSError as exc:
        raise_if_disk_full(exc, out_path, f"converting {hf_dir} to")
        raise
    return _artifact(out_path, CONVERT_OUTTYPES[outtype])


# --- quantize --------------------------------------------------------------------------------
MIXED_ATTN_EMBD_OUTPUT_Q8_0: dict[str, str] = {
    r"attn_(q|k|v|output)\.weight$": "Q8_0",
    r"^(token_embd|output)\.weight$": "Q8_0",
}
"""Example override set: attention, embedding and output tensors at Q8_0 (llama.cpp tensor names
``blk.N.attn_q.weight``, ``token_embd.weight``, ``output.weight``); the rest follows the base
preset (for ``Q4_K_M``: Q4_K, with llama.cpp's own Q6_K choices for some ``ffn_down``)."""


class QuantSpec(BaseModel):
    """One quantized artifact of a package run: a preset, optionally with per-tensor types."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str = Field(description="a QUANT_PRESETS name (Q8_0, Q4_K_M): the type of tensors no pattern matches")
    tensor_types: dict[str, str] = Field(default_factory=dict,
        description="regex over llama.cpp tensor names -> ggml type name (first match wins); empty: uniform")
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$",
        description="the artifact's key (model-<name>.gguf); default the preset, <preset>+mixed with tensor_types")

    @property
    def key(self) -> str:
        """The artifact's key (``name``, else the preset, ``+mixed`` with per-tensor types)."""
        return self.name or (f"{self.preset}+mixed" if self.tensor_types else self.preset)


QUANT_PLANS: dict[str, QuantSpec] = {
    "Q8_0": QuantSpec(preset="Q8_0"),
    "Q4_K_M": QuantSpec(preset="Q4_K_M"),
    "Q4_K_M+attn-embd-output-Q8_0": QuantSpec(preset="Q4_K_M", tensor_types=MIXED_ATTN_EMBD_OUTPUT_Q8_0,
                                              name="Q4_K_M+attn-embd-output-Q8_0"),
}
"""Named quantizations a package run takes by name: the uniform presets and the hand-run pipeline's
served mix (attention, embedding and output at Q8_0, the rest Q4_K_M)."""


def quant_spec(value: str | QuantSpec | dict[str, Any]) -> QuantSpec:
    """A :data:`QUANT_PLANS` name, a spec, or its JSON (as the Prefect UI sends it) as a :class:`QuantSpec`.

    Raises:
        InputError: an unknown plan name or preset, a malformed spec (the field named).
    """
    if isinstance(value, str):
        if value not in QUANT_PLANS:
            raise InputError(f"quantization {value!r} is not a named plan; valid: {sorted(QUANT_PLANS)} "
                             "(or give {'preset': ..., 'tensor_types': {...}})")
        return QUANT_PLANS[value]
    if isinstance(value, dict):
        try:
            value = QuantSpec.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InputError(f"quantization {value!r}: {problems}") from None
    if value.preset not in QUANT_PRESETS:
        raise InputError(f"quantization preset {value.preset!r} is not known; valid: {sorted(QUANT_PRESETS)}")
    return value


def quant_plan(values: Sequence[str | QuantSpec | dict[str, Any]]) -> list[QuantSpec]:
    """:func:`quant_spec` of each, checked together: no two artifacts with one key, no ``f16`` key.

    Raises:
        InputError: as :func:`quant_spec`, or a repeated key (the artifacts would overwrite each other).
    """
    specs = [quant_spec(v) for v in values]
    keys = [s.key for s in specs]
    repeated = sorted({k for k in keys if keys.count(k) > 1} | ({"f16"} & set(keys)))
    if repeated:
        raise InputError(f"quantizations repeat the artifact key(s) {repeated} (f16 is the converted file); "
                         "give each a distinct name")
    return specs


def _ggml_type(pattern: str, name: str) -> int:
    from gguf import GGMLQuantizationType

    try:
        return int(GGMLQuantizationType[name.upper()])
    except KeyError:
        valid = [t.name for t in GGMLQuantizationType]
        raise InputError(
            f"tensor_types[{pattern!r}] = {name!r} is not a ggml type; valid: {valid}"
        ) from None


def _quantizable(name: str, shape: Any) -> bool:
    """llama.cpp ``tensor_allows_quantization`` (src/llama-quant.cpp) for the tensors Qwen2/Llama
    have: 2-D or more, name ends with ``weight``, not a ``_norm.weight``."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name


def quantize(
    src: Path, dst: Path, qtype: str, tensor_types: dict[str, str] | None = None
) -> GGUFArtifact:
    """Quantize a GGUF file with ``llama_cpp.llama_model_quantize``, optionally per tensor.

    ``tensor_types`` (regex over llama.cpp tensor names -> ggml type) goes to ``tt_overrides``
    (llama.cpp ``src/llama-quant.cpp``: ``std::regex_search``, first match wins, quantizable tensors only;
    ``--tensor-type`` in ``llama-quantize``). llama.cpp silently falls back to another type for
    incompatible row sizes, so every matched tensor is read back and checked.

    Returns:
        The artifact; ``type`` is ``qtype``, plus ``+mixed`` when ``tensor_types`` is given.

    Raises:
        InputError: ``qtype`` is not a known preset, a pattern is not a valid regex, a type name is
            not a ggml type, or ``src`` does not exist.
        DiskFullError: the destination ran out of space (llama.cpp only says so on stderr: a failure
            leaving under 1 MiB free is taken as a full disk); no file is left behind.
        GGUFError: llama.cpp refused (non-zero return code), a pattern matched no quantizable tensor,
            or a matched tensor did not get its type (tensor, expected and found type named).
    """
    if qtype not in QUANT_PRESETS:
        raise InputError(f"qtype {qtype!r} is not a known preset; valid: {sorted(QUANT_PRESETS)}")
    src, dst = Path(src), Path(dst).resolve()
    if not src.is_file():
        raise InputError(f"src {src} does not exist")
    overrides: list[tuple[str, int]] = []
    for pattern, type_name in (tensor_types or {}).items():
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InputError(f"tensor_types pattern {pattern!r} is not a regex: {exc}") from exc
        overrides.append((pattern, _ggml_type(pattern, type_name)))
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_PRESETS[qtype]
    params.nthread = max(1, min(4, os.cpu_count() or 1))
    keep_alive = None
    if overrides:
        if not hasattr(llama_cpp, "llama_model_tensor_override") or not any(
            name == "tt_overrides" for name, _ in llama_cpp.llama_model_quantize_params._fields_
        ):
            raise GGUFError(
                "this llama-cpp-python does not expose llama_model_quantize_params.tt_overrides; "
                "mixed per-tensor quantization is unavailable (refusing a uniform quantization)"
            )
        entry = llama_cpp.llama_model_tensor_override
        keep_alive = (entry * (len(overrides) + 1))(
            *[entry(pattern.encode(), type_id) for pattern, type_id in overrides],
            entry(None, 0),  # terminator: llama.cpp stops at the first null pattern
        )
        params.tt_overrides = ctypes.cast(keep_alive, ctypes.POINTER(entry))
    try:
        with atomic_output_file(dst) as tmp:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0 or tmp.stat().st_size == 0:
                if looks_full(dst.parent):  # llama.cpp reports a failed write only on stderr
                    raise disk_full_error(dst, f"quantizing {src} to {qtype} as",
                                          f"llama_model_quantize returned {rc}")
                raise GGUFError(f"llama_model_quantize({src} -> {qtype}) returned {rc}")
            if overrides:
                _check_overrides(tmp, dst, tensor_types or {})
    except OSError as exc:
        raise_if_disk_full(exc, dst, f"quantizing {src} to {qtype} as")
        raise
    if not overrides:
        return _artifact(dst, qtype)
    return GGUFArtifact(
        path=dst, sha256=sha256_file(dst), size_bytes=dst.stat().st_size,
        type=f"{qtype}+mixed", tensor_types=dict(tensor_types or {}),
    )


def _check_overrides(tmp: Path, dst: Path, tensor_types: dict[str, str]) -> None:
    from forgeflow.packaging.gguf_reader import read_header_index

    matched = {pattern: 0 for pattern in tensor_types}
    for tensor in read_header_index(tmp).tensors:
        if not _quantizable(tensor.name, tensor.shape):
            continue
        pattern = next((p for p in tensor_types if re.search(p, tensor.name)), None)
        if pattern is None:
            continue
        matched[pattern] += 1
        expected, found = tensor_types[pattern].upper(), tensor.ggml_type
        if expected != found:
            raise GGUFError(
                f"{dst}: tensor {tensor.name!r} (pattern {pattern!r}) expected {expected}, "
                f"found {found} (llama.cpp fell back: row size {int(tensor.shape[0])})"
            )
    unmatched = [p for p, n in matched.items() if n == 0]
    if unmatched:
        raise GGUFError(f"{dst}: tensor_types patterns {unmatched} matched no quantizable tensor")


# --- check -----------------------------------------------------------------------------------
def _hf_chat_template(hf_dir: Path) -> str | None:
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = hf_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def check_gguf(gguf_path: Path, hf_dir: Path, edited: dict[str, Any] | None = None) -> GGUFCheck:
    """Check a GGUF file's metadata against the HF checkpoint it was made from.

    Compared (GGUF <- ``config.json``): ``general.architecture`` <- ``model_type``; ``<arch>.block_count``,
    ``context_length``, ``embedding_length``, ``attention.head_count(_kv)`` <- the matching sizes; token
    count and ``token_embd.weight`` rows <- ``vocab_size``; ``tokenizer.chat_template`` present and equal
    to ``hf_dir``'s when it has one.

    Args:
        edited: key -> value a metadata edit set; such a key must hold that value instead.

    Raises:
        GGUFError: the file cannot be read, or a key differs (key, expected and found value named).
        InputError: ``hf_dir`` holds no ``config.json``.
    """
    from forgeflow.packaging.gguf_reader import array_length, read_header_index, read_metadata

    gguf_path, hf_dir = Path(gguf_path), Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise InputError(f"hf_dir {hf_dir} holds no config.json")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config = {**config, **config.get("text_config", {})}  # an image-text-to-text checkpoint: its language model
    config["model_type"] = _GGUF_ARCH.get(config.get("model_type"), config.get("model_type"))
    try:  # the header alone (offsets, then the few values compared): gguf-py's GGUFReader parses every token of
        index = read_header_index(gguf_path)  # the vocabulary (7 s for the tiny model's 151,936 here; this: 0.2 s)
    except GGUFError as exc:
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc

    def field(key: str) -> Any:
        return read_metadata(gguf_path, key, index) if key in index.fields else None

    edited = edited or {}

    def expect(key: str, expected: Any, found: Any) -> None:
        source = f"from {config_path}"
        if key in edited:
            expected, source = edited[key], "from the metadata edit"
        if expected != found:
            raise GGUFError(
                f"{gguf_path}: key {key!r} expected {expected!r} ({source}), found {found!r}"
            )

    arch = field("general.architecture")
    expect("general.architecture", config.get("model_type"), arch)
    values: dict[str, int] = {}
    for suffix, hf_key in (
        ("block_count", "num_hidden_layers"),
        ("context_length", "max_position_embeddings"),
        ("embedding_length", "hidden_size"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
    ):
        key = f"{arch}.{suffix}"
        found = field(key)
        expect(key, config.get(hf_key), found)
        values[suffix] = int(found)
    vocab_size = config.get("vocab_size")
    n_tokens = array_length(gguf_path, "tokenizer.ggml.tokens", index) if "tokenizer.ggml.tokens" in index.fields \
        else None
    expect("tokenizer.ggml.tokens (count)", vocab_size, n_tokens)
    embd = next((t for t in index.tensors if t.name == "token_embd.weight"), None)
    # ggml order: ne[0] is the embedding width, ne[1] the number of rows (tokens).
    rows = int(embd.shape[1]) if embd is not None and len(embd.shape) > 1 else None
    expect("token_embd.weight (rows)", vocab_size, rows)
    template = field("tokenizer.chat_template")
    if not template:
        raise GGUFError(f"{gguf_path}: key 'tokenizer.chat_template' expected present, found none")
    hf_template = _hf_chat_template(hf_dir)
    if hf_template is not None or "tokenizer.chat_template" in edited:
        expect("tokenizer.chat_template", hf_template, template)
    file_type = field("general.file_type")
    return GGUFCheck(
        path=gguf_path,
        architecture=arch,
        block_count=values["block_count"],
        context_length=values["context_length"],
        embedding_length=values["embedding_length"],
        head_count=values["attention.head_count"],
        head_count_kv=values["attention.head_count_kv"],
        vocab_size=n_tokens,
        file_type=_FILE_TYPE_NAMES.get(file_type, str(file_type)),
        chat_template_sha256=sha256_bytes(template.encode("utf-8")),
    )


# --- load ------------------------------------------------------------------------------------
def load_gguf(path: Path, n_ctx: int = 128) -> None:
    """Smoke test before publishing: load a GGUF with ``llama_cpp.Llama``, generate one token, close it.

    ``close()`` is explicit: with torch in the process ``Llama.__del__`` can raise at exit.

    Raises:
        GGUFError: the file does not exist, does not load, or the completion fails (path named).
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF {path} does not exist")
    import llama_cpp

    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, verbose=False)
    except Exception as exc:  # llama_cpp raises ValueError("Failed to load model from file")
        raise GGUFError(f"GGUF {path} does not load in llama.cpp: {exc}") from exc
    try:
        out = llm.create_completion("Hello", max_tokens=1, temperature=0.0)
        if not out.get("choices"):
            raise GGUFError(f"GGUF {path} loaded but produced no completion: {out!r}")
    except GGUFError:
        raise
    except Exception as exc:
        raise GGUFError(f"GGUF {path} loaded but a 1-token completion failed: {exc}") from exc
    finally:
        llm.close()
