"""Image turns in SFT samples: typed parts (``text``, ``image`` in ``user`` turns only, where TRL's
``prepare_multimodal_messages`` fills them in), images kept beside the JSONL and digested by sha256.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.evaluation.chat_images import media_type_of

IMAGE_ROLES = frozenset({"user"})
"""The roles whose turns may carry image parts."""

PART_KEYS = ("type", "text", "image", "sha256")
"""The keys of every part once a dataset with images is made uniform (:func:`uniform_parts`)."""

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def image_file(ref: str, folder: Path | None) -> Path:
    """The file an image ref names: an absolute path, a path under ``folder``, or ``<folder>/<sha256>[.<ext>]``.

    Raises:
        InputError: no such file (the ref and the folder named).
    """
    path = Path(ref)
    if not path.is_absolute() and folder is not None:
        path = Path(folder) / ref
    if path.is_file():
        return path.resolve()
    if folder is not None and _SHA256.match(ref):
        found = sorted(p for p in Path(folder).glob(f"{ref}.*") if p.is_file())
        if found:
            return found[0].resolve()
    where = f" beside the samples ({folder})" if folder is not None else ""
    raise InputError(f"image {ref!r} is not a file{where}")


def check_image(path: Path, ref: str, sha256: str | None = None) -> str:
    """Check an image file and return its sha256 (hex).

    Raises:
        InputError: not a PNG, JPEG, GIF or WebP image PIL decodes, or not the sha256 its name or ``sha256`` gives.
    """
    from PIL import Image, UnidentifiedImageError

    with open(path, "rb") as handle:
        head = handle.read(16)
    try:
        media_type_of(head)
        with Image.open(path) as image:
            image.verify()
    except InputError as exc:
        raise InputError(f"image {ref!r} ({path}): {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"image {ref!r} ({path}) does not decode: {exc}") from None
    digest = sha256_file(path)
    stem = path.name.split(".", 1)[0]
    if _SHA256.match(stem) and stem != digest:
        raise InputError(f"image {ref!r} ({path}) is named by sha256 {stem} but its bytes hash to {digest}")
    if sha256 is not None and sha256 != digest:
        raise InputError(f"image {ref!r} ({path}) has sha256 {digest}, not the recorded {sha256}")
    return digest


def clean_content(content: Any, role: str, where: str, folder: Path | None = None) -> str | list[dict[str, Any]]:
    """A message's content checked: a string, or text and image parts (images with absolute path and ``sha256``).

    Raises:
        InputError: a malformed part, an image outside a user turn, or a missing or non-image file (part named).
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InputError(f"{where}.content must be a string or a non-empty list of text and image parts")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), str) and part["image"]:
            if role not in IMAGE_ROLES:
                raise InputError(f"{at}: an image part in a {role} turn; images go in {sorted(IMAGE_ROLES)} turns")
            recorded = part.get("sha256")
            try:
                path = image_file(part["image"], folder)
                digest = check_image(path, part["image"], recorded if isinstance(recorded, str) else None)
            except InputError as exc:
                raise InputError(f"{at}: {exc}") from None
            parts.append({"type": "image", "image": str(path), "sha256": digest})
        else:
            raise InputError(f"{at} must be {{\"type\": \"text\", \"text\": str}} or "
                             "{\"type\": \"image\", \"image\": <path or sha256 beside the samples>}")
    return parts


def resolve_images(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A copy of ``row`` with every image ref resolved (raising as :func:`clean_content` does)."""
    out = dict(row)
    for key in ("messages", "prompt", "completion"):
        messages = row.get(key)
        if not isinstance(messages, list):
            continue
        resolved = []
        for j, message in enumerate(messages):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                message = {**message, "content": clean_content(message["content"], str(message.get("role")),
                                                               f"{key}[{j}]", folder)}
            resolved.append(message)
        out[key] = resolved
    return out


def _messages(row: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for key in ("messages", "prompt", "completion"):
        yield from row.get(key) or []


def has_parts(rows: Iterable[dict[str, Any]]) -> bool:
    """True when a message of the rows has list content (typed parts, with images or not)."""
    return any(isinstance(m.get("content"), list) for row in rows for m in _messages(row))


def image_count(row: dict[str, Any]) -> int:
    """The image parts of one row."""
    return sum(1 for m in _messages(row) if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image")


def uniform_parts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with every content a list of parts keyed :data:`PART_KEYS`: one Arrow type per column."""
    def parts(content: Any) -> list[dict[str, Any]]:
        items = [{"type": "text", "text": content}] if isinstance(content, str) else content
        return [{key: part.get(key) for key in PART_KEYS} for part in items]

    out = []
    for row in rows:
        row = dict(row)
        for key in ("messages", "prompt", "completion"):
            if key in row:
                row[key] = [{**m, "content": parts(m["content"])} for m in row[key]]
        out.append(row)
    return out


def digest_view(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as a dataset digest sees them: each image part by its sha256 only (no path)."""
    def view(content: Any) -> Any:
        if not isinstance(content, list):
            return content
        return [{"type": "image", "sha256": p["sha256"]} if p.get("type") == "image" else p for p in content]

    out = []
    for row in rows:
        row = dict(row)
        for key in ("messages", "prompt", "completion"):
            if key in row:
                row[key] = [{**m, "content": view(m["content"])} for m in row[key]]
        out.append(row)
    return out
