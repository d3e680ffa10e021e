"""Small helpers shared by the tests: a free loopback port, a live-process check, the tiny GGUFs."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state != "Z"


def tiny_ggufs() -> tuple[Path, Path]:
    """(Q8_0, f16) GGUFs of the seed-0 tiny model, built once per machine under the cache."""
    from forgeflow.gguf import convert_to_gguf, quantize
    from forgeflow.model import build_tiny_model
    from forgeflow.settings import cache_dir

    root = cache_dir() / "test-fixtures" / "tiny-seed0"
    f16, q8 = root / "tiny-f16.gguf", root / "tiny-q8_0.gguf"
    if not (f16.is_file() and q8.is_file()):
        record = build_tiny_model(root / "hf", seed=0)
        convert_to_gguf(record.path, f16, outtype="f16")
        quantize(f16, q8, "Q8_0")
    return q8, f16
