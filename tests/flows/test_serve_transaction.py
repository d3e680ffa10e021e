"""The blue/green swap as a Prefect transaction: the staged server is a task whose
``on_rollback`` hook stops it, so ANY failure after staging (canary, compare, promotion, a crash in
the flow) leaves the old server serving and no staged process behind; a promotion commits.

Real llama-cpp-python servers on the tiny GGUFs, free loopback ports, the session Prefect harness.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.fsutil import sha256_file
from forgeflow.ledger.store import Store
from forgeflow.serving import bluegreen, health
from forgeflow.serving import server as serving
from forgeflow.serving.backend import BackendConfig
from tests.helpers import free_port as _free_port
from tests.helpers import pid_alive as _alive
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]






def test_a_failure_after_staging_rolls_back_and_a_promotion_commits(prefect_harness, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect import flow

    from tasks.serving import swap_transaction

    # the promotion numbers its generation above the store's: a store of this test's own
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")

    q8, f16 = tiny_ggufs()
    state_path = tmp_path / "serving" / "state.json"
    ports = (_free_port(), _free_port())
    first = bluegreen.swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, n_ctx=512))
    staged_pids: list[int] = []

    def failing_gate(staged: bluegreen.SwapResult) -> str:
        staged_pids.append(staged.current.pid)
        assert _alive(staged.current.pid)
        raise RuntimeError("canary on the staged server crashed")

    def passing_gate(staged: bluegreen.SwapResult) -> str:
        staged_pids.append(staged.current.pid)
        return "promote"

    @flow
    def swap_flow(gate_name: str) -> dict:
        gate = failing_gate if gate_name == "fail" else passing_gate
        result = swap_transaction(state_path, f16, sha256_file(f16), BackendConfig(ports=ports), gate)
        return {"promoted": not result.rolled_back, "generation": result.current.generation}

    try:
        failed = swap_flow("fail", return_state=True)
        with pytest.raises(RuntimeError, match="canary on the staged server crashed"):
            failed.result()
        assert not _alive(staged_pids[-1])  # the rollback hook stopped the staged server
        state = bluegreen.read_state(state_path)
        assert state.generation == first.current.generation and _alive(state.pid)
        assert health.gate(state.base_url, state.model_alias).passed  # the old server still serves
        # ... and recorded the swap as rolled back (the staged port and GGUF, the failed run's id)
        rows = [(g.generation, g.port, g.gguf_sha256, g.status, g.run_id) for g in Store().serving_generations()]
        assert rows == [(1, ports[1], sha256_file(f16), "rolled_back", str(failed.state_details.flow_run_id))]

        out = swap_flow("pass")
        assert out == {"promoted": True, "generation": first.current.generation + 1}
        state = bluegreen.read_state(state_path)
        assert state.pid == staged_pids[-1] and _alive(state.pid) and state.gguf_sha256 == sha256_file(f16)
        assert not _alive(first.current.pid)  # the old generation was drained and stopped
    finally:
        bluegreen.stop_active(state_path)
        for pid in staged_pids:
            serving.stop_pid(pid)
