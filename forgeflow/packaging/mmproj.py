"""The vision projector (mmproj) of an image-text-to-text checkpoint: converted, checked, recorded beside its GGUF.

llama.cpp serves a multimodal model as two files: the text GGUF and the projector GGUF
(``general.architecture = clip``) given to ``llama-server --mmproj``. The projector keeps the type it
was converted in: quantization plans apply to the text GGUF only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.packaging.gguf import GGUFArtifact, convert_to_gguf
from forgeflow.packaging.vl_model import is_multimodal, vision_tower_sha256

MMPROJ_KEY = "mmproj"
"""The artifact key of the projector in a package run's artifacts (beside ``f16`` and the quantizations)."""

_BLOCK_MAP = {"attn_out": "attn.proj", "attn_qkv": "attn.qkv", "ffn_up": "mlp.linear_fc1",
              "ffn_down": "mlp.linear_fc2", "ln1": "norm1", "ln2": "norm2"}
_FIXED_MAP = {"mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2", "v.post_ln": "merger.norm",
              "v.patch_embd": "patch_embed.proj", "v.position_embd": "pos_embed"}
"""llama.cpp projector tensor -> HF ``visual.`` tensor for ``qwen3vl_merger`` (the converter's
``conversion/qwen3vl.py`` and gguf-py's ``TensorNameMap``)."""
_PROJECTOR_KEYS = ("general.architecture", "clip.has_vision_encoder", "clip.projector_type", "clip.vision.block_count",
                   "clip.vision.embedding_length", "clip.vision.projection_dim")


class MmprojCheck(BaseModel):
    """A projector GGUF as checked: against the vision tower of its checkpoint (:func:`check_mmproj`, at packaging),
    or against the text GGUF it is served with (:func:`forgeflow.serving.multimodal.check_projector`)."""

    model_config = ConfigDict(frozen=True)

    path: Path = Field(description="the projector GGUF")
    projector_type: str = Field(description="clip.projector_type (e.g. qwen3vl_merger)")
    block_count: int = Field(ge=1, description="clip.vision.block_count (layers)")
    embedding_length: int = Field(ge=1, description="clip.vision.embedding_length (tower width)")
    projection_dim: int = Field(ge=1, description="clip.vision.projection_dim (output width: the text model's width)")
    vision_sha256: str | None = Field(None, description="vision_tower_sha256 of the checkpoint it was checked "
                                                        "against (None: checked against a text GGUF only)")
    tensors_compared: int = Field(0, ge=0, description="projector tensors compared value by value with the "
                                                       "checkpoint's (0: type not mapped, or no checkpoint)")


def read_projector(mmproj_path: Path) -> tuple[Any, dict[str, Any]]:
    """Open a projector GGUF: gguf-py's reader and its ``general.architecture``, ``clip.has_vision_encoder``,
    ``clip.projector_type`` and ``clip.vision.{block_count,embedding_length,projection_dim}`` (None: absent).

    Raises:
        GGUFError: not a readable GGUF file.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(mmproj_path))
    except Exception as exc:  # gguf-py raises ValueError/OSError/struct errors on bad files
        raise GGUFError(f"{mmproj_path} is not a readable GGUF file: {exc!r}") from exc

    def value(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    return reader, {key: value(key) for key in _PROJECTOR_KEYS}


def projector_record(mmproj_path: Path, found: dict[str, Any], vision_sha256: str | None = None,
                     tensors_compared: int = 0) -> MmprojCheck:
    """The :class:`MmprojCheck` of a projector whose keys :func:`read_projector` read as ``found``.

    Raises:
        GGUFError: a ``clip.vision`` width or depth is missing (the key named).
    """
    for key in ("clip.vision.block_count", "clip.vision.embedding_length", "clip.vision.projection_dim"):
        if not found.get(key):
            raise GGUFError(f"{mmproj_path}: key {key!r} expected a positive number, found {found.get(key)!r}")
    return MmprojCheck(path=Path(mmproj_path), projector_type=str(found.get("clip.projector_type") or ""),
                       block_count=found["clip.vision.block_count"],
                       embedding_length=found["clip.vision.embedding_length"],
                       projection_dim=found["clip.vision.projection_dim"], vision_sha256=vision_sha256,
                       tensors_compared=tensors_compared)


def _config(hf_dir: Path) -> dict[str, Any]:
    return json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))


def convert_text(hf_dir: Path, out_path: Path, outtype: str = "f16") -> GGUFArtifact:
    """The language model of ``hf_dir`` as one GGUF (``--no-mtp`` when the config has no MTP layers, which
    the Qwen3.5 converter otherwise expects).

    Raises:
        As :func:`forgeflow.packaging.gguf.convert_to_gguf`.
    """
    text = _config(hf_dir).get("text_config", {})
    extra = ("--no-mtp",) if text.get("model_type", "").startswith("qwen3_5") and not text.get(
        "mtp_num_hidden_layers") else ()
    return convert_to_gguf(hf_dir, out_path, outtype, extra_args=extra)


def convert_mmproj(hf_dir: Path, out_path: Path, outtype: str = "f16") -> GGUFArtifact:
    """The vision tower + merger of ``hf_dir`` as a projector GGUF (``convert_hf_to_gguf.py --mmproj``).

    Named ``"<vision model_type> projector"`` rather than after the folder, so one tower converts to the
    same sha256 from the base and every merge of its adapter lineage. 1-D tensors stay F32.

    Raises:
        InputError: ``hf_dir`` is not an image-text-to-text checkpoint (no ``vision_config``).
        GGUFError / ToolMissingError / DiskFullError: as :func:`forgeflow.packaging.gguf.convert_to_gguf`.
    """
    if not is_multimodal(hf_dir):
        raise InputError(f"{hf_dir} has no vision_config: there is no projector to convert")
    # the converter names the GGUF after the checkpoint's folder (``general.name``: "Base Vl", "Merged"), so the
    # same frozen tower would get another digest at every merge; named after the architecture, it keeps one
    config = _config(hf_dir)
    name = f"{config.get('vision_config', {}).get('model_type') or config.get('model_type', 'vision')} projector"
    return convert_to_gguf(hf_dir, out_path, outtype, extra_args=("--mmproj", "--model-name", name))


def _hf_name(name: str) -> tuple[str, int | None] | None:
    """HF ``visual.`` tensor name (and the temporal slice of a split patch embedding) of a projector tensor."""
    if name.startswith("v.patch_embd.weight"):
        return "patch_embed.proj.weight", 1 if name.endswith(".1") else 0
    match = re.match(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if match and match.group(2) in _BLOCK_MAP:
        return f"blocks.{match.group(1)}.{_BLOCK_MAP[match.group(2)]}.{match.group(3)}", None
    stem, _, leaf = name.rpartition(".")
    return (f"{_FIXED_MAP[stem]}.{leaf}", None) if stem in _FIXED_MAP else None


def _compare_tensors(reader: Any, hf_dir: Path, path: Path) -> int:
    """Every projector tensor equals (to its stored precision) the checkpoint's vision tensor; returns the count."""
    import numpy as np
    from safetensors import safe_open

    hf: dict[str, tuple[Path, str]] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            hf.update({k.split("visual.", 1)[1]: (file, k) for k in handle.keys() if "visual." in k})
    used: set[str] = set()
    for tensor in reader.tensors:
        mapped = _hf_name(tensor.name)
        if mapped is None or mapped[0] not in hf:
            raise GGUFError(f"{path}: projector tensor {tensor.name!r} has no vision tensor in {hf_dir}")
        file, key = hf[mapped[0]]
        with safe_open(str(file), framework="pt") as handle:
            expected = handle.get_tensor(key).float()
        if mapped[1] is not None:
            expected = expected[:, :, mapped[1]]
        used.add(mapped[0])
        found = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        want = expected.numpy().reshape(-1)
        tolerance = 1e-6 if tensor.tensor_type.name == "F32" else 2e-3  # f16 keeps ~3 significant digits
        if found.shape != want.shape or not np.allclose(found, want, rtol=tolerance, atol=tolerance):
            raise GGUFError(f"{path}: tensor {tensor.name!r} differs from {key} of {hf_dir}: the projector was not "
                            "converted from this vision tower")
    missing = sorted(set(hf) - used)
    if missing:
        raise GGUFError(f"{path}: the vision tower of {hf_dir} has tensors the projector lacks: {missing[:5]}")
    return len(reader.tensors)


def check_mmproj(mmproj_path: Path, hf_dir: Path) -> MmprojCheck:
    """Check a projector GGUF against the vision tower of the checkpoint it was converted from.

    ``clip.vision.block_count`` / ``embedding_length`` / ``projection_dim`` against ``vision_config``'s
    ``depth`` / ``hidden_size`` / ``out_hidden_size``; for ``qwen3vl_merger`` every tensor against its
    ``visual.*`` tensor (F32 exactly, F16 to 2e-3), none left out.

    Raises:
        GGUFError: unreadable file, or a key/tensor differs (named, with both values).
        InputError: ``hf_dir`` is not an image-text-to-text checkpoint.
    """
    mmproj_path, hf_dir = Path(mmproj_path), Path(hf_dir)
    if not is_multimodal(hf_dir):
        raise InputError(f"{hf_dir} has no vision_config: a projector cannot be checked against it")
    vision = _config(hf_dir)["vision_config"]
    reader, found = read_projector(mmproj_path)
    expected = {"general.architecture": "clip", "clip.has_vision_encoder": True,
                "clip.vision.block_count": vision.get("depth"),
                "clip.vision.embedding_length": vision.get("hidden_size"),
                "clip.vision.projection_dim": vision.get("out_hidden_size")}
    for key, want in expected.items():
        if found[key] != want:
            raise GGUFError(f"{mmproj_path}: key {key!r} expected {want!r} (from {hf_dir}/config.json), "
                            f"found {found[key]!r}")
    compared = _compare_tensors(reader, hf_dir, mmproj_path) if found["clip.projector_type"] == "qwen3vl_merger" else 0
    return projector_record(mmproj_path, found, vision_tower_sha256(hf_dir), compared)
