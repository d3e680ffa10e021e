"""Images of trajectory turns in training windows.

A trajectory's user turn carries its images by digest under ``images``
(:class:`~forgeflow.evaluation.chat_images.ImageRef` dumps: sha256, media type, file). A window keeps them as SFT
image parts naming the sha256 (``{"type": "image", "image": <sha256>}``, after the turn's text, as the canary sent
them), and the windows flow copies each file beside its JSONL as ``<sha256>.<ext>``: the layout
:func:`forgeflow.training.jsonl.read_sft_jsonl` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_bytes, sha256_bytes, sha256_file
from forgeflow.evaluation.chat_images import MEDIA_TYPES, ImageRef
from forgeflow.training.sample_images import IMAGE_ROLES


def _file_of(ref: ImageRef, folder: Path | None) -> Path | None:
    """The file holding ``ref``'s image: its path (relative: to ``folder``), else ``<folder>[/images]/<sha256>.*``."""
    path = Path(ref.path)
    candidates = [path] if path.is_absolute() or folder is None else [folder / path, path]
    for where in ([folder, folder / "images"] if folder is not None else []):
        candidates += sorted(where.glob(f"{ref.sha256}.*"))
    return next((p for p in candidates if p.is_file()), None)


def turn_images(message: Mapping[str, Any], where: str, folder: Path | None) -> list[ImageRef]:
    """The images of one trajectory message (``images``), each found and its digest checked.

    Args:
        message: the trajectory message; ``where``: how errors name it; ``folder``: the trajectory's folder.

    Raises:
        InputError: a malformed entry, images on a non-user turn, or an image whose file is missing or whose
            bytes no longer hash to its sha256 (the digest named).
    """
    entries = message.get("images")
    if not entries:
        return []
    if message.get("role") not in IMAGE_ROLES or not isinstance(entries, list):
        raise InputError(f"{where}: images on a {message.get('role')} turn; a trajectory's images ride on user "
                         "turns, as a list of {sha256, media_type, path}")
    refs = []
    for k, entry in enumerate(entries):
        try:
            ref = ImageRef.model_validate(entry)
        except ValidationError as exc:
            raise InputError(f"{where}: images[{k}] is not an image ref {{sha256, media_type, path}}: "
                             f"{exc.errors()[0]['msg']}") from None
        if ref.media_type not in MEDIA_TYPES:
            raise InputError(f"{where}: image {ref.sha256} has media type {ref.media_type!r}, not one of "
                             f"{sorted(MEDIA_TYPES)}")
        path = _file_of(ref, folder)
        if path is None:
            raise InputError(f"{where}: image {ref.sha256} is missing: no file {ref.path}"
                             + (f" nor {folder}/[images/]{ref.sha256}.*" if folder is not None else ""))
        if (found := sha256_file(path)) != ref.sha256:
            raise InputError(f"{where}: image {ref.sha256} ({path}) now has sha256 {found}: the file changed "
                             "since the trajectory recorded it")
        refs.append(ref.model_copy(update={"path": path.resolve()}))
    return refs


def image_parts(content: str, digests: Sequence[str]) -> list[dict[str, str]]:
    """SFT parts of a turn with images: its text (when any), then one image part per sha256."""
    text = [{"type": "text", "text": content}] if content else []
    return [*text, *({"type": "image", "image": digest} for digest in digests)]


def copy_images(images: Mapping[str, ImageRef], folder: Path) -> list[Path]:
    """Copy each image to ``folder/<sha256>.<ext>`` (kept when already there with that digest); the files.

    Raises:
        InputError: a source file changed since it was checked (the digest named).
    """
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    for digest, ref in sorted(images.items()):
        target = folder / f"{digest}.{MEDIA_TYPES[ref.media_type]}"
        if not (target.is_file() and sha256_file(target) == digest):
            data = Path(ref.path).read_bytes()
            if sha256_bytes(data) != digest:
                raise InputError(f"image {digest} ({ref.path}) changed while the windows were written")
            atomic_write_bytes(target, data)
        written.append(target)
    return written
