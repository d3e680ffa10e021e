"""Serving with the real llama-cpp-python server on a real tiny GGUF (tiny Qwen2 -> f16 -> Q8_0).

Ports are picked free at run time (the demo uses 8801/8802). Every server a test starts is stopped
by PID in a ``finally``/fixture teardown.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import httpx
import pytest

from forgeflow.common.errors import InputError, ServerStartError, SwapRolledBackError
from forgeflow.common.fsutil import sha256_file
from forgeflow.serving.backend import BackendConfig
from forgeflow.serving.bluegreen import (
    discard,
    promote,
    read_state,
    stage,
    stop_active,
    swap,
)
from forgeflow.serving.health import gate
from forgeflow.serving.server import ModelServer, stop_pid
from tests.helpers import free_port as _free_port
from tests.helpers import pid_alive as _pid_alive
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_CTX = 512








@pytest.fixture(scope="module")
def ggufs() -> tuple[Path, Path]:
    return tiny_ggufs()


def test_server_starts_gates_and_answers(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    q8, _ = ggufs
    port = _free_port()
    server = ModelServer(q8, port, "tiny", n_ctx=N_CTX, log_path=tmp_path / "server.log")
    with server:
        assert server.base_url == f"http://127.0.0.1:{port}/v1"
        assert server.pid is not None and _pid_alive(server.pid)
        result = gate(server.base_url, "tiny")
        assert result.passed, result.error
        assert result.models_ok and "tiny" in result.model_ids
        assert 1 <= result.smoke_tokens <= 8
        reply = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        ).json()
        assert reply["choices"][0]["message"]["role"] == "assistant"
        pid = server.pid
    assert not _pid_alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_the_backend_binds_the_address_it_is_given(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    """``BackendConfig.host``: a server bound to 127.0.0.2 (Linux routes all of 127/8 to lo, so this
    is another address on every machine) answers there and not on 127.0.0.1; one bound to 0.0.0.0
    answers on both, and its recorded URL is 127.0.0.1's. A host that is not an IPv4 address is
    refused before anything starts."""
    q8, _ = ggufs
    port = _free_port()
    only = BackendConfig(host="127.0.0.2", n_ctx=N_CTX).server(q8, port, tmp_path / "only.log")
    with only:
        assert only.base_url == f"http://127.0.0.2:{port}/v1" and gate(only.base_url, "forgeflow").passed
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    every = BackendConfig(host="0.0.0.0", n_ctx=N_CTX).server(q8, port, tmp_path / "every.log")
    with every:
        assert every.base_url == f"http://127.0.0.1:{port}/v1"
        for host in ("127.0.0.1", "127.0.0.2"):
            assert httpx.get(f"http://{host}:{port}/v1/models", timeout=10).status_code == 200
    from forgeflow.serving.backend import backend_config

    with pytest.raises(InputError, match="host 'localhost' is not an IPv4 address"):
        backend_config({"host": "localhost"}, "forgeflow-serving block 'x'")


def test_gate_reports_wrong_alias_and_dead_endpoint(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    q8, _ = ggufs
    with ModelServer(q8, _free_port(), "tiny", n_ctx=N_CTX, log_path=tmp_path / "s.log") as server:
        wrong = gate(server.base_url, "other-alias")
        assert not wrong.passed and not wrong.models_ok
        assert "other-alias" in wrong.error
    dead = gate(f"http://127.0.0.1:{_free_port()}/v1", "tiny", timeout_s=5)
    assert not dead.passed and dead.smoke_tokens == 0 and "ConnectError" in dead.error


def test_server_start_fails_on_truncated_gguf_with_log_tail(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    q8, _ = ggufs
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(q8.read_bytes()[: q8.stat().st_size // 3])
    server = ModelServer(broken, _free_port(), "tiny", n_ctx=N_CTX, log_path=tmp_path / "broken.log")
    with pytest.raises(ServerStartError, match="exited"):
        server.start()
    assert server.pid is not None and not _pid_alive(server.pid)


def test_server_refuses_port_in_use(ggufs: tuple[Path, Path]) -> None:
    q8, _ = ggufs
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(ServerStartError, match="already in use"):
            ModelServer(q8, port, "tiny").start()


def test_blue_green_swap_moves_generation_stops_old_pid_and_rolls_back(
    ggufs: tuple[Path, Path], tmp_path: Path
) -> None:
    q8, f16 = ggufs
    state_path = tmp_path / "serving" / "state.json"
    ports = (_free_port(), _free_port())
    try:
        first = swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX))
        assert first.previous is None and not first.rolled_back
        gen1 = first.current
        assert gen1.generation == 1 and gen1.active_port == ports[0] and gen1.gguf_path == q8.resolve()
        assert read_state(state_path) == gen1
        assert gate(gen1.base_url, "tiny").passed

        second = swap(state_path, f16, sha256_file(f16), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX))
        gen2 = second.current
        assert not second.rolled_back and second.gate is not None and second.gate.passed
        assert gen2.generation == 2 and gen2.active_port == ports[1]
        assert gen2.gguf_sha256 == sha256_file(f16)
        assert read_state(state_path) == gen2
        assert not _pid_alive(gen1.pid), "the old server must be stopped by its recorded PID"
        assert gate(gen2.base_url, "tiny").passed

        broken = tmp_path / "truncated.gguf"
        shutil.copyfile(q8, broken)
        with open(broken, "r+b") as handle:
            handle.truncate(q8.stat().st_size // 2)
        with pytest.raises(SwapRolledBackError, match=r"\(generation 2 keeps serving\)") as info:
            swap(state_path, broken, sha256_file(broken), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX))
        rolled = info.value.result
        assert rolled.rolled_back and rolled.current == gen2 and "did not start" in rolled.error
        assert read_state(state_path) == gen2, "a failed swap must keep the old state"
        assert _pid_alive(gen2.pid) and gate(gen2.base_url, "tiny").passed, "the old server keeps serving"
        with pytest.raises(httpx.ConnectError):  # the broken server is gone from the idle port
            httpx.get(f"http://127.0.0.1:{ports[0]}/v1/models", timeout=5)

        with pytest.raises(InputError, match="does not match"):
            swap(state_path, q8, "0" * 64, BackendConfig(ports=ports, model_alias="tiny"))

        # a caller sharing numbers with other state files raises the next one (never lowers it)
        with pytest.raises(InputError, match="min_generation"):
            swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, model_alias="tiny"), min_generation=0)
        third = swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX),
                     min_generation=7)
        assert third.previous == gen2 and third.current.generation == 7 and read_state(state_path) == third.current
    finally:
        stopped = stop_active(state_path)
        for state in (locals().get("gen1"), locals().get("gen2")):
            if state is not None and state.pid is not None:
                stop_pid(state.pid, state.active_port)
    assert stopped is not None and not _pid_alive(stopped.pid)
    assert read_state(state_path).pid is None


def test_staged_server_answers_before_promotion_and_discard_keeps_the_old_one(
    ggufs: tuple[Path, Path], tmp_path: Path
) -> None:
    q8, f16 = ggufs
    state_path = tmp_path / "serving" / "state.json"
    ports = (_free_port(), _free_port())
    try:
        gen1 = swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX)).current
        staged = stage(state_path, f16, sha256_file(f16), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX))
        assert staged.new_port == ports[1] and gate(staged.current.base_url, "tiny").passed  # canary can run here
        assert read_state(state_path) == gen1, "staging must not move the recorded endpoint"
        discard(staged)  # e.g. the promotion gate said hold
        assert not _pid_alive(staged.current.pid) and _pid_alive(gen1.pid) and read_state(state_path) == gen1

        staged = stage(state_path, f16, sha256_file(f16), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX))
        promoted = promote(state_path, staged)
        assert promoted.current.generation == 2 and promoted.current.pid == staged.current.pid
        assert not _pid_alive(gen1.pid), "promotion stops the old server"
    finally:
        stop_active(state_path)
        for pid, port in ((locals().get("gen1") and gen1.pid, ports[0]),
                          (locals().get("staged") and staged.current.pid, ports[1])):
            if pid:
                stop_pid(pid, port)
