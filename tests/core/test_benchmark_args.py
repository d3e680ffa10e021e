"""The benchmark command lines refuse bad options before doing any work.

Each case runs ``python -m benchmarks.X`` from the repository root, as a user would, and checks
what the user sees: exit code 2, one argparse-style line naming the option and the bad value, no
traceback, and a quick return (no registry, Prefect server or synthetic file was started first).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK_S = 20.0
"""Argument checks run before any work; the interpreter and imports take a few seconds at most."""


def _run(module: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    return proc, time.monotonic() - started


CASES = [
    ("benchmarks.registry", ["--registry-latency-ms", "nan"], "--registry-latency-ms", "nan"),
    ("benchmarks.registry", ["--registry-latency-ms", "inf"], "--registry-latency-ms", "inf"),
    ("benchmarks.registry", ["--registry-latency-ms", "-1"], "--registry-latency-ms", "-1"),
    ("benchmarks.registry", ["--registry-latency-ms", "10001"], "--registry-latency-ms", "10001"),
    ("benchmarks.registry", ["--shards", "0"], "--shards", "0"),
    ("benchmarks.registry", ["--shards", "-1"], "--shards", "-1"),
    ("benchmarks.registry", ["--lanes", "0"], "--lanes", "0"),
    ("benchmarks.registry", ["--shards", "3", "--lanes", "4"], "--lanes", "4"),
    ("benchmarks.registry", ["--sized-mb", "0"], "--sized-mb", "0"),
    ("benchmarks.registry", ["--images", "0"], "--images", "0"),
    ("benchmarks.registry", ["--rounds", "-2"], "--rounds", "-2"),
    ("benchmarks.gguf_check", ["--repeats", "0"], "--repeats", "0"),
    ("benchmarks.gguf_check", ["--gguf", "/nonexistent.gguf", "--hf-dir", "/tmp"], "--gguf", "/nonexistent.gguf"),
    ("benchmarks.gguf_edit", ["--size-gb", "nan"], "--size-gb", "nan"),
    ("benchmarks.gguf_edit", ["--size-gb", "inf"], "--size-gb", "inf"),
    ("benchmarks.gguf_edit", ["--size-gb", "0"], "--size-gb", "0"),
    ("benchmarks.gguf_edit", ["--size-gb", "5000"], "--size-gb", "5000"),
    ("benchmarks.gguf_edit", ["--dir", "/nonexistent/x"], "--dir", "/nonexistent/x"),
    ("benchmarks.gguf_edit", ["--dir", "/etc/hostname"], "--dir", "/etc/hostname"),
    ("benchmarks.gguf_edit", ["--repeats", "0"], "--repeats", "0"),
    ("benchmarks.gguf_edit", ["--size-gb", "999"], "--size-gb", "999"),  # more than /tmp can hold (3.2x)
    ("benchmarks.curation", ["--repeats", "0"], "--repeats", "0"),
    ("benchmarks.curation", ["--repeats", "-1"], "--repeats", "-1"),
    ("benchmarks.curation", ["--concurrency", "0"], "--concurrency", "0"),
    ("benchmarks.curation", ["--flow-per-project", "-1"], "--flow-per-project", "-1"),
    ("benchmarks.curation", ["--flow-per-project", "0"], "--flow-per-project", "0"),
    ("benchmarks.curation", ["--seed", "-5"], "--seed", "-5"),
    ("benchmarks.trial", ["--per-project", "0"], "--per-project", "0"),
    ("benchmarks.trial", ["--concurrency", "99"], "--concurrency", "99"),
    ("benchmarks.dispatch", ["--repeats", "0"], "--repeats", "0"),
    ("benchmarks.dispatch", ["--per-project", "x"], "--per-project", "x"),
    ("benchmarks.scale", ["--parts", "ledger,gpu"], "--parts", "gpu"),
    ("benchmarks.scale", ["--trials", "0"], "--trials", "0"),
    ("benchmarks.scale", ["--steps", "3"], "--steps", "3"),
    ("benchmarks.scale_ledger", ["--trials", "0"], "--trials", "0"),
    ("benchmarks.scale_curate", ["--sizes", "5"], "--sizes", "5"),
    ("benchmarks.scale_agent", ["--steps", "x"], "--steps", "x"),
]


@pytest.fixture(scope="module")
def refusals() -> dict[tuple[str, tuple[str, ...]], tuple[subprocess.CompletedProcess[str], float]]:
    """Each case's process and its seconds, the cases run four at a time (each its own interpreter, as a
    user starts it; a case's seconds are its own process's)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {(module, tuple(args)): pool.submit(_run, module, *args) for module, args, _, _ in CASES}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize(("module", "args", "option", "value"), CASES,
                         ids=[f"{m.split('.')[1]}{' '.join(a)}" for m, a, _, _ in CASES])
def test_bad_option_exits_2_naming_it(module: str, args: list[str], option: str, value: str,
                                      refusals: dict) -> None:
    proc, elapsed = refusals[(module, tuple(args))]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, proc.stderr
    assert option in error_lines[0] and value in error_lines[0], error_lines
    assert proc.stdout == ""  # no benchmark line was printed: nothing ran
    assert elapsed < QUICK_S, f"{module} took {elapsed:.1f} s to refuse {args}"


def test_curation_concurrency_zero_starts_no_work() -> None:
    """--concurrency 0 is refused before any Prefect home or store is created."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("forgeflow-bench-flow-*"))
    proc, _ = _run("benchmarks.curation", "--concurrency", "0")
    assert proc.returncode == 2
    assert set(tmp.glob("forgeflow-bench-flow-*")) <= before
