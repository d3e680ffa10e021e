"""forgeflow's Prefect blocks."""

from blocks.core import (
    ModelStore,
    RegistryEndpoint,
    SandboxBackend,
    ServingBackend,
    StoreURL,
    TrialDispatcher,
)

__all__ = ["ModelStore", "RegistryEndpoint", "SandboxBackend", "ServingBackend", "StoreURL", "TrialDispatcher"]
