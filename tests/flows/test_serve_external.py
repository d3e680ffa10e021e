"""The ``serve`` flow on an external OpenAI-compatible endpoint (a ``forgeflow-serving`` block of
``kind="external"``): forgeflow starts and stops nothing, checks the endpoint (``/models`` lists the
alias, a smoke completion, llama-server's ``/props`` when it answers), records it as the serving
state the canary resolves by default and as the store's active generation; a missing key (401), a
wrong alias and a dead port are refused naming the URL and leave the recorded state as it was; an
external -> external swap re-points the state, and stopping it never signals the endpoint.

Real servers started here with the project's own start functions (llama-cpp-python's server with an
API key; llama.cpp's ``llama-server`` for ``/props``), stopped by PID in a ``finally``; the tiny
GGUFs, free loopback ports, the session Prefect harness, a store per test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_file
from forgeflow.evaluation.canary_params import CanaryEndpoint
from forgeflow.ledger.store import Store
from forgeflow.serving import bluegreen
from forgeflow.serving.backend import BackendConfig, LlamaServer
from forgeflow.serving.llama_server import ContextPreflightError, ensure_llama_server
from forgeflow.serving.server import ModelServer, stop_pid
from tests.helpers import free_port, pid_alive, tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

API_KEY = "test-endpoint-key-7f3a"  # noqa: S105 - a test's own key for its own loopback server


class _KeyedServer(ModelServer):
    """llama-cpp-python's server (the project's :class:`ModelServer` start) that wants an API key."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--api_key", API_KEY]

    @property
    def ready_url(self) -> str:
        """``/v1/models`` wants the key now: readiness is the unauthenticated OpenAPI page."""
        return f"http://127.0.0.1:{self.port}/docs"


def _generations() -> list[tuple[int, int, str, str]]:
    store = Store()
    try:
        return [(g.generation, g.port, g.gguf_sha256, g.status) for g in store.serving_generations()]
    finally:
        store.dispose()


def _checks(outcome: bluegreen.SwapResult) -> dict[str, str]:
    return {check.name: check.status for check in outcome.checks}


def test_serve_records_an_external_endpoint_the_canary_resolves(prefect_harness, flow_home: Path,
                                                                tmp_path: Path) -> None:
    from prefect.blocks.system import Secret

    from blocks.core import ServingBackend
    from flows.stages import ServeParams, serve
    from tasks.evaluation import resolve_endpoint

    q8, f16 = tiny_ggufs()
    hf_dir = q8.parent / "hf"
    state_path = flow_home / "serving" / "state.json"
    server = _KeyedServer(q8, free_port(), "coder", n_ctx=512, log_path=tmp_path / "external.log", n_threads=2,
                          startup_timeout_s=60)
    url = server.base_url
    Secret(value=API_KEY).save("ext-key", overwrite=True)
    ServingBackend(kind="external", base_url=url, model_alias="coder", api_key_secret="ext-key").save(
        "ext", overwrite=True)
    ServingBackend(kind="external", base_url=url, model_alias="coder").save("ext-no-key", overwrite=True)
    ServingBackend(kind="external", base_url=url, model_alias="nope", api_key_secret="ext-key").save(
        "ext-alias", overwrite=True)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    ServingBackend(kind="external", base_url=dead, model_alias="coder").save("ext-dead", overwrite=True)
    try:
        server.start()
        # the key is missing: 401, named with the URL; nothing recorded
        with pytest.raises(InputError, match=f"{url}/models answered 401: it wants an API key"):
            serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext-no-key"))
        assert not state_path.exists() and _generations() == []

        first = serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext"))
        assert not first.rolled_back
        assert _checks(first) == {"gguf_metadata": "passed", "models": "passed", "identity": "not_run",
                                  "slot_context": "not_run", "accelerator": "not_run", "smoke": "passed"}
        state = bluegreen.read_state(state_path)
        assert (state.external, state.pid, state.base_url, state.active_port, state.gguf_sha256,
                state.api_key_secret) == (True, None, url, server.port, sha256_file(q8), "ext-key")
        assert state.live and API_KEY not in state_path.read_text()
        assert resolve_endpoint(CanaryEndpoint()) == (url, sha256_file(q8), "coder")  # the canary's default
        assert _generations() == [(1, server.port, sha256_file(q8), "active")]

        # a wrong alias, a dead port: refused naming the URL; the recorded state and the store unchanged
        with pytest.raises(InputError, match=f"model_alias 'nope' is not served by {url}/models: it lists"):
            serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext-alias"))
        with pytest.raises(PreflightError, match=f"external endpoint {dead}/models does not answer"):
            serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext-dead"))
        assert bluegreen.read_state(state_path) == state
        assert _generations() == [(1, server.port, sha256_file(q8), "active")]

        # external -> external: the state is re-pointed (the file the user names), nothing is stopped
        second = serve(ServeParams(gguf_path=f16, hf_dir=hf_dir, block="ext"))
        assert not second.rolled_back and second.previous.generation == 1 and pid_alive(server.pid)
        assert bluegreen.read_state(state_path).gguf_sha256 == sha256_file(f16)
        assert _generations() == [(1, server.port, sha256_file(q8), "retired"),
                                  (2, server.port, sha256_file(f16), "active")]

        # stopping an external generation signals nothing: the endpoint serves on, out of forgeflow's use
        stopped = bluegreen.stop_active(state_path)
        assert stopped.external and pid_alive(server.pid)
        assert not bluegreen.read_state(state_path).live
        with pytest.raises(PreflightError, match="is stopped"):
            resolve_endpoint(CanaryEndpoint())
    finally:
        if server.pid is not None:
            stop_pid(server.pid)
    assert not pid_alive(server.pid)


def test_an_external_llama_server_is_checked_through_props(prefect_harness, flow_home: Path, tmp_path: Path) -> None:
    from blocks.core import ServingBackend
    from flows.stages import ServeParams, serve

    q8, f16 = tiny_ggufs()
    hf_dir = q8.parent / "hf"
    state_path = flow_home / "serving" / "state.json"
    server = LlamaServer(q8, free_port(), BackendConfig(kind="llama-server", model_alias="coder", n_ctx=2048,
                                                        n_parallel=2, binary=ensure_llama_server(), n_threads=2),
                         log_path=tmp_path / "llama-server.log")
    url = server.base_url
    ServingBackend(kind="external", base_url=url, model_alias="coder", required_context_tokens=1000).save(
        "ext-ls", overwrite=True)
    ServingBackend(kind="external", base_url=url, model_alias="coder", required_context_tokens=1500).save(
        "ext-ls-big", overwrite=True)
    try:
        server.start()
        # /props reports 1 024 tokens a slot (2 048 over 2 slots): a request of 1 500 does not fit
        with pytest.raises(ContextPreflightError, match="reports 1024 tokens a slot, 2 slot.* needs 1500 tokens"):
            serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext-ls-big"))
        # /props names the file it loaded: the f16 GGUF is not what it serves
        with pytest.raises(InputError, match=f"reports model_path .*{q8.name}.*, not {f16.name}: the endpoint "
                           "serves another model"):
            serve(ServeParams(gguf_path=f16, hf_dir=hf_dir, block="ext-ls"))
        assert not state_path.exists()

        outcome = serve(ServeParams(gguf_path=q8, hf_dir=hf_dir, block="ext-ls"))
        assert _checks(outcome) == {"gguf_metadata": "passed", "models": "passed", "identity": "passed",
                                    "slot_context": "passed", "accelerator": "not_run", "smoke": "passed"}
        assert bluegreen.read_state(state_path).base_url == url
    finally:
        if server.pid is not None:
            stop_pid(server.pid)
    assert not pid_alive(server.pid)
