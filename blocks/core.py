"""Prefect Block classes: configuration and credentials that hand out clients, never workflow logic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from prefect.blocks.core import Block
from prefect.blocks.core import schema_extra as block_schema_extra
from pydantic import ConfigDict, Field, SecretStr, field_validator

from forgeflow.common.errors import InputError
from forgeflow.ledger.store import Store
from forgeflow.packaging.publish import HubTarget
from forgeflow.registry import auth as registry_auth
from forgeflow.registry import imageref
from forgeflow.registry.skopeo import Skopeo
from forgeflow.sandbox import backends
from forgeflow.sandbox.base import Sandbox, SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import SandboxLimits
from forgeflow.serving.backend import BackendConfig


def _form_order(*first: str) -> Callable[[dict[str, Any], type[Block]], None]:
    """Prefect's block ``json_schema_extra``, then ``first`` moved to the top of the schema's properties (the UI's
    form order): a field a block declares over its config's keeps the config's place in ``model_fields``."""

    def extra(schema: dict[str, Any], model: type[Block]) -> None:
        block_schema_extra(schema, model)
        properties = schema["properties"]
        schema["properties"] = {**{name: properties[name] for name in first}, **properties}

    return extra


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


class SandboxBackend(Block, SandboxLimits, backends.SandboxTarget):
    """Where trials run: :class:`forgeflow.sandbox.backends.SandboxTarget` (a backend kind, and for ``kubernetes``
    the cluster: a kubeconfig and context, or the worker's in-cluster service account, and the namespace of the
    trial pods) and :class:`forgeflow.sandbox.limits.SandboxLimits` (memory and CPUs per container; a stage's own
    limits win: :class:`~forgeflow.sandbox.limits.LimitOverrides`) as one block: their fields, bounds, defaults
    and rules, one declaration each.

    Raises:
        pydantic.ValidationError: a bad value, named (an unknown ``kind`` lists the valid ones), where the block
            is made; a block saved from the UI's form is checked where it is loaded
            (:func:`tasks.common.load_block`: InputError naming the block and field).
    """

    _block_type_name = "forgeflow-sandbox"
    model_config = ConfigDict(json_schema_extra=_form_order("kind", "memory_mb", "cpus"))

    def spec(self) -> SandboxSpec:
        """The resource limits as a SandboxSpec (network always off)."""
        return SandboxSpec(**self.limits().model_dump(), network=False)

    def target(self) -> backends.SandboxTarget:
        """The block's SandboxTarget fields as a plain SandboxTarget (kind, where its pods run, labels)."""
        return backends.SandboxTarget.model_validate(self.model_dump(include=set(backends.SandboxTarget.model_fields)))

    def backend(self) -> Callable[..., Sandbox]:
        """The sandbox factory for ``kind``."""
        return backends.get_backend(self.target())


class TrialDispatcher(Block, RayPlacement):
    """Where trials run: ``in-process`` (default) or ``ray``, each a Ray task on a node with ``resource``:
    :class:`forgeflow.sandbox.dispatch.RayPlacement` as a block (its fields, bounds and defaults, one
    declaration) plus ``kind``, its ``address`` optional (``in-process`` needs none).

    Raises:
        pydantic.ValidationError: a bad value, named, where the block is made; a block saved from the UI's form
            is checked where it is loaded (:func:`tasks.common.load_block`: InputError naming the block and field).
    """

    _block_type_name = "forgeflow-dispatcher"
    model_config = ConfigDict(json_schema_extra=_form_order("kind"))
    kind: Literal["in-process", "ray"] = Field("in-process", description="in-process or ray")
    address: str | None = Field(  # type: ignore[assignment]  # RayPlacement's, optional here (kind in-process)
        None, description=f"{RayPlacement.model_fields['address'].description} Kind ray only.")

    def placement(self) -> RayPlacement | None:
        """None for ``in-process``; the block's RayPlacement fields as a plain RayPlacement for ``ray``
        (InputError without ``address``)."""
        if self.kind == "in-process":
            return None
        if not self.address:
            raise InputError("a forgeflow-dispatcher block of kind 'ray' needs an address (host:port of the GCS)")
        return RayPlacement.model_validate(self.model_dump(include=set(RayPlacement.model_fields)))


MODEL_STORE_KINDS = ("local", "hf_hub")
"""Valid :attr:`ModelStore.kind` values."""


class ModelStore(Block, HubTarget):
    """Where released GGUF files and their lineage JSON are published: a local directory (``path``) or an HF Hub
    repository: :class:`forgeflow.packaging.publish.HubTarget` as a block (its fields, bounds and defaults, one
    declaration) plus ``kind``, ``path`` and ``token_secret``, its ``repo_id`` optional (``local`` needs none).

    The Hub token is not a field: ``token_secret`` names a Prefect ``Secret`` block read only when a publish
    needs it, so the token is in neither this block's document, nor a flow's parameters, nor a log.

    Raises:
        pydantic.ValidationError: a bad value, named (``transfer`` other than auto/lfs), where the block is made;
            a block saved from the UI's form is checked where it is loaded (:func:`tasks.common.load_block`).
    """

    _block_type_name = "forgeflow-model-store"
    model_config = ConfigDict(json_schema_extra=_form_order("kind", "path", "repo_id", "endpoint", "revision",
                                                            "token_secret"))
    kind: str = Field("local", description=f"one of: {', '.join(MODEL_STORE_KINDS)}")
    path: Path = Field(Path(".forgeflow/models"), description="root folder of the local store (kind local)")
    repo_id: str | None = Field(  # type: ignore[assignment]  # HubTarget's, optional here (kind local)
        None, description=f"{HubTarget.model_fields['repo_id'].description} (kind hf_hub)")
    token_secret: str | None = Field(
        None, description="name of the Prefect Secret block holding the Hub write token (kind hf_hub; never the token)"
    )

    def validate_kind(self) -> "ModelStore":
        """Check the fields the kind needs before any compute; returns this block (InputError otherwise)."""
        if self.kind not in MODEL_STORE_KINDS:
            raise InputError(f"model store kind {self.kind!r} is not one of {list(MODEL_STORE_KINDS)}")
        if self.kind == "hf_hub":
            parts = (self.repo_id or "").split("/")
            if len(parts) != 2 or not all(parts):
                raise InputError(f"model store kind hf_hub needs repo_id 'namespace/name', got {self.repo_id!r}")
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
