"""Sandbox backends by kind: ``podman`` (the embedded default) and ``kubernetes``, and where they run."""

from __future__ import annotations

import re
from functools import partial
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forgeflow.common import errors
from forgeflow.sandbox.base import Sandbox, SandboxSpec
from forgeflow.sandbox.podman import PodmanSandbox


class SandboxTarget(BaseModel):
    """Which sandbox backend runs a trial, and for ``kubernetes`` the cluster and namespace; the
    ``forgeflow-sandbox`` block (:class:`blocks.core.SandboxBackend`) extends it."""

    model_config = ConfigDict(frozen=True)

    kind: str = Field("podman", description="podman (a local container per trial) or kubernetes (a pod per trial).")
    namespace: str = Field(default="forgeflow", min_length=1, max_length=63,
                           description="namespace of the trial pods (kubernetes).")
    kubeconfig: str | None = Field(None,
                                   description="path of a kubeconfig file; None: the in-cluster service account, "
                                               "else $KUBECONFIG / ~/.kube/config (the kubernetes client's own "
                                               "order).")
    context: str | None = Field(None, description="kubeconfig context; None: its current context.")
    image_pull_secret: str | None = Field(
        None,
        description="a kubernetes.io/dockerconfigjson Secret in namespace for the task images, or None.")
    labels: dict[str, str] = Field(default_factory=dict,
                                   description="extra labels on every trial pod or podman container (e.g. "
                                               "the flow run that made it, so a cancelled run's sandboxes can be "
                                               "swept).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {value!r}; valid kinds: {', '.join(sorted(BACKENDS))}")
        return value

    @classmethod
    def of(cls, backend: "str | SandboxTarget") -> "SandboxTarget":
        """``backend`` as a target (a kind alone takes every default).

        Raises:
            InputError: ``backend`` is an unknown kind; the message lists the valid kinds.
        """
        if isinstance(backend, SandboxTarget):
            return backend
        if backend not in BACKENDS:
            raise errors.InputError(f"unknown sandbox backend {backend!r}; valid kinds: {', '.join(sorted(BACKENDS))}")
        return cls(kind=backend)

    def as_backend(self) -> "str | SandboxTarget":
        """What a verifier records and runs on: the kind alone for ``podman`` (nothing else to say), this
        whole target for a cluster."""
        return self.kind if self.kind == "podman" else self


def _kubernetes_sandbox(target: SandboxTarget, image: str, spec: SandboxSpec | None = None,
                        name: str | None = None, **kwargs: object) -> Sandbox:
    """A :class:`forgeflow.sandbox.kubernetes.KubernetesSandbox` in ``target``'s cluster and namespace,
    with its own API client (the client's exec stream is not safe on a shared one)."""
    from forgeflow.sandbox.kubernetes import KubernetesSandbox
    from forgeflow.sandbox.kubernetes_manifests import KubernetesSandboxSpec

    k8s_spec = KubernetesSandboxSpec.from_sandbox_spec(
        spec or SandboxSpec(), namespace=target.namespace, image_pull_secret=target.image_pull_secret,
        labels=dict(target.labels))
    return KubernetesSandbox(image, k8s_spec, name, kubeconfig=target.kubeconfig, context=target.context,
                             **kwargs)  # type: ignore[arg-type]


def get_backend(backend: "str | SandboxTarget") -> Callable[..., Sandbox]:
    """Return the sandbox factory for ``backend`` (a kind, or a :class:`SandboxTarget`): each call
    ``factory(image, spec, name)`` builds one :class:`Sandbox`.

    Raises:
        InputError: ``backend`` is an unknown kind; the message lists the valid kinds.
    """
    target = SandboxTarget.of(backend)
    return BACKENDS[target.kind](target)


BACKENDS: dict[str, Callable[[SandboxTarget], Callable[..., Sandbox]]] = {
    "podman": lambda target: partial(PodmanSandbox, labels=dict(target.labels)) if target.labels else PodmanSandbox,
    "kubernetes": lambda target: partial(_kubernetes_sandbox, target),
}
"""Sandbox backends by kind: each maps a :class:`SandboxTarget` to its factory ``(image, spec, name)``."""


BUILT_IN_BACKENDS = frozenset(BACKENDS)
"""The kinds forgeflow itself provides (:func:`register_backend` never replaces one)."""


def register_backend(kind: str, factory: Callable[[SandboxTarget], Callable[..., Sandbox]]) -> None:
    """Add a sandbox backend kind from outside forgeflow (a plugin, a benchmark's stand-in): from then on, in
    this process, a ``forgeflow-sandbox`` block or a :class:`SandboxTarget` may name ``kind``.

    Raises:
        InputError: ``kind`` is a built-in kind or not such a name.
    """
    if kind in BUILT_IN_BACKENDS or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", kind):
        raise errors.InputError(f"sandbox backend kind {kind!r} is built in or not a lower-case name")
    BACKENDS[kind] = factory


def backend_kind(backend: "str | SandboxTarget") -> str:
    """The kind of ``backend`` (``podman`` or ``kubernetes``)."""
    return SandboxTarget.of(backend).kind
