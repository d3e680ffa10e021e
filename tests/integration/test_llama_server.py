"""llama.cpp's ``llama-server`` (built once per machine from the pinned sdist) as a serving backend.

Real binary, real tiny GGUF (Q8_0), free loopback ports; every server is stopped by PID. The binary
comes from the llama.cpp build shared with llama-cpp-python (``forgeflow.common.llama_cpp_build``;
minutes on 2 cores the first time, then cached under ``cache_dir()/llama-server-<version>-<tag>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from forgeflow.common.errors import SwapRolledBackError
from forgeflow.common.fsutil import sha256_file
from forgeflow.serving.backend import BackendConfig, LlamaServer
from forgeflow.serving.bluegreen import read_state, stop_active, swap
from forgeflow.serving.health import gate
from forgeflow.serving.llama_server import (
    ContextPreflightError,
    ensure_llama_server,
    slot_context,
)
from tests.helpers import free_port as _free_port
from tests.helpers import pid_alive as _alive
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]






@pytest.fixture(scope="module")
def binary() -> Path:
    return ensure_llama_server()


@pytest.fixture(scope="module")
def q8() -> Path:
    return tiny_ggufs()[0]


def test_props_report_the_per_slot_context_forgeflow_computed(binary: Path, q8: Path, tmp_path: Path) -> None:
    config = BackendConfig(kind="llama-server", model_alias="forgeflow", n_ctx=2048, n_parallel=2,
                           required_context_tokens=1000, binary=binary, n_threads=2)
    with LlamaServer(q8, _free_port(), config, log_path=tmp_path / "s.log") as server:
        assert server.props is not None
        expected = slot_context(2048, 2, False)
        assert (server.props.per_slot_ctx, server.props.total_slots) == (expected.per_slot, 2) == (1024, 2)
        assert server.props.has_chat_template
        assert gate(server.base_url, "forgeflow").passed
        pid = server.pid
    assert not _alive(pid)


def test_a_plan_whose_slots_are_too_small_is_refused_before_anything_starts(binary: Path, q8: Path, tmp_path: Path) -> None:
    with pytest.raises(ContextPreflightError, match="needs 1500 tokens .* each slot holds 1024"):
        LlamaServer(q8, _free_port(), BackendConfig(kind="llama-server", model_alias="forgeflow", n_ctx=2048,
                                                    n_parallel=2, required_context_tokens=1500, binary=binary),
                    log_path=tmp_path / "s.log")
    assert not (tmp_path / "s.log").exists()


def test_swap_to_llama_server_then_a_cpu_fallback_is_rolled_back(binary: Path, q8: Path, tmp_path: Path) -> None:
    state_path = tmp_path / "serving.json"
    ports = (_free_port(), _free_port())
    sha = sha256_file(q8)
    try:
        first = swap(state_path, q8, sha, BackendConfig(kind="llama-server", ports=ports, n_ctx=1024, n_threads=2,
                                                    binary=binary, required_context_tokens=512))
        assert httpx.get(f"http://127.0.0.1:{first.current.active_port}/props").status_code == 200
        # GPU layers requested from a CPU-only build: the server would silently run on the CPU
        with pytest.raises(SwapRolledBackError, match="AcceleratorFallbackError") as info:
            swap(state_path, q8, sha, BackendConfig(kind="llama-server", ports=ports, n_ctx=1024, n_threads=2,
                                                binary=binary, n_gpu_layers=99))
        assert info.value.result.rolled_back
        state = read_state(state_path)
        assert state.generation == first.current.generation and _alive(state.pid)
        assert gate(state.base_url, "forgeflow").passed  # the old server still serves
        idle = ports[1] if state.active_port == ports[0] else ports[0]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{idle}/health", timeout=2)
    finally:
        stop_active(state_path)
    assert not _alive(read_state(state_path).pid or first.current.pid)


def test_the_cpu_binary_comes_from_the_shared_build_and_runs_from_any_folder(binary: Path, tmp_path: Path) -> None:
    """One llama.cpp compile serves llama-cpp-python and llama-server: the binary lies beside the shared
    libraries it links (RPATH ``$ORIGIN``), so it starts in any process without LD_LIBRARY_PATH, even
    from a copy of its folder elsewhere."""
    import shutil
    import subprocess

    from forgeflow.common import llama_cpp_build

    if os.environ.get("FORGEFLOW_LLAMA_SERVER"):
        pytest.fail("unset FORGEFLOW_LLAMA_SERVER: this test checks forgeflow's own build")
    assert binary == llama_cpp_build.server_dir() / "bin" / "llama-server"
    assert llama_cpp_build.cached_wheel() is not None  # the same build left the llama-cpp-python wheel
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=True).stdout
    ours = {fields[0]: fields[2] for fields in map(str.split, linked.splitlines())
            if fields and fields[0].startswith(("libllama", "libggml", "libmtmd"))}
    assert {"libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libmtmd.so.0"} <= set(ours)
    assert {Path(p).parent for p in ours.values()} == {binary.parent}, linked
    copy = tmp_path / "elsewhere"
    shutil.copytree(binary.parent, copy, symlinks=True)
    out = subprocess.run([str(copy / "llama-server"), "--version"], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert out.returncode == 0 and "version" in (out.stdout + out.stderr), out.stderr


def test_a_binary_named_by_the_environment_must_exist(monkeypatch, tmp_path: Path) -> None:
    from forgeflow.common.errors import ToolMissingError

    monkeypatch.setenv("FORGEFLOW_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(ToolMissingError, match="FORGEFLOW_LLAMA_SERVER"):
        ensure_llama_server()


def test_gpu_serve_benchmark_runs_on_the_cpu_and_skips_what_is_missing(binary: Path, q8: Path, tmp_path: Path) -> None:
    """``python -m benchmarks.gpu_serve --cpu``: both decode paths measured, the JSON line complete;
    with llama-cpp-python hidden (as on the GPU machine's Python) the direct part is skipped with its
    reason instead of a traceback, and the served part still runs."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "benchmarks.gpu_serve", "--cpu", "--gguf", str(q8), "--tokens", "16",
               "--log-dir", str(tmp_path)]
    env = {**os.environ, "FORGEFLOW_LLAMA_SERVER": str(binary)}
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["server_decode_tokens_per_s"] > 0 and summary["direct_decode_tokens_per_s"] > 0
    assert summary["server_tokens"] == summary["direct_tokens"] == 16 and summary["n_gpu_layers"] == 0
    assert summary["server_vs_direct"] == pytest.approx(
        summary["server_decode_tokens_per_s"] / summary["direct_decode_tokens_per_s"], rel=1e-2)

    hidden = tmp_path / "hide"  # a llama_cpp that cannot be imported, first on the path
    hidden.mkdir()
    (hidden / "llama_cpp.py").write_text("raise ImportError('hidden for this test')\n")
    proc = subprocess.run(command, cwd=root, env={**env, "PYTHONPATH": f"{hidden}:{root}"}, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["server_decode_tokens_per_s"] > 0 and summary["direct_decode_tokens_per_s"] is None
    assert "llama-cpp-python is not installed" in summary["direct_skipped"]
