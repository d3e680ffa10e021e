"""Prefect Block classes: configuration and credentials that hand out clients, never workflow logic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from forgeflow.common.errors import InputError
from forgeflow.ledger.store import Store
from forgeflow.registry import auth as registry_auth
from forgeflow.registry import imageref
from forgeflow.registry.skopeo import Skopeo
from forgeflow.sandbox import backends
from forgeflow.sandbox.base import Sandbox, SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import DEFAULT_CPUS, DEFAULT_MEMORY_MB, Cpus, MemoryMb, SandboxLimits
from forgeflow.serving.backend import BackendConfig


class RegistryEndpoint(Block):
    """A registry skopeo can reach; a bad ``address`` or ``namespace`` is a ValidationError naming the field."""

    _block_type_name = "forgeflow-registry"
    address: str = Field(description="host:port of the registry, e.g. 127.0.0.1:5702")
    namespace: str = Field("", description="repository prefix inside the registry")
    tls_verify: bool = Field(False, description="verify TLS (False for a plain-HTTP loopback registry)")
    username: str | None = Field(None, description="registry user, if it needs auth")
    password: SecretStr | None = Field(None, description="registry password or token (never logged)")

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        return imageref.check_address(value, "address")

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str) -> str:
        return imageref.check_namespace(value, "namespace")

    def ref(self, repository: str, tag: str) -> str:
        """``docker://`` transport reference of ``repository:tag`` in this registry."""
        prefix = f"{self.namespace.strip('/')}/" if self.namespace else ""
        return f"docker://{self.address}/{prefix}{repository}:{tag}"

    @contextmanager
    def skopeo(self, retry_times: int = 3, command_timeout_s: float = 600.0) -> Iterator[Skopeo]:
        """A :class:`~forgeflow.registry.skopeo.Skopeo` that can reach this registry, valid inside the ``with``.

        Credentials go into a temporary containers-auth.json (mode 600), never onto a command line or into a log.
        InputError: only one of ``username`` / ``password`` is set, or bad arguments.
        """
        has_password = self.password is not None and bool(self.password.get_secret_value())
        if bool(self.username) != has_password:
            raise InputError(
                f"registry {self.address}: set both username and password, or neither"
            )
        if not self.username:
            yield Skopeo(retry_times=retry_times, command_timeout_s=command_timeout_s)
            return
        with registry_auth.authfile({self.address: (self.username, self.password)}) as path:
            yield Skopeo(authfile=path, retry_times=retry_times, command_timeout_s=command_timeout_s)


class SandboxBackend(Block):
    """Where trials run: a backend kind plus resource limits, and for ``kubernetes`` the cluster
    (a kubeconfig and context, or the worker's in-cluster service account) and the namespace of
    the trial pods."""

    _block_type_name = "forgeflow-sandbox"
    kind: str = Field("podman", description=f"one of: {', '.join(sorted(backends.BACKENDS))}")
    memory_mb: MemoryMb = DEFAULT_MEMORY_MB  # a stage's own limit wins (forgeflow.sandbox.limits.LimitOverrides)
    cpus: Cpus = DEFAULT_CPUS
    namespace: str = Field("forgeflow", description="kubernetes: namespace of the trial pods")
    kubeconfig: str | None = Field(None, description="kubernetes: path of a kubeconfig file (none: in-cluster, "
                                   "else $KUBECONFIG or ~/.kube/config)")
    context: str | None = Field(None, description="kubernetes: kubeconfig context (none: its current one)")
    image_pull_secret: str | None = Field(None, description="kubernetes: dockerconfigjson Secret for the task images")

    def limits(self) -> SandboxLimits:
        """The block's memory and CPUs: what a stage that sets none of its own gets."""
        return SandboxLimits(memory_mb=self.memory_mb, cpus=self.cpus)

    def spec(self) -> SandboxSpec:
        """The resource limits as a SandboxSpec (network always off)."""
        return SandboxSpec(**self.limits().model_dump(), network=False)

    def target(self) -> backends.SandboxTarget:
        """The SandboxTarget (kind, where its pods run); InputError names an invalid kind or field."""
        backends.SandboxTarget.of(self.kind)  # an unknown kind: InputError listing the valid ones
        try:
            return backends.SandboxTarget(kind=self.kind, namespace=self.namespace, kubeconfig=self.kubeconfig,
                                          context=self.context, image_pull_secret=self.image_pull_secret)
        except ValueError as exc:
            raise InputError(f"sandbox block: {exc}") from exc

    def backend(self) -> Callable[..., Sandbox]:
        """The sandbox factory for ``kind`` (InputError listing the valid kinds otherwise)."""
        return backends.get_backend(self.target())


class TrialDispatcher(Block):
    """Where trials run: ``in-process`` (default) or ``ray`` (each a Ray task on a node with ``resource``)."""

    _block_type_name = "forgeflow-dispatcher"
    kind: Literal["in-process", "ray"] = Field("in-process", description="in-process or ray")
    address: str | None = Field(None, description="Ray GCS address host:port (kind ray)")
    resource: str = Field("sandbox", description="custom resource a sandbox node declares (ray start --resources)")
    per_trial: float = Field(1.0, gt=0, description="how much of the resource one trial takes")
    max_retries: int = Field(3, ge=0, description="Ray re-runs of a trial whose node died")

    def placement(self) -> RayPlacement | None:
        """None for ``in-process``; the RayPlacement for ``ray`` (InputError without ``address``)."""
        if self.kind == "in-process":
            return None
        if not self.address:
            raise InputError("a forgeflow-dispatcher block of kind 'ray' needs an address (host:port of the GCS)")
        return RayPlacement(address=self.address, resource=self.resource, per_trial=self.per_trial,
                            max_retries=self.max_retries)


MODEL_STORE_KINDS = ("local", "hf_hub")
"""Valid :attr:`ModelStore.kind` values."""


class ModelStore(Block):
    """Where released GGUF files and their lineage JSON are published: a local directory or an HF Hub repository.

    The Hub token is not a field: ``token_secret`` names a Prefect ``Secret`` block read only when a publish
    needs it, so the token is in neither this block's document, nor a flow's parameters, nor a log.
    """

    _block_type_name = "forgeflow-model-store"
    kind: str = Field("local", description=f"one of: {', '.join(MODEL_STORE_KINDS)}")
    path: Path = Field(Path(".forgeflow/models"), description="root folder of the local store (kind local)")
    repo_id: str | None = Field(None, description="HF Hub model repository 'namespace/name' (kind hf_hub)")
    endpoint: str = Field("https://huggingface.co", description="HF Hub base URL (kind hf_hub)")
    revision: str = Field("main", description="branch the Hub commit goes to (kind hf_hub)")
    token_secret: str | None = Field(
        None, description="name of the Prefect Secret block holding the Hub write token (kind hf_hub; never the token)"
    )
    private: bool = Field(True, description="visibility of the Hub repository if publishing creates it")
    transfer: str = Field("auto", description="auto (huggingface_hub's choice: Xet if installed) or lfs (Git LFS)")

    def validate_kind(self) -> "ModelStore":
        """Check the fields the kind needs before any compute; returns this block (InputError otherwise)."""
        if self.kind not in MODEL_STORE_KINDS:
            raise InputError(f"model store kind {self.kind!r} is not one of {list(MODEL_STORE_KINDS)}")
        if self.kind == "hf_hub":
            parts = (self.repo_id or "").split("/")
            if len(parts) != 2 or not all(parts):
                raise InputError(f"model store kind hf_hub needs repo_id 'namespace/name', got {self.repo_id!r}")
            if self.transfer not in ("auto", "lfs"):
                raise InputError(f"model store transfer {self.transfer!r} is not one of ['auto', 'lfs']")
        return self

    def hub_token(self) -> SecretStr | None:
        """The Hub token from the Secret block ``token_secret``, read now (None when unset; InputError: empty)."""
        if not self.token_secret:
            return None
        return secret_token(self.token_secret, "model store token_secret")


def secret_token(name: str, what: str) -> SecretStr:
    """The string the Prefect ``Secret`` block ``name`` holds, read now (InputError naming ``what``: missing/empty)."""
    from prefect.blocks.system import Secret

    try:
        secret = Secret.load(name)
    except ValueError as exc:  # Prefect: "Unable to find block document named ..."
        raise InputError(f"{what} {name!r}: no such Secret block") from exc
    value = secret.value.get_secret_value()
    if not isinstance(value, str) or not value:
        raise InputError(f"Secret block {name!r} holds no token string")
    return SecretStr(value)


class ServingBackend(Block, BackendConfig):
    """The model server a swap starts: :class:`forgeflow.serving.backend.BackendConfig` itself as a block (its
    fields, bounds, defaults and rules, one declaration): llama-cpp-python (default), ``llama-server``, or an
    external endpoint forgeflow does not start (its key read from the Secret block ``api_key_secret`` only when a
    swap calls it; the lifecycle refuses kind external).

    Raises:
        pydantic.ValidationError: a bad value, named, where the block is made; a block saved from the UI's form is
            checked where it is loaded (:func:`tasks.common.load_block`: InputError naming the block and field).
    """

    _block_type_name = "forgeflow-serving"

    def config(self) -> BackendConfig:
        """The block's values as a plain BackendConfig (what the serving tasks take and cache on)."""
        return BackendConfig.model_validate(self.model_dump(include=set(BackendConfig.model_fields)))


class StoreURL(Block):
    """The SQLAlchemy URL of forgeflow's store (a secret: it may hold a password)."""

    _block_type_name = "forgeflow-store"
    url: SecretStr = Field(description="e.g. sqlite:///.forgeflow/store.db or postgresql+psycopg://...")

    def store(self) -> Store:
        """An upgraded :class:`forgeflow.ledger.store.Store` on this URL."""
        store = Store(self.url.get_secret_value())
        store.upgrade()
        return store
