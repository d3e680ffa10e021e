"""Serving a multimodal model: the projector that must travel with its GGUF, and the gate's image smoke."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.packaging.mmproj import MmprojCheck, projector_record, read_projector

SMOKE_QUESTION = "What shape and colour is in this image?"


def check_projector(gguf_path: Path, mmproj_path: Path, recorded_mmproj_sha256: str | None = None) -> MmprojCheck:
    """Check, before any server starts, that ``mmproj_path`` is a vision projector for ``gguf_path``.

    Args:
        recorded_mmproj_sha256: the projector the store records beside the GGUF (its package run's
            ``mmproj_sha256``); None: not checked.

    Returns:
        The projector's :class:`~forgeflow.packaging.mmproj.MmprojCheck` (``projection_dim``: the GGUF's width;
        no ``vision_sha256``: no checkpoint is read here).

    Raises:
        InputError: a file is missing, the projector has no vision encoder, its ``projection_dim`` is not the
            GGUF's embedding width, or its sha256 is not the recorded one (each named with both values).
        GGUFError: a file is not a readable GGUF, or the projector lacks a ``clip.vision`` width or depth.
    """
    from forgeflow.common.fsutil import sha256_file
    from forgeflow.packaging.gguf_reader import read_header_index

    gguf_path, mmproj_path = Path(gguf_path), Path(mmproj_path)
    for path in (gguf_path, mmproj_path):
        if not path.is_file():
            raise errors.InputError(f"{path} is not a file")
    _, found = read_projector(mmproj_path)
    if found["general.architecture"] != "clip" or not found["clip.has_vision_encoder"]:
        raise errors.InputError(f"mmproj {mmproj_path} is not a vision projector (general.architecture "
                                f"{found['general.architecture']!r}, clip.has_vision_encoder "
                                f"{found['clip.has_vision_encoder']!r})")
    embd = next((t for t in read_header_index(gguf_path).tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise errors.InputError(f"{gguf_path} has no token_embd.weight: not a language model GGUF")
    width, projection = int(embd.shape[0]), int(found["clip.vision.projection_dim"] or 0)
    if width != projection:
        raise errors.InputError(f"mmproj {mmproj_path.name} projects to {projection} but {gguf_path.name} embeds "
                                f"{width} wide: the projector is not this model's")
    if recorded_mmproj_sha256 is not None:
        actual = sha256_file(mmproj_path)
        if actual != recorded_mmproj_sha256:
            raise errors.InputError(f"mmproj {mmproj_path} (sha256 {actual}) is not the projector recorded beside "
                                    f"{gguf_path.name} (sha256 {recorded_mmproj_sha256})")
    return projector_record(mmproj_path, found)


def red_square_data_uri(size_px: int = 64) -> str:
    """A red square (``size_px`` x ``size_px``, PNG, drawn with PIL) as an OpenAI ``image_url`` data URI."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size_px, size_px), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((size_px // 8, size_px // 8, size_px - size_px // 8, size_px - size_px // 8),
                                    fill=(255, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class ImageSmoke(BaseModel):
    """What :func:`image_smoke` found.

    Attributes:
        text_prompt_tokens / image_prompt_tokens: ``usage.prompt_tokens`` without and with the image.
    """

    model_config = ConfigDict(frozen=True)

    text_prompt_tokens: int = Field(0, ge=0)
    image_prompt_tokens: int = Field(0, ge=0)
    image_tokens: int = Field(0, description="their difference (the image's tokens as the server counted them).")
    vision: bool | None = Field(None, description="/props modalities.vision (None: the server does not say).")
    error: str = Field("", description="what failed, empty when the server used the image.")


def _prompt_tokens(client: Any, base: str, model_alias: str, content: Any) -> tuple[int, str]:
    resp = client.post(f"{base}/chat/completions", json={
        "model": model_alias, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
        "temperature": 0.0})
    if resp.status_code != 200:
        return 0, f"answered {resp.status_code}: {resp.text[:300]}"
    return int((resp.json().get("usage") or {}).get("prompt_tokens") or 0), ""


def image_smoke(client: Any, base: str, model_alias: str) -> ImageSmoke:
    """Ask the same question with and without a red square; the server used the image when the prompt grew.

    Returns:
        The evidence; ``error`` says what failed (``/props`` reports no vision, the image request was refused,
        or the prompt did not grow: the image was dropped).
    """
    import httpx

    vision: bool | None = None
    try:
        props = client.get(f"{base.removesuffix('/v1')}/props")
        if props.status_code == 200 and isinstance((props.json() or {}).get("modalities"), dict):
            vision = bool(props.json()["modalities"].get("vision"))
    except (httpx.HTTPError, ValueError):
        vision = None
    try:
        text_tokens, text_error = _prompt_tokens(client, base, model_alias, [{"type": "text", "text": SMOKE_QUESTION}])
        image_tokens, image_error = _prompt_tokens(client, base, model_alias, [
            {"type": "image_url", "image_url": {"url": red_square_data_uri()}},
            {"type": "text", "text": SMOKE_QUESTION}])
    except (httpx.HTTPError, ValueError) as exc:
        return ImageSmoke(vision=vision, error=f"image smoke failed: {type(exc).__name__}: {exc}")
    problems = []
    if vision is False:
        problems.append("/props reports modalities.vision false (no projector loaded)")
    if text_error:
        problems.append(f"the text-only smoke {text_error}")
    if image_error:
        problems.append(f"the image smoke {image_error}")
    elif not text_error and image_tokens <= text_tokens:
        problems.append(f"the image added no prompt tokens ({text_tokens} without, {image_tokens} with): "
                        "the server dropped it")
    return ImageSmoke(text_prompt_tokens=text_tokens, image_prompt_tokens=image_tokens,
                      image_tokens=image_tokens - text_tokens, vision=vision, error="; ".join(problems))
