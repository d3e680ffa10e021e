"""Images in chat turns: a task row's screenshots sent to a multimodal model, kept by digest.

Messages and trajectories carry images as refs (sha256, media type, file) under ``images``; only the request
body inlines them (:func:`api_content`) in the OpenAI image format, ``{"type": "image_url", "image_url":
{"url": "data:<media type>;base64,<bytes>"}}`` (OpenAI API reference, "Create chat completion",
https://platform.openai.com/docs/api-reference/chat/create)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import DigestMismatchError, InputError
from forgeflow.common.fsutil import atomic_write_bytes, sha256_bytes, sha256_file

MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp"}
"""The image types a task row may carry, with the file extension each is stored under."""

_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"))
_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)$", re.DOTALL)


class ImageRef(BaseModel):
    """One image of a chat turn, by digest."""

    model_config = ConfigDict(frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="hex sha256 of the image's bytes (64 characters): its identity in a trajectory.")
    media_type: str = Field(description="one of MEDIA_TYPES (image/png...).")
    path: Path = Field(
        description="the file holding those bytes (read again, and its digest checked, when a request is sent).")


def media_type_of(data: bytes) -> str:
    """The media type of image bytes by their signature (PNG, JPEG, GIF, WebP).

    Raises:
        InputError: the bytes are none of :data:`MEDIA_TYPES`.
    """
    for magic, media_type in _SIGNATURES:
        if data.startswith(magic):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise InputError(f"not a PNG, JPEG, GIF or WebP image (starts with {data[:8]!r})")


def image_ref(source: str | Path, store_dir: Path) -> ImageRef:
    """The :class:`ImageRef` of a task row's image: a file path (kept where it is) or a ``data:<type>;base64,``
    URI (its bytes written to ``store_dir/<sha256>.<ext>`` atomically, once).

    Raises:
        InputError: the file does not exist, the URI is not base64 image data, or the bytes are not an
            image of :data:`MEDIA_TYPES` (the source named, a URI cut to 60 characters).
    """
    text = str(source)
    match = _DATA_URI.match(text)
    if match is None:
        path = Path(text).expanduser()
        if not path.is_file():
            raise InputError(f"image {text!r} is neither a file nor a data:<type>;base64, URI")
        with open(path, "rb") as handle:
            head = handle.read(16)
        try:
            return ImageRef(sha256=sha256_file(path), media_type=media_type_of(head), path=path.resolve())
        except InputError as exc:
            raise InputError(f"image {text!r}: {exc}") from None
    try:
        data = base64.b64decode(match["data"], validate=True)
    except binascii.Error as exc:
        raise InputError(f"image {text[:60]!r}...: not base64 ({exc})") from None
    media_type = media_type_of(data)
    ref_path = Path(store_dir) / f"{sha256_bytes(data)}.{MEDIA_TYPES[media_type]}"
    if not ref_path.is_file():
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(ref_path, data)
    return ImageRef(sha256=sha256_bytes(data), media_type=media_type, path=ref_path)


def with_images(messages: Sequence[Mapping[str, Any]], refs: Iterable[ImageRef]) -> list[dict[str, Any]]:
    """``messages`` with ``refs`` (JSON dumps) under ``images`` of the first ``user`` message (copies; the
    input is not changed). No refs: the messages as they are.

    Raises:
        InputError: there are refs and no user message.
    """
    out = [dict(m) for m in messages]
    dumped = [ref.model_dump(mode="json") for ref in refs]
    if not dumped:
        return out
    first = next((m for m in out if m.get("role") == "user"), None)
    if first is None:
        raise InputError("images need a user message to go with; the messages have none")
    first["images"] = [*first.get("images", []), *dumped]
    return out


def api_content(message: Mapping[str, Any]) -> Any:
    """The ``content`` a message is sent with: its own, or, when it carries ``images``, its text then each
    image as an OpenAI ``image_url`` part with the image's bytes inline (a base64 ``data:`` URI).

    Raises:
        InputError: an ``images`` entry is not an :class:`ImageRef`.
        DigestMismatchError: an image file no longer has its recorded sha256 (path and both digests named).
    """
    images = message.get("images") or []
    if not images:
        return message.get("content")
    content = message.get("content")
    parts: list[dict[str, Any]] = ([{"type": "text", "text": content}] if isinstance(content, str) and content
                                   else list(content or []))
    for entry in images:
        try:
            ref = ImageRef.model_validate(entry)
        except ValueError as exc:
            raise InputError(f"a message image is not an image ref {{sha256, media_type, path}}: {exc}") from None
        data = Path(ref.path).read_bytes()
        if sha256_bytes(data) != ref.sha256:
            raise DigestMismatchError(f"image {ref.path}: expected sha256 {ref.sha256}, found {sha256_bytes(data)}")
        url = f"data:{ref.media_type};base64,{base64.b64encode(data).decode('ascii')}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts
