"""Fixtures shared by the integration tests (real podman, skopeo and docker-registry)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo


@contextmanager
def running_registries(servers: dict[str, RegistryServer]) -> Iterator[dict[str, RegistryServer]]:
    """Start every registry, yield them, stop each by PID afterwards (also after a failure)."""
    try:
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def skopeo() -> Skopeo:
    """skopeo without its own retries (tests see the first error) and a 60 s command timeout."""
    return Skopeo(retry_times=0, command_timeout_s=60)


@pytest.fixture(scope="module")
def registry_runner():
    """:func:`running_registries`, handed to module-scoped fixtures that start their own set."""
    return running_registries
