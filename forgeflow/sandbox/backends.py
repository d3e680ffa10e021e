"""Sandbox backends by kind: ``podman`` (the embedded default) and ``kubernetes``.

The Kubernetes backend is imported on first use (the ``kubernetes`` client is only needed there).
"""

from __future__ import annotations

from typing import Callable

from forgeflow.common import errors
from forgeflow.sandbox.base import Sandbox
from forgeflow.sandbox.podman import PodmanSandbox


def _kubernetes_sandbox(*args: object, **kwargs: object) -> Sandbox:
    """Build a :class:`forgeflow.sandbox.kubernetes.KubernetesSandbox` (imported on first use)."""
    from forgeflow.sandbox.kubernetes import KubernetesSandbox

    return KubernetesSandbox(*args, **kwargs)  # type: ignore[arg-type]


BACKENDS: dict[str, Callable[..., Sandbox]] = {"podman": PodmanSandbox, "kubernetes": _kubernetes_sandbox}
"""Sandbox factories by kind: each takes ``(image, spec, name, ...)`` and returns a :class:`Sandbox`."""


def get_backend(kind: str) -> Callable[..., Sandbox]:
    """Return the sandbox factory for ``kind`` (``podman`` on the embedded default).

    Raises:
        InputError: ``kind`` is unknown; the message lists the valid kinds.
    """
    try:
        return BACKENDS[kind]
    except KeyError:
        raise errors.InputError(
            f"unknown sandbox backend {kind!r}; valid kinds: {', '.join(sorted(BACKENDS))}"
        ) from None
