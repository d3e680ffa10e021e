"""Blue/green swaps over two ports, with the serving state file."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_write_json, file_lock, sha256_file
from forgeflow.evaluation.compare.gate import Decision
from forgeflow.serving import external
from forgeflow.serving.backend import BackendConfig
from forgeflow.serving.external import EndpointCheck
from forgeflow.serving.health import ServingGateResult, gate
from forgeflow.serving.server import DEFAULT_ALIAS, LOOPBACK_HOST, _is_our_server, _port_is_open, stop_pid

# --- blue/green ------------------------------------------------------------------------------
STATE_SCHEMA_VERSION = 1


class ServingState(BaseModel):
    """The active serving generation, persisted as JSON (see :func:`read_state`)."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = STATE_SCHEMA_VERSION
    generation: int = Field(ge=1,
                            description="1 for the first swap, +1 per successful swap (or more: promote's "
                                        "min_generation keeps numbers unique among several state files).")
    active_port: int = Field(ge=1, le=65535,
                             description="the port the active server listens on (external: the port of base_url).")
    gguf_path: Path = Field(description="the GGUF it serves (external: the model file the user says it serves).")
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="that file's sha256.")
    pid: int | None = Field(default=None, ge=1,
                            description="the server's PID (None after stop_active, and always for an external "
                                        "endpoint).")
    model_alias: str = Field(DEFAULT_ALIAS, description="the model name clients send.")
    base_url: str = Field("", description="http://127.0.0.1:PORT/v1 (external: the block's base_url).")
    started_at: str = Field("", description="UTC time the generation went live (ISO 8601).")
    external: bool = Field(False,
                           description="an endpoint forgeflow did not start (kind=\"external\"): nothing to signal.")
    stopped: bool = Field(False, description="external only: stop_active took it out of use (nothing was killed).")
    api_key_secret: str | None = Field(None,
                                       description="external only: the Prefect Secret block holding its key (a "
                                                   "name, never the key).")

    @property
    def live(self) -> bool:
        """Recorded as serving: a started server with its PID, or an external endpoint not stopped."""
        return not self.stopped if self.external else self.pid is not None


class SwapResult(BaseModel):
    """Outcome of a swap: :func:`swap` / :func:`promote` (the ``serve`` flow's result), a swap behind the promotion
    gate (``decision`` and ``report_path`` set; the ``promote`` flow's result, ``rolled_back`` with nothing started
    when the verdict was not promote), or :func:`stage` alone: a staged swap, whose ``current`` is the new server
    started on the idle port and gated but not yet recorded (its ``generation`` provisional: :func:`promote` numbers
    and records it, :func:`discard` stops it)."""

    model_config = ConfigDict(frozen=True)

    previous: ServingState | None = Field(description="the state before the swap (None on the first deployment).")
    current: ServingState | None = Field(description="the state after it (equal to previous when rolled back; "
                                                     "staged: the new server, not yet recorded).")
    rolled_back: bool = Field(description="True when the new server did not become the recorded endpoint: it "
                                          "failed its start or gate, or the promotion gate's verdict was not "
                                          "promote (it was stopped; the old server serves on).")
    gate: ServingGateResult | None = Field(
        description="the gate evidence of the new server (None if it never started).")
    error: str = Field("", description="why it was rolled back, empty otherwise.")
    decision: Decision | None = Field(None, description="the promotion gate's verdict and reason (None for a swap "
                                                        "without one).")
    report_path: Path | None = Field(None, description="the promotion gate's comparison report (markdown; PNG beside "
                                                       "it); None for a swap without one.")
    new_port: int | None = Field(default=None, ge=1, le=65535,
                                 description="the port the new server was started on (None when unknown).")
    new_gguf_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                        description="sha256 of the GGUF the swap tried to serve (None when "
                                                    "unknown): with new_port what a rolled-back swap is recorded "
                                                    "with in the store.")
    checks: tuple[EndpointCheck, ...] = Field(
        (),
        description="external only: every check of the staged endpoint and whether it ran "
                    "(forgeflow.serving.external.EndpointCheck); empty for a started server.")


def read_state(state_path: Path) -> ServingState | None:
    """Read the serving state file; None if it does not exist.

    Raises:
        InputError: the file exists but is not a valid state.
    """
    path = Path(state_path)
    if not path.exists():
        return None
    try:
        return ServingState.model_validate(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise errors.InputError(f"serving state file {path} is not valid: {exc}") from exc


def _write_state(state_path: Path, state: ServingState) -> None:
    atomic_write_json(state_path, state.model_dump(mode="json"))


def _state_lock(state_path: Path) -> Any:
    """An exclusive advisory lock (``<state>.lock``) so two swaps never interleave."""
    return file_lock(Path(state_path).with_name(Path(state_path).name + ".lock"))


def reap_orphans(log_path: Path, port: int, keep_pid: int | None = None) -> list[int]:
    """Stop the servers a killed swap left on ``port``; returns the PIDs stopped."""
    target = os.path.realpath(log_path)
    stopped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == keep_pid:
            continue
        pid = int(entry.name)
        if not _is_our_server(pid, port):
            continue
        try:
            output = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            continue
        if output == target and stop_pid(pid, port):
            stopped.append(pid)
    return stopped


def _pick_port(state_path: Path, previous: ServingState | None, ports: tuple[int, int]) -> int:
    """The port the new server starts on, after reaping our own orphans there."""
    keep_pid = previous.pid if previous is not None else None
    preferred = ports[1] if previous is not None and previous.active_port == ports[0] else ports[0]
    candidates = [preferred] if keep_pid is not None else [preferred, ports[0] if preferred == ports[1] else ports[1]]
    for port in candidates:
        reap_orphans(Path(state_path).with_name(f"server-{port}.log"), port, keep_pid=keep_pid)
        if keep_pid is not None or not _port_is_open(port):
            return port
    raise errors.InputError(f"ports {list(ports)}: nothing is serving ({state_path}) but both ports are in use "
                            f"by other processes on {LOOPBACK_HOST}; free one or give other ports")


def stage(state_path: Path, new_gguf: Path, gguf_sha256: str, backend: BackendConfig | None = None,
          api_key: str | None = None) -> SwapResult:
    """First half of a blue/green swap: serve ``new_gguf`` on the idle port and gate it.

    Args:
        backend: which server and ports (default llama-cpp-python on 8801/8802); ``kind="external"``: nothing
            starts, the endpoint is probed and gated (:func:`_stage_external`).
        api_key: external only: the key sent to the endpoint; None: no key.

    Returns:
        The staged swap: ``current`` the new server (not recorded; generation provisional), ``gate`` its evidence,
        ``previous`` the state recorded when it was staged.

    Raises:
        InputError: the GGUF is missing or its sha256 differs, or nothing serves and both ports are held.
        ContextPreflightError: ``backend.required_context_tokens`` cannot fit one slot.
        SwapRolledBackError: the new server did not start or failed its gate, ``/props`` or accelerator check
            (it is stopped, the old one still serves); ``.result`` holds the evidence.
    """
    backend = backend or BackendConfig()
    new_gguf = Path(new_gguf).resolve()
    if not new_gguf.is_file():
        raise errors.InputError(f"new_gguf {str(new_gguf)!r} is not a file")
    actual = sha256_file(new_gguf)
    if actual != gguf_sha256:
        raise errors.InputError(f"gguf_sha256 {gguf_sha256!r} does not match {new_gguf} (sha256 {actual})")
    if backend.kind == "external":
        return _stage_external(state_path, new_gguf, gguf_sha256, backend, api_key)
    with _state_lock(state_path):
        previous = read_state(state_path)
    new_port = _pick_port(state_path, previous, backend.ports)
    server = backend.server(new_gguf, new_port, Path(state_path).with_name(f"server-{new_port}.log"))
    gate_result: ServingGateResult | None = None
    try:
        server.start()
        gate_result = gate(server.base_url, backend.model_alias, image=backend.mmproj is not None)
        failure = "" if gate_result.passed else f"gate failed: {gate_result.error}"
    except (errors.InfraError, errors.InputError) as exc:  # start, /props or accelerator check failed
        failure = f"new server did not start: {type(exc).__name__}: {exc}"
    if failure:
        server.stop()
        result = SwapResult(previous=previous, current=previous, rolled_back=True, gate=gate_result, error=failure,
                            new_port=new_port, new_gguf_sha256=gguf_sha256)
        serving_now = ("nothing was serving" if previous is None or previous.pid is None
                       else f"generation {previous.generation} keeps serving")
        raise errors.SwapRolledBackError(
            f"swap to {new_gguf.name} on port {new_port} rolled back ({serving_now}): {failure}",
            result=result,
        )
    staged = _staged_state(previous, new_port, new_gguf, gguf_sha256, backend, pid=server.pid,
                           base_url=server.base_url)
    return SwapResult(previous=previous, current=staged, rolled_back=False, gate=gate_result, new_port=new_port,
                      new_gguf_sha256=gguf_sha256)


def _staged_state(previous: ServingState | None, port: int, model_path: Path, model_sha256: str,
                  backend: BackendConfig, **fields: Any) -> ServingState:
    """The state a staged server would be recorded with (generation: one above ``previous``, provisional)."""
    return ServingState(generation=(previous.generation if previous else 0) + 1, active_port=port,
                        gguf_path=model_path, gguf_sha256=model_sha256, model_alias=backend.model_alias, **fields)


def _stage_external(state_path: Path, model_path: Path, model_sha256: str, backend: BackendConfig,
                    api_key: str | None) -> SwapResult:
    """:func:`stage` for an external endpoint: probe it, then the smoke completion; nothing starts or is recorded."""
    url = str(backend.base_url)
    checks = external.probe(url, backend.model_alias, model_path, model_sha256,
                           required_context_tokens=backend.required_context_tokens, api_key=api_key)
    gate_result = gate(url, backend.model_alias, api_key=api_key)
    with _state_lock(state_path):
        previous = read_state(state_path)
    if not gate_result.passed:
        result = SwapResult(previous=previous, current=previous, rolled_back=True, gate=gate_result,
                            error=f"gate failed: {gate_result.error}", new_port=backend.external_port,
                            new_gguf_sha256=model_sha256)
        raise errors.SwapRolledBackError(f"swap to the external endpoint {url} rolled back (the recorded endpoint "
                                         f"did not move): gate failed: {gate_result.error}", result=result)
    smoke = EndpointCheck(name="smoke", status="passed", detail=f"{gate_result.smoke_tokens} token(s) in "
                          f"{gate_result.latency_s:.2f} s from {url}/chat/completions")
    staged = _staged_state(previous, backend.external_port, model_path, model_sha256, backend, base_url=url,
                           external=True, api_key_secret=backend.api_key_secret)
    return SwapResult(previous=previous, current=staged, rolled_back=False, gate=gate_result,
                      new_port=backend.external_port, new_gguf_sha256=model_sha256, checks=(*checks, smoke))


def promote(state_path: Path, staged: SwapResult, min_generation: int = 1) -> SwapResult:
    """Second half of a swap: record ``staged.current`` (a :func:`stage` result) as the next generation, then stop
    the old server.

    Raises:
        InputError: ``min_generation`` < 1 or ``staged`` holds no staged server (nothing is recorded).
        ServerStartError: the staged server is no longer running (nothing is recorded then).
    """
    if min_generation < 1:
        raise errors.InputError(f"min_generation must be >= 1, got {min_generation}")
    server = staged.current
    if staged.rolled_back or server is None:
        raise errors.InputError("promote needs a staged swap (stage's result), got a rolled-back or empty one")
    with _state_lock(state_path):
        if server.pid is not None and not _is_our_server(server.pid, server.active_port):
            raise errors.ServerStartError(f"staged server pid {server.pid} on port {server.active_port} is gone")
        previous = read_state(state_path)
        current = server.model_copy(update={
            "generation": max((previous.generation if previous else 0) + 1, min_generation),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        })
        _write_state(state_path, current)
        if previous is not None and previous.pid is not None:
            stop_pid(previous.pid, previous.active_port)
        return SwapResult(previous=previous, current=current, rolled_back=False, gate=staged.gate,
                          new_port=server.active_port, new_gguf_sha256=server.gguf_sha256, checks=staged.checks)


def held(state_path: Path, decision: Decision, report_path: Path) -> SwapResult:
    """A promotion the gate did not pass (``decision.verdict`` hold or reject): nothing started, the recorded
    endpoint stays (``previous`` and ``current`` both the state ``state_path`` records), ``rolled_back`` with the
    gate's verdict and reason as the error.

    Raises:
        InputError: the state file exists but is not a valid state.
    """
    with _state_lock(state_path):
        recorded = read_state(state_path)
    return SwapResult(previous=recorded, current=recorded, rolled_back=True, gate=None,
                      error=f"the promotion gate said {decision.verdict!r}: {decision.reason}", decision=decision,
                      report_path=report_path)


def discard(staged: SwapResult) -> None:
    """Roll a staged swap (:func:`stage`'s result) back: stop its server (an external one is left alone); the
    recorded endpoint never changed."""
    server = staged.current
    if not staged.rolled_back and server is not None and server.pid is not None:
        stop_pid(server.pid, server.active_port)


def swap(state_path: Path, new_gguf: Path, gguf_sha256: str, backend: BackendConfig | None = None,
         min_generation: int = 1, api_key: str | None = None) -> SwapResult:
    """Blue/green swap in one call: :func:`stage`, then :func:`promote` (generation + 1, old server stopped).

    Raises:
        InputError: as :func:`stage`, or ``min_generation`` < 1 (checked before anything starts).
        SwapRolledBackError: as :func:`stage`; ``.result`` is the :class:`SwapResult` (``rolled_back`` True).
    """
    if min_generation < 1:
        raise errors.InputError(f"min_generation must be >= 1, got {min_generation}")
    return promote(state_path, stage(state_path, new_gguf, gguf_sha256, backend, api_key), min_generation)


def recorded_config_dir(store: Any, gguf_sha256: str) -> Path | None:
    """The HF checkpoint folder whose ``config.json`` the GGUF ``gguf_sha256`` must match, as the store records
    it (the checkpoint its chain was converted from; the newest production first).

    Returns:
        The folder, or None when the store does not know the GGUF or no recorded path has a config.
    """
    from forgeflow.packaging.lineage import recorded_sources

    for source in recorded_sources(store, gguf_sha256):
        if source.checkpoint_kind in ("base", "merged"):
            checkpoints = [source.checkpoint_sha256]
        elif source.checkpoint_kind == "adapter":
            checkpoints = [p.parent_sha256 for p in store.producers(source.checkpoint_sha256) if p.parent_sha256]
        else:
            continue
        for sha in checkpoints:
            for production in reversed(store.producers(sha)):
                folder = Path(production.path)
                if (folder / "config.json").is_file():
                    return folder
    return None


def stop_active(state_path: Path) -> ServingState | None:
    """Stop the active server by its recorded PID and record it as stopped; an external endpoint is only
    recorded ``stopped``. Returns the state before stopping, or None without a state file."""
    with _state_lock(state_path):
        state = read_state(state_path)
        if state is None:
            return None
        if state.external:
            if not state.stopped:
                _write_state(state_path, state.model_copy(update={"stopped": True}))
        elif state.pid is not None:
            stop_pid(state.pid, state.active_port)
            _write_state(state_path, state.model_copy(update={"pid": None}))
        return state
