"""The session harness's Prefect server keeps its runs in the database FORGEFLOW_TEST_PREFECT_DB names.

With ``postgresql`` a flow run of this test must be a row of ``flow_run`` in the PostgreSQL
database ``prefect`` on 127.0.0.1:5445 (read back with psycopg), its final state COMPLETED; with
the default the harness's server runs on its temporary SQLite file.
"""

from __future__ import annotations

import pytest

from tests.flows.conftest import PREFECT_DB


def test_a_flow_run_is_stored_in_the_chosen_prefect_database(prefect_harness, request: pytest.FixtureRequest) -> None:
    from prefect import flow
    from prefect.context import get_run_context
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    @flow(name="prefect-database-probe")
    def probe(x: int) -> tuple[str, int]:
        return str(get_run_context().flow_run.id), x * 2

    run_id, doubled = probe(21)
    assert doubled == 42
    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    if PREFECT_DB == "sqlite":
        assert url.startswith("sqlite+aiosqlite:///"), url
        return
    import psycopg

    cluster = request.getfixturevalue("prefect_pg_cluster")
    assert url == cluster.url("prefect", driver="postgresql+asyncpg")
    with psycopg.connect(host=cluster.host, port=cluster.port, user=cluster.user, dbname="prefect") as conn:
        rows = conn.execute("SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id "
                            "WHERE r.id = %s", (run_id,)).fetchall()
    assert rows == [("prefect-database-probe", "COMPLETED")]
