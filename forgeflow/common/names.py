"""Names that are valid for containers and pods (DNS-1123 labels) whatever the task id."""

from __future__ import annotations

import hashlib
import re

from forgeflow.common import errors

MAX_NAME_CHARS = 63
"""Container/pod name limit: a DNS-1123 label (Kubernetes) is at most 63 characters."""


_NAME_BAD_CHARS = re.compile(r"[^a-z0-9-]+")


_NAME_DASHES = re.compile(r"-{2,}")


def sanitize_name(raw: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """Turn ``raw`` into a container/pod name: ``[a-z0-9-]``, alphanumeric at both ends, <= max_chars.

    An invalid name gets an 8-hex digest of ``raw`` appended, so ``A_b`` and ``a.b`` stay distinct. InputError:
    ``raw`` is empty or ``max_chars`` < 16.
    """
    if not raw:
        raise errors.InputError("sanitize_name: the name must not be empty")
    if max_chars < 16:
        raise errors.InputError(f"sanitize_name: max_chars must be >= 16, got {max_chars}")
    clean = _NAME_DASHES.sub("-", _NAME_BAD_CHARS.sub("-", raw.lower())).strip("-")
    if clean == raw and len(clean) <= max_chars:
        return clean
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    head = clean[: max_chars - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}" if head else f"ff-{digest}"
