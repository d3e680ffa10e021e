"""The ``serve`` flow on a user's serving backend: a ``forgeflow-serving`` block saved on the Prefect
API selects llama.cpp's ``llama-server`` with two slots; the flow starts it with those settings
(``/props`` reports the slots and the per-slot context), refuses a plan whose slots are too small
for a request before anything starts, rolls back a server that silently fell back to the CPU (GPU
layers requested from this CPU-only build) while the first generation keeps serving, and refuses a
block that does not exist, also from ``promote`` before any comparison.

Real llama-server (built once per machine from the pinned sdist), the tiny GGUFs, free loopback
ports, the session Prefect harness, a store per test.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from forgeflow.common.errors import InputError, SwapRolledBackError
from forgeflow.ledger.store import Store
from forgeflow.serving import bluegreen
from forgeflow.serving.llama_server import ContextPreflightError, ensure_llama_server
from tests.helpers import free_port, pid_alive, tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_starts_the_blocks_llama_server_and_refuses_what_it_cannot_serve(prefect_harness,
                                                                                flow_home: Path) -> None:
    from blocks.core import ServingBackend
    from flows.promote import PromoteParams, promote
    from flows.stages import ServeParams, serve

    binary = ensure_llama_server()  # the cached CPU build (minutes the first time on a machine)
    q8, _ = tiny_ggufs()
    hf_dir = q8.parent / "hf"
    ports = (free_port(), free_port())
    common = {"kind": "llama-server", "ports": ports, "n_ctx": 2048, "n_parallel": 2, "n_threads": 2}
    ServingBackend(**common, required_context_tokens=1000).save("two-slots", overwrite=True)
    ServingBackend(**common, required_context_tokens=1500).save("too-small", overwrite=True)
    # a team's own llama-server binary: here the CPU-only build, asked for GPU layers
    ServingBackend(**common, n_gpu_layers=99, binary=str(binary)).save("gpu", overwrite=True)
    state_path = flow_home / "serving" / "state.json"

    # 2 048 tokens over 2 slots is 1 024 a slot: a request of 1 500 cannot fit; nothing starts
    with pytest.raises(ContextPreflightError, match="needs 1500 tokens .* each slot holds 1024"):
        serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="too-small"))
    assert not state_path.exists() and not list(state_path.parent.glob("server-*.log"))
    with pytest.raises(InputError, match="serving block 'nope' does not exist"):
        serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="nope"))
    with pytest.raises(InputError, match="serving block 'nope' does not exist"):
        promote(PromoteParams(baseline_job="no-such-job", candidate_job="nor-this", gguf_path=q8, block="nope"))

    try:
        first = serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="two-slots"))
        assert not first.rolled_back
        state = bluegreen.read_state(state_path)
        assert state.active_port in ports and pid_alive(state.pid)
        props = httpx.get(f"http://127.0.0.1:{state.active_port}/props", timeout=10).json()
        assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 1024)
        assert Path(props["model_path"]) == q8.resolve()
        reply = httpx.post(f"{state.base_url}/chat/completions", timeout=60, json={
            "model": "forgeflow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"]

        # -ngl 99 on a CPU-only build: the server would run on the CPU without saying so
        with pytest.raises(SwapRolledBackError, match="AcceleratorFallbackError"):
            serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="gpu"))
        assert bluegreen.read_state(state_path) == state and pid_alive(state.pid)  # generation 1 serves on
        store = Store()
        rows = [(g.generation, g.status) for g in store.serving_generations()]
        store.dispose()
        assert rows == [(1, "active"), (2, "rolled_back")]
    finally:
        stopped = bluegreen.stop_active(state_path)
    assert stopped is not None and not pid_alive(stopped.pid)
