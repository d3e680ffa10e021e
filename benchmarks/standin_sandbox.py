"""An instant stand-in for the trial container, for the scale benchmark (``benchmarks/scale_curate.py``).

A ``forgeflow-sandbox`` block of kind :data:`KIND` makes every NOP/Oracle trial of a curate run answer
at once, without a container: the verifier's wrapped test command gets back what pytest with forgeflow's
report plugin prints (its records on the nonce'd channel, the tripwires, pytest's summary line), so the
trial runner, grading, the flaky repeat and every store write run as they do on podman; only the
container's own cost (~0.15 s per ``podman run``) is left out. A NOP run
(bug present) fails ``t::f2p``; an Oracle run (bug reverted) passes both tests: every candidate is
accepted with FAIL_TO_PASS ``["t::f2p"]`` and PASS_TO_PASS ``["t::p2p"]``.

It lives here, outside the product: :func:`install` adds the kind through the product's registration
hook (:func:`forgeflow.sandbox.backends.register_backend`), in this process (the curate flow's
validations run in this process's task-runner threads).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from forgeflow.sandbox.base import ExecResult

KIND = "bench-instant"
"""The sandbox backend kind this module registers."""

GOOD = {"t::f2p": "PASSED", "t::p2p": "PASSED"}
BUGGY = {"t::f2p": "FAILED", "t::p2p": "PASSED"}

_PHASE = {"PASSED": ("call", "passed"), "FAILED": ("call", "failed")}


def _channel_stdout(nonce: str, run: dict[str, str], repeats: int) -> str:
    """What pytest with forgeflow's plugin prints for ``run`` repeated ``repeats`` times (one report per
    test and repetition, the tripwires in the first, the session end, then pytest's summary line)."""
    wires = {f"/tmp/w.py::test_forgeflow_must_pass_{nonce}": "PASSED",
             f"/tmp/w.py::test_forgeflow_must_fail_{nonce}": "FAILED"}
    every = {**run, **wires}
    records: list[dict[str, Any]] = [{"kind": "start", "sys_path": ["/testbed"], "modules": {}},
                                     {"kind": "collected", "ids": list(every)}]
    counts: dict[str, int] = {}
    for rep, statuses in enumerate([every] + [run] * (repeats - 1)):
        for nodeid, status in statuses.items():
            when, outcome = _PHASE[status]
            records.append({"kind": "report", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": False,
                            "rep": rep, "duration_s": 0.01})
            counts[outcome] = counts.get(outcome, 0) + 1
    records.append({"kind": "end", "exitstatus": 1, "verbosity": 0})
    lines = "".join(f"\n@forgeflow-verifier-{nonce} " + json.dumps({"seq": i, **r}) + "\n"
                    for i, r in enumerate(records))
    summary = ", ".join(f"{n} {word}" for word, n in counts.items())
    return f"collected {len(every)} items\n{lines}==== {summary} in 0.05s ====\n"


class InstantSandbox:
    """One trial's stand-in container (the :class:`forgeflow.sandbox.base.Sandbox` protocol): ``start`` /
    ``write_file`` / ``stop`` do nothing; ``exec`` of the verifier's test command answers at once."""

    def __init__(self, image: str, spec: object = None, name: str | None = None, **_: object) -> None:
        self.image, self.name = image, name or ""
        self.oracle = self.name.startswith("ff-oracle")

    def start(self) -> None:
        """Nothing to start."""

    def write_file(self, path: str, content: str) -> None:
        """Nothing is written (the Oracle's patch is taken as reverted)."""

    def stop(self) -> None:
        """Nothing to stop."""

    def stop_async(self) -> Callable[[], None]:
        """Nothing to wait for: a no-op."""
        return lambda: None

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None,
             env: dict[str, str] | None = None) -> ExecResult:
        """A setup command (a list: ``git apply -R``, ``rm``) succeeds; the verifier's wrapped test command
        gets the plugin's channel for GOOD (Oracle) or BUGGY (NOP), repeated as it asks."""
        nonce = re.search(r'FORGEFLOW_VERIFIER_NONCE="([0-9a-f]+)"', command) if isinstance(command, str) else None
        if nonce is None:
            return ExecResult(exit_code=0, stdout="", stderr="", duration_s=0.0)
        repeat = re.search(r'FORGEFLOW_VERIFIER_REPEAT="(\d+)"', command)
        stdout = _channel_stdout(nonce.group(1), GOOD if self.oracle else BUGGY, int(repeat.group(1)) if repeat else 1)
        return ExecResult.from_bytes(1, stdout.encode(), b"", 0.0)


def install() -> str:
    """Register :data:`KIND` (idempotent in one process); returns the kind."""
    from forgeflow.sandbox.backends import BACKENDS, register_backend

    if KIND not in BACKENDS:
        register_backend(KIND, lambda target: InstantSandbox)
    return KIND
