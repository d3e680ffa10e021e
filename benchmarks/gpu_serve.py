"""Benchmark: decode speed of a quantized GGUF served by ``llama-server`` with GPU offload vs
llama-cpp-python called directly, on the same file and the same greedy continuation length.

``python -m benchmarks.gpu_serve [--gguf PATH] [--tokens 256] [--cpu] [--build]``

* **GGUF**: ``--gguf``, else ``$FORGEFLOW_GPU_GGUF``, else ``build/gpu-check/tiny-q8_0.gguf`` (what
  ``benchmarks/gpu_check.sh --prepare --with-gguf`` copies there, to carry to the GPU machine), else the tiny Q8_0
  test fixture under ``cache_dir()/test-fixtures`` (``tests/integration/test_serving.py``).
* **served**: :class:`forgeflow.serving.backend.LlamaServer` with ``n_gpu_layers=99`` (every layer; the
  server is refused if its load log does not report them offloaded); the binary is
  ``$FORGEFLOW_LLAMA_SERVER`` or the cached CUDA build of :func:`forgeflow.serving.llama_server
  .ensure_llama_server` (``gpu=True``). Without either, ``--build`` builds it from the pinned sdist
  (CMake + CUDA toolkit; several minutes, more than the 8-minute GPU check leaves, and the sdist must be
  in the cache on an offline machine), otherwise the served part is skipped with the reason.
  Decode speed: the server's own ``timings.predicted_per_second`` and the client-side rate of the
  streamed tokens (first to last token, HTTP included).
* **direct**: ``llama_cpp.Llama(n_gpu_layers=99)`` in this process, streamed; decode speed = tokens
  after the first / time from the first to the last token. ``direct_gpu_offload`` says whether this
  llama-cpp-python build can offload at all (``llama_supports_gpu_offload``; a CPU-only wheel runs on
  the CPU whatever ``n_gpu_layers`` says).

The end-of-sequence token is suppressed (``ignore_eos`` for the server, a -inf logit bias directly),
so both generate exactly ``--tokens`` tokens. ``--cpu`` sets ``n_gpu_layers=0`` (a smoke test on a
machine without a GPU). Human lines first, then as the last line one JSON object:
``server_decode_tokens_per_s``, ``server_client_tokens_per_s``, ``direct_decode_tokens_per_s``,
``direct_gpu_offload``, ``server_offloaded_layers`` and ``server_skipped`` (None or the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
"""A short code prompt (what a coding agent sends); only the decode phase is timed."""


def find_gguf(explicit: str | None) -> Path | None:
    """The GGUF to serve: the argument, ``$FORGEFLOW_GPU_GGUF``, the carried copy, the test fixture."""
    from forgeflow.common.settings import cache_dir

    candidates = [explicit, os.environ.get("FORGEFLOW_GPU_GGUF"), "build/gpu-check/tiny-q8_0.gguf",
                  str(cache_dir() / "test-fixtures" / "tiny-seed0" / "tiny-q8_0.gguf")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def find_server(gpu: bool, build: bool) -> tuple[Path | None, str | None]:
    """(llama-server binary, None) or (None, why there is none)."""
    from forgeflow.common import errors
    from forgeflow.serving.llama_server import (
        BINARY_ENV,
        build_dir,
        ensure_llama_server,
    )

    cached = build_dir(gpu) / "bin" / "llama-server"
    if os.environ.get(BINARY_ENV) or cached.is_file() or build:
        try:
            return ensure_llama_server(gpu=gpu), None
        except errors.ForgeflowError as exc:
            return None, f"llama-server unavailable: {type(exc).__name__}: {str(exc)[:500]}"
    return None, (f"no llama-server binary (set ${BINARY_ENV}, or pass --build to compile the "
                  f"{'CUDA ' if gpu else ''}build from the pinned sdist into {cached.parent.parent})")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def direct_decode(gguf: Path, n_gpu_layers: int, tokens: int) -> dict[str, Any]:
    """Greedy streamed decode of ``tokens`` tokens with llama-cpp-python in this process.

    Returns:
        ``tokens``, ``decode_tokens_per_s`` (after the first token), ``gpu_offload`` (build capability).
    """
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_gpu_layers=n_gpu_layers, n_ctx=tokens + 256, verbose=False,
                          seed=0)
    try:
        bias = {llm.token_eos(): float("-inf")}
        llm.create_completion(PROMPT, max_tokens=8, temperature=0.0, logit_bias=bias)  # warm-up
        stamps = []
        for chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, logit_bias=bias, stream=True):
            if chunk["choices"][0].get("finish_reason") is None:  # one chunk per token; the last one only ends
                stamps.append(time.perf_counter())
    finally:
        llm.close()
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"tokens": len(stamps), "decode_tokens_per_s": rate,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}


def served_decode(gguf: Path, binary: Path, n_gpu_layers: int, tokens: int, log_dir: Path) -> dict[str, Any]:
    """Greedy decode of ``tokens`` tokens through llama-server's ``/completion`` (streamed, ignore_eos).

    Returns:
        ``tokens``, ``decode_tokens_per_s`` (the server's ``timings.predicted_per_second``),
        ``client_tokens_per_s`` (streamed chunks after the first / first-to-last time), ``offloaded``.
    """
    import httpx

    from forgeflow.serving.backend import BackendConfig, LlamaServer

    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
    config = BackendConfig(kind="llama-server", model_alias="bench", n_ctx=tokens + 512, n_gpu_layers=n_gpu_layers,
                           binary=binary)
    with LlamaServer(gguf, _free_port(), config, log_path=log_dir / "llama-server.log") as server:
        root = server.base_url.removesuffix("/v1")
        with httpx.Client(timeout=120) as client:
            client.post(f"{root}/completion", json={**body, "n_predict": 8}).raise_for_status()  # warm-up
            stamps, timings = [], {}
            with client.stream("POST", f"{root}/completion", json={**body, "stream": True}) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("content"):
                        stamps.append(time.perf_counter())
                    timings = chunk.get("timings") or timings
        offloaded = server.offload
    client_rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"tokens": int(timings.get("predicted_n", len(stamps))),
            "decode_tokens_per_s": float(timings.get("predicted_per_second", 0.0)),
            "client_tokens_per_s": client_rate, "offloaded": list(offloaded) if offloaded else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the served and the direct decode and print the comparison (last line: one JSON object)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="the GGUF to serve (default: see the module docstring)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens to decode per measurement")
    parser.add_argument("--cpu", action="store_true", help="n_gpu_layers=0 (smoke test without a GPU)")
    parser.add_argument("--build", action="store_true", help="build llama-server (CUDA unless --cpu) if missing")
    parser.add_argument("--log-dir", default="build/gpu-check", help="where the server log goes")
    args = parser.parse_args(argv)

    ngl = 0 if args.cpu else 99
    summary: dict[str, Any] = {"server_decode_tokens_per_s": None, "server_client_tokens_per_s": None,
                               "direct_decode_tokens_per_s": None, "direct_gpu_offload": None,
                               "server_offloaded_layers": None, "server_skipped": None, "n_gpu_layers": ngl}
    gguf = find_gguf(args.gguf)
    if gguf is None:
        summary["server_skipped"] = summary["direct_skipped"] = (
            "no GGUF: pass --gguf, set FORGEFLOW_GPU_GGUF, or run benchmarks/gpu_check.sh --prepare --with-gguf "
            "where the "
            "tiny model's GGUF is cached and carry build/gpu-check/")
        print(summary["server_skipped"], flush=True)
        print(json.dumps(summary), flush=True)
        return summary
    summary["gguf"], summary["gguf_bytes"] = str(gguf), gguf.stat().st_size
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    binary, why = find_server(gpu=not args.cpu, build=args.build)
    if binary is None:
        summary["server_skipped"] = why
        print(f"served part skipped: {why}", flush=True)
    else:
        served = served_decode(gguf, binary, ngl, args.tokens, log_dir)
        summary.update(server_decode_tokens_per_s=round(served["decode_tokens_per_s"], 1),
                       server_client_tokens_per_s=round(served["client_tokens_per_s"], 1),
                       server_offloaded_layers=served["offloaded"], server_tokens=served["tokens"])
        print(f"llama-server ({binary}), {ngl} GPU layers requested, offloaded {served['offloaded']}: "
              f"{served['decode_tokens_per_s']:,.0f} decode tokens/s (server timing), "
              f"{served['client_tokens_per_s']:,.0f} tokens/s streamed to the client", flush=True)
    try:
        import llama_cpp  # noqa: F401,PLC0415
    except ImportError as exc:
        summary["direct_skipped"] = f"llama-cpp-python is not installed in this Python ({exc})"
        print(f"direct part skipped: {summary['direct_skipped']}", flush=True)
        print(json.dumps(summary), flush=True)
        return summary
    direct = direct_decode(gguf, ngl, args.tokens)
    summary.update(direct_decode_tokens_per_s=round(direct["decode_tokens_per_s"], 1),
                   direct_gpu_offload=direct["gpu_offload"], direct_tokens=direct["tokens"])
    print(f"llama-cpp-python direct ({'GPU offload' if direct['gpu_offload'] else 'CPU-only build'}): "
          f"{direct['decode_tokens_per_s']:,.0f} decode tokens/s", flush=True)
    if summary["server_decode_tokens_per_s"] and direct["decode_tokens_per_s"]:
        summary["server_vs_direct"] = round(summary["server_decode_tokens_per_s"] / direct["decode_tokens_per_s"], 3)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
