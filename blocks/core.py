"""Prefect Block classes: configuration and credentials that hand out clients.

Blocks never run workflow logic; they are saved once (UI or code) and loaded by name in flows, so
moving to a cluster or another registry is a change of block, not of code.
"""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from forgeflow import sandbox
from forgeflow.sandbox import SandboxSpec
from forgeflow.store import Store


class RegistryEndpoint(Block):
    """A container registry skopeo can reach (loopback docker-registry, ACR, ECR, Harbor...)."""

    _block_type_name = "forgeflow-registry"
    address: str = Field(description="host:port of the registry, e.g. 127.0.0.1:5702")
    namespace: str = Field("", description="repository prefix inside the registry")
    tls_verify: bool = Field(False, description="verify TLS (False for a plain-HTTP loopback registry)")
    username: str | None = Field(None, description="registry user, if it needs auth")
    password: SecretStr | None = Field(None, description="registry password or token (never logged)")

    def ref(self, repository: str, tag: str) -> str:
        """``docker://`` transport reference of ``repository:tag`` in this registry."""
        prefix = f"{self.namespace.strip('/')}/" if self.namespace else ""
        return f"docker://{self.address}/{prefix}{repository}:{tag}"


class SandboxBackend(Block):
    """Where trials run: a backend kind plus resource limits."""

    _block_type_name = "forgeflow-sandbox"
    kind: str = Field("podman", description=f"one of: {', '.join(sorted(sandbox.BACKENDS))}")
    memory_mb: int = Field(2048, ge=16, description="memory limit per trial container (MiB)")
    cpus: float = Field(1.0, gt=0, description="CPU quota per trial container (cores)")

    def spec(self) -> SandboxSpec:
        """The resource limits as a SandboxSpec (network always off)."""
        return SandboxSpec(memory_mb=self.memory_mb, cpus=self.cpus, network=False)

    def backend(self) -> type:
        """The sandbox class for ``kind`` (InputError listing the valid kinds otherwise)."""
        return sandbox.get_backend(self.kind)


class ModelStore(Block):
    """Where models, adapters and GGUF files are kept (a local directory on the embedded default)."""

    _block_type_name = "forgeflow-model-store"
    kind: str = Field("local", description="local (HF Hub comes with a later release)")
    path: Path = Field(Path(".forgeflow/models"), description="root folder of the local store")


class ServingBackend(Block):
    """The model server: llama-cpp-python's OpenAI server, blue/green on two loopback ports."""

    _block_type_name = "forgeflow-serving"
    ports: tuple[int, int] = Field((8801, 8802), description="blue/green ports")
    quantization: str = Field("Q8_0", description="GGUF quantization type that is served")


class StoreURL(Block):
    """The SQLAlchemy URL of forgeflow's store (a secret: it may hold a password)."""

    _block_type_name = "forgeflow-store"
    url: SecretStr = Field(description="e.g. sqlite:///.forgeflow/store.db or postgresql+psycopg://...")

    def store(self) -> Store:
        """An upgraded :class:`forgeflow.store.Store` on this URL."""
        store = Store(self.url.get_secret_value())
        store.upgrade()
        return store
