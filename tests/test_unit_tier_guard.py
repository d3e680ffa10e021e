"""The unit tier starts no podman and no Prefect server (README, Tests): ``tests/conftest.py`` fails a
``unit`` test that tries, before the program starts, even where the code under test catches exceptions."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.conftest import unit_tier_refusal


def test_a_unit_test_that_starts_podman_or_a_prefect_server_fails_and_other_commands_run(
        request: pytest.FixtureRequest, unit_tier_guard: list[str]) -> None:
    assert request.node.get_closest_marker("unit") is not None  # this test is in the tier it checks
    with pytest.raises(pytest.fail.Exception, match="started 'podman'"):
        try:  # code under test that swallows errors does not hide it
            subprocess.run(["podman", "run", "--rm", "alpine", "true"], check=False)
        except Exception:  # noqa: BLE001 - the point: a broad except does not catch the refusal
            pass
    with pytest.raises(pytest.fail.Exception, match="started 'llama-server'"):
        subprocess.run("/usr/local/bin/llama-server --port 0", shell=True, check=False)

    async def start_skopeo() -> None:
        await asyncio.create_subprocess_exec("skopeo", "inspect", "docker://x")

    with pytest.raises(pytest.fail.Exception, match="started 'skopeo'"):
        asyncio.run(start_skopeo())
    # the command Prefect's ephemeral server and its test harness run (prefect.server.api.server:
    # SubprocessASGIServer._run_uvicorn_command), and `prefect server start`
    uvicorn = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app", "--port", "0"]
    assert "Prefect server" in unit_tier_refusal(uvicorn)
    assert "Prefect server" in unit_tier_refusal(["prefect", "server", "start"])
    with pytest.raises(pytest.fail.Exception, match="Prefect server"):
        subprocess.Popen(uvicorn)
    # each refusal is kept, to be reported again at teardown (where a test swallowed it)
    assert [reason.split(" (")[0] for reason in unit_tier_guard] == [
        "a unit test started 'podman'", "a unit test started 'llama-server'", "a unit test started 'skopeo'",
        "a unit test started a Prefect server"]
    unit_tier_guard.clear()
    # anything else runs as before
    assert unit_tier_refusal(["podman-compose-not-really", "x"]) is None
    assert subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True,
                          check=True).stdout == "ok\n"
