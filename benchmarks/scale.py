"""The team's scale, measured: ``python -m benchmarks.scale`` prints one JSON line.

It runs each part in its own process (its own ``PREFECT_HOME``, store and memory), reads the JSON line each
part prints last, and prints them together with every goal and whether it was met:

* ``ledger`` (:mod:`benchmarks.scale_ledger`): a store filled with ``--trials`` trials by the product's batched
  writes (trials/s), every user-facing read at that size (seconds and peak RSS of the command alone), and
  trials/s on the curate and canary record paths. Goals: every read <= 2 s and <= 500 MB at 1M trials,
  >= 5,000 trials/s batched.
* ``curate`` (:mod:`benchmarks.scale_curate`): per-candidate orchestration seconds of the real curate flow
  (real store and Prefect, a stand-in sandbox kind chosen by the same block mechanism) against a plain loop
  doing the same reads and writes, at each of ``--sizes``. Goals: <= 1.5x the loop, flat (<= 1.2x) from the
  first size to the last.
* ``agent`` (:mod:`benchmarks.scale_agent`): a ``--steps``-step scripted trajectory of 100K+ tokens through
  forgeflow's agent trial and through mini-swe-agent alone on the same container. Goal: <= 5 % per-step
  overhead.

Issue 34 of the project's tracker states the goals; the figures of each run go in its notes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.options import int_option

PARTS = ("ledger", "curate", "agent")
"""The parts, in the order they run."""

ROOT = Path(__file__).resolve().parents[1]


def part_argv(part: str, args: argparse.Namespace) -> list[str]:
    """The command line of ``part`` (``python -m benchmarks.scale_<part>`` with its options)."""
    options = {"ledger": ["--trials", str(args.trials)], "curate": ["--sizes", args.sizes],
               "agent": ["--steps", str(args.steps)]}[part]
    return [sys.executable, "-m", f"benchmarks.scale_{part}", *options]


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one part in its own process; its JSON line, or ``{"error": ...}`` naming how it failed.

    Its progress lines go to this process's stderr as they come; the last line of its stdout is its result.
    """
    proc = subprocess.run(part_argv(part, args), cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
                          text=True, timeout=args.part_timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    print("\n".join(lines[:-1]), file=sys.stderr, flush=True)
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    if proc.returncode != 0 or not isinstance(result, dict):
        return {"error": f"benchmarks.scale_{part} exited {proc.returncode}; last line: {(lines or [''])[-1][:300]!r}"}
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the parts, print the combined JSON line (the last line) and return it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--trials", type=int_option(1, 10_000_000), default=1_000_000,
                        help="ledger: trials in the store (default 1,000,000)")
    parser.add_argument("--sizes", default="1000,10000", help="curate: candidate counts (default 1000,10000)")
    parser.add_argument("--steps", type=int_option(8, 1000), default=200, help="agent: steps (default 200)")
    parser.add_argument("--part-timeout-s", type=int_option(60, 24 * 3600), default=4 * 3600,
                        help="the longest one part may run, seconds (default 4 hours)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"argument --parts: unknown part(s) {unknown or parts!r}; valid: {', '.join(PARTS)}")
    out: dict[str, Any] = {}
    for part in parts:
        result = run_part(part, args)
        body = {key: value for key, value in result.items() if key != "goals"}
        out[part] = body[part] if list(body) == [part] else body
        if "goals" in result:
            out.setdefault("goals", {})[part] = result["goals"]
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
