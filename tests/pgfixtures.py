"""Store fixtures shared by every test folder: each store test runs on SQLite and on PostgreSQL.

* ``pg_cluster`` (session): one throwaway PostgreSQL cluster (tests/pgcluster.py, Debian's server
  binaries) on a free loopback port, started on first use and stopped by PID at the end of the
  session. When it cannot start here (no binaries, no driver, root without a ``postgres`` user) the
  PostgreSQL cases fail with that reason (scripts/setup.sh installs what they need).
* ``store_url`` (parametrized ``sqlite`` / ``postgresql``): the URL of an empty ledger database,
  a SQLite file under ``tmp_path`` or a fresh database ``CREATE DATABASE ... TEMPLATE template0``
  on the shared cluster (about 0.1 s), dropped after the test (``WITH (FORCE)``: PostgreSQL >= 13).
  A test or fixture that asks for it runs twice, once per dialect.
* ``postgres_url``: the same fresh PostgreSQL database alone, for tests only about PostgreSQL.

Loaded by ``pytest_plugins`` in tests/conftest.py.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeflow.ledger.store import Store
from tests import pgcluster
from tests.helpers import free_port

_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[pgcluster.Cluster]:
    """The session's PostgreSQL cluster on a free loopback port (superuser ``forgeflow``, trust auth)."""
    reason = pgcluster.missing_reason()
    if reason is not None:
        pytest.fail(f"{reason} (scripts/setup.sh installs it)")
    with pgcluster.postgres_cluster(free_port()) as cluster:
        yield cluster


def fresh_database(cluster: pgcluster.Cluster, prefix: str = "t") -> str:
    """Create an empty database with a unique name on ``cluster`` and return that name."""
    name = f"{prefix}_{os.getpid()}_{next(_counter)}"
    import psycopg

    with psycopg.connect(host=cluster.host, port=cluster.port, user=cluster.user, dbname="postgres",
                         autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    return name


def drop_database(cluster: pgcluster.Cluster, name: str) -> None:
    """``DROP DATABASE ... WITH (FORCE)``: also when a test left a connection open."""
    import psycopg

    with psycopg.connect(host=cluster.host, port=cluster.port, user=cluster.user, dbname="postgres",
                         autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url(pg_cluster: pgcluster.Cluster) -> Iterator[str]:
    """``postgresql+psycopg://forgeflow@127.0.0.1:<port>/<fresh database>``, dropped afterwards."""
    name = fresh_database(pg_cluster)
    try:
        yield pg_cluster.url(name, driver="postgresql+psycopg")
    finally:
        drop_database(pg_cluster, name)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty ledger database on each dialect the store supports (see the module docstring)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """An empty ledger at the head schema revision on each dialect (``store_url``), disposed afterwards.
    Test modules that need rows in it define their own ``store`` fixture, which overrides this one."""
    ledger = Store(store_url)
    ledger.upgrade()
    yield ledger
    ledger.dispose()

