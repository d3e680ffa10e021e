"""One session-scoped Prefect test harness for every flow test (FACTS.md: 27-39 s to start here)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):
        yield
