"""One session-scoped Prefect test harness for every flow test (27-39 s to start on two busy cores).

``FORGEFLOW_TEST_PREFECT_DB=postgresql`` (opt-in; scripts/test.sh's second pass sets it) puts the
harness's Prefect server and the flow tests' store (``flow_store_url``) on a throwaway PostgreSQL
cluster (tests/pgcluster.py) on a free loopback port. Prefect 3.9.1's ``prefect_test_harness`` always
sets ``PREFECT_SERVER_DATABASE_CONNECTION_URL`` to a temporary SQLite file (prefect/testing/
utilities.py) and hands its settings to the server subprocess over any environment variable, so in
that mode the same server (``SubprocessASGIServer``: uvicorn + ``create_app``, which migrates the
database on start) is started the same way under a PostgreSQL (asyncpg) URL instead.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prefect import flow  # noqa: F401 - sets Prefect's log handlers up now, on pytest's streams: done

# first inside a CLI runner's invoke (deployments/cli/ imports Prefect lazily), they keep the runner's
# stderr, closed after that invoke, and the next flow run in this process fails logging to it

PREFECT_DB = os.environ.get("FORGEFLOW_TEST_PREFECT_DB", "sqlite")
if PREFECT_DB not in {"sqlite", "postgresql"}:
    raise ValueError(f"FORGEFLOW_TEST_PREFECT_DB={PREFECT_DB!r}: use 'sqlite' (default) or 'postgresql'")


@contextmanager
def postgres_test_harness(database_url: str, server_startup_timeout: int = 240) -> Iterator[str]:
    """``prefect_test_harness`` with the server's database at ``database_url`` (``postgresql+asyncpg://``).

    Mirrors prefect 3.9.1's harness: a fresh database interface, the server subprocess on a free
    port registered as the default ``SubprocessASGIServer`` (prefect issue 21544), ``PREFECT_API_URL``
    pointed at it (also as the global settings context, prefect issue 15818), logs and events
    drained before the server is stopped by PID. Yields the API URL.

    Raises:
        RuntimeError: the server did not answer /health within ``server_startup_timeout`` s.
    """
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )
    from prefect.testing.utilities import _find_available_port
    from prefect.utilities.asyncutils import run_coro_as_sync

    with temporary_database_interface(), temporary_settings(
            updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database_url}):
        server = SubprocessASGIServer(port=_find_available_port())
        prior_default = SubprocessASGIServer._instances.get(None)
        SubprocessASGIServer._instances[None] = server
        try:
            server.start(timeout=server_startup_timeout)
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}), \
                    prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
                yield server.api_url

                async def drain_workers() -> None:  # as the harness does (prefect issue 19762)
                    try:
                        result = APILogWorker.instance().drain()
                        if inspect.isawaitable(result):
                            await result
                    except RuntimeError:  # the log worker never started
                        pass
                    result = EventsWorker.drain_all()
                    if inspect.isawaitable(result):
                        await result

                run_coro_as_sync(drain_workers())
        finally:
            server.stop()
            if prior_default is not None:
                SubprocessASGIServer._instances[None] = prior_default
            else:
                SubprocessASGIServer._instances.pop(None, None)


@pytest.fixture(scope="session")
def prefect_pg_cluster():
    """The PostgreSQL cluster of ``FORGEFLOW_TEST_PREFECT_DB=postgresql`` (a free loopback port), with a
    database ``prefect`` for the server. Fails (no skip) when the switch is on and it cannot start."""
    from tests import pgcluster
    from tests.helpers import free_port

    with pgcluster.postgres_cluster(free_port()) as cluster:
        cluster.create_database("prefect")
        yield cluster


@pytest.fixture(scope="session")
def prefect_harness(request: pytest.FixtureRequest):
    if PREFECT_DB == "postgresql":
        cluster = request.getfixturevalue("prefect_pg_cluster")
        with postgres_test_harness(cluster.url("prefect", driver="postgresql+asyncpg")):
            yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):
        yield


@pytest.fixture
def flow_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The store URL a flow test fills and points ``FORGEFLOW_STORE_URL`` at: ``tmp_path/store.db``
    (SQLite, the default), or with ``FORGEFLOW_TEST_PREFECT_DB=postgresql`` a fresh database on the
    Prefect cluster (port 5445), dropped after the test."""
    if PREFECT_DB == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    from tests.pgfixtures import drop_database, fresh_database

    cluster = request.getfixturevalue("prefect_pg_cluster")
    name = fresh_database(cluster, prefix="store")
    try:
        yield cluster.url(name, driver="postgresql+psycopg")
    finally:
        drop_database(cluster, name)


@pytest.fixture
def flow_home(tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh FORGEFLOW_HOME (``tmp_path/home``) whose store is ``flow_store_url``, upgraded."""
    from forgeflow.ledger.store import Store

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    return home
