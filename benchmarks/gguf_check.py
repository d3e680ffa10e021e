"""Benchmark: the GGUF check the serve and package flows run (:func:`forgeflow.packaging.gguf.check_gguf`, which
reads the header with :mod:`forgeflow.packaging.gguf_reader`) vs gguf-py's ``GGUFReader`` opening the same file,
which is what the check did before (it parses every vocabulary token into arrays).

``python -m benchmarks.gguf_check [--gguf PATH --hf-dir DIR] [--repeats 3]``: by default the seed-0 tiny model's
Q8_0 GGUF (a real Qwen2 vocabulary of 151,936 tokens), built once under the cache; ``--gguf``/``--hf-dir`` name a
team's GGUF and the checkpoint it was converted from. Times are medians over ``--repeats`` rounds, each running
both in turn (seconds, in this process). Prints human lines, then one JSON object as the last line: ``gguf``,
``check_s``, ``gguf_reader_s``, ``time_vs_gguf_reader`` (check / GGUFReader; the target is <= 0.1) and ``repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TARGET_RATIO = 0.1
"""The check must take at most a tenth of what opening the file with GGUFReader takes (it reads no token)."""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_check", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the tiny model's Q8_0)")
    parser.add_argument("--hf-dir", type=Path, help="the checkpoint --gguf was converted from (config.json)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (>= 1)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if (args.gguf is None) != (args.hf_dir is None):
        parser.error("--gguf and --hf-dir go together")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf} is not a file")
    if args.hf_dir is not None and not (args.hf_dir / "config.json").is_file():
        parser.error(f"--hf-dir {args.hf_dir} holds no config.json")
    return args


def _tiny() -> tuple[Path, Path]:
    """The seed-0 tiny model's Q8_0 GGUF and its checkpoint, built once under the cache."""
    from tests.helpers import tiny_ggufs

    q8 = tiny_ggufs()[0]
    return q8, q8.parent / "hf"


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; return (and print last) its JSON summary."""
    args = _args(argv)
    from gguf import GGUFReader

    from forgeflow.packaging.gguf import check_gguf

    gguf, hf_dir = (args.gguf, args.hf_dir) if args.gguf is not None else _tiny()
    check_times, reader_times = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        check = check_gguf(gguf, hf_dir)
        check_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        GGUFReader(str(gguf))
        reader_times.append(time.perf_counter() - started)
    check_s, reader_s = statistics.median(check_times), statistics.median(reader_times)
    print(f"{gguf} ({check.vocab_size} tokens): check_gguf {check_s:.3f} s, GGUFReader {reader_s:.3f} s")
    summary = {"gguf": str(gguf), "check_s": round(check_s, 4), "gguf_reader_s": round(reader_s, 4),
               "time_vs_gguf_reader": round(check_s / reader_s, 4), "target": TARGET_RATIO, "repeats": args.repeats}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
