"""Blue/green swaps over two ports, with the serving state file.

:func:`swap` (or :func:`stage` then :func:`promote` / :func:`discard`): the new GGUF starts on the
idle port, is gated (:func:`forgeflow.serving.health.gate`), and only then becomes the active
generation in the state file (written atomically, under a lock); the old server is stopped by its
recorded PID. A failed start or gate stops the new server, leaves the state file and the old server
untouched and raises :class:`~forgeflow.common.errors.SwapRolledBackError` carrying the gate
evidence.

An external endpoint (``BackendConfig(kind="external")``) is never started or stopped: :func:`stage`
probes it (:func:`forgeflow.serving.external.probe`) and gates it, :func:`promote` re-points the state
file to it (``external`` True, no PID) and stops the old server only if forgeflow started it, and
:func:`stop_active` marks an external generation ``stopped`` without signalling anything.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_write_json, file_lock, sha256_file
from forgeflow.serving import external
from forgeflow.serving.backend import BackendConfig
from forgeflow.serving.external import EndpointCheck
from forgeflow.serving.health import ServingGateResult, gate
from forgeflow.serving.server import DEFAULT_ALIAS, LOOPBACK_HOST, _is_our_server, _port_is_open, stop_pid

# --- blue/green ------------------------------------------------------------------------------
STATE_SCHEMA_VERSION = 1


class ServingState(BaseModel):
    """The active serving generation, persisted as JSON (see :func:`read_state`).

    Attributes:
        generation: 1 for the first swap, +1 per successful swap (or more: :func:`promote`'s
            ``min_generation`` keeps numbers unique among several state files).
        active_port: the port the active server listens on (external: the port of ``base_url``).
        gguf_path: the GGUF it serves (external: the model file the user says it serves).
        gguf_sha256: that file's sha256.
        pid: the server's PID (None after :func:`stop_active`, and always for an external endpoint).
        model_alias: the model name clients send.
        base_url: ``http://127.0.0.1:PORT/v1`` (external: the block's ``base_url``).
        started_at: UTC time the generation went live (ISO 8601).
        external: an endpoint forgeflow did not start (``kind="external"``): nothing to signal.
        stopped: external only: :func:`stop_active` took it out of use (nothing was killed).
        api_key_secret: external only: the Prefect Secret block holding its key (a name, never the key).
    """

    model_config = ConfigDict(frozen=True)

    schema_version: int = STATE_SCHEMA_VERSION
    generation: int = Field(ge=1)
    active_port: int = Field(ge=1, le=65535)
    gguf_path: Path
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    pid: int | None = Field(default=None, ge=1)
    model_alias: str = DEFAULT_ALIAS
    base_url: str = ""
    started_at: str = ""
    external: bool = False
    stopped: bool = False
    api_key_secret: str | None = None

    @property
    def live(self) -> bool:
        """Recorded as serving: a started server with its PID, or an external endpoint not stopped."""
        return not self.stopped if self.external else self.pid is not None


class SwapResult(BaseModel):
    """Outcome of :func:`swap`.

    Attributes:
        previous: the state before the swap (None on the first deployment).
        current: the state after it (equal to ``previous`` when rolled back).
        rolled_back: True when the new server failed its start or gate.
        gate: the gate evidence of the new server (None if it never started).
        error: why it was rolled back, empty otherwise.
        new_port: the port the new server was started on (None when unknown).
        new_gguf_sha256: sha256 of the GGUF the swap tried to serve (None when unknown): with
            ``new_port`` what a rolled-back swap is recorded with in the store.
    """

    model_config = ConfigDict(frozen=True)

    previous: ServingState | None
    current: ServingState | None
    rolled_back: bool
    gate: ServingGateResult | None
    error: str = ""
    new_port: int | None = Field(default=None, ge=1, le=65535)
    new_gguf_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


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


class StagedServer(BaseModel):
    """A new server started on the idle port and gated, not yet the recorded endpoint.

    Attributes:
        port / pid / base_url: where it answers (pid None for an external endpoint).
        gguf_path / gguf_sha256: what it serves.
        model_alias: the model name clients send.
        gate: the health + smoke evidence.
        external: an endpoint forgeflow did not start (never stopped by :func:`discard`).
        api_key_secret: external only: the Secret block holding its key (a name).
        checks: external only: every check and whether it ran
            (:class:`forgeflow.serving.external.EndpointCheck`); empty for a started server.
    """

    model_config = ConfigDict(frozen=True)

    port: int
    pid: int | None
    base_url: str
    gguf_path: Path
    gguf_sha256: str
    model_alias: str
    gate: ServingGateResult
    external: bool = False
    api_key_secret: str | None = None
    checks: tuple[EndpointCheck, ...] = ()


def reap_orphans(log_path: Path, port: int, keep_pid: int | None = None) -> list[int]:
    """Stop the servers a killed swap left on ``port`` (kill -9 between starting the new server and
    recording it, or between recording it and stopping the old one).

    A process is stopped (:func:`stop_pid`) only if it is a server of ours on ``port``
    (:func:`_is_our_server`), is not ``keep_pid`` (the recorded active server) and writes its
    output to ``log_path`` (``/proc/<pid>/fd/1``): a server another state file started on the same
    port is left alone.

    Args:
        log_path: the log file :func:`stage` gives servers on ``port`` (``server-<port>.log``
            beside the state file).
        port: the port about to be used.
        keep_pid: a PID never to stop.

    Returns:
        The PIDs stopped (empty when nothing was left behind).
    """
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
    """The port the new server starts on, after reaping our own orphans there (:func:`reap_orphans`).

    While a server is recorded as live, the idle port (the one it does not use); it must be free
    then (a busy one makes the start fail and the swap roll back). When nothing is serving (no
    state, or its server stopped), the idle port is preferred, and if another process holds it,
    the other port is used instead.

    Raises:
        InputError: nothing is serving and both ports are held by other processes (named); nothing
            was started.
    """
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
          api_key: str | None = None) -> StagedServer:
    """First half of a blue/green swap: serve ``new_gguf`` on the idle port and gate it.

    The recorded endpoint does not change, so callers can run more gates (canary tasks, the
    promotion gate) against ``StagedServer.base_url`` before :func:`promote` or :func:`discard`.

    Args:
        state_path: the serving state file.
        new_gguf: the GGUF to serve.
        gguf_sha256: its sha256 (checked against the file before anything starts).
        backend: which server, on which two ports, with which context and slots
            (:class:`forgeflow.serving.backend.BackendConfig`; default llama-cpp-python on 8801/8802);
            ``kind="external"``: nothing starts, the endpoint is probed and gated (:func:`_stage_external`).
        api_key: external only: the key sent to the endpoint (read from ``backend.api_key_secret`` by
            the caller); None: no key.

    Raises:
        InputError: the GGUF is missing or its sha256 differs from ``gguf_sha256``, or nothing is
            serving and both ports are held by other processes (a busy idle port alone makes it use
            the other one when nothing is serving, see :func:`_pick_port`); ContextPreflightError:
            ``backend.required_context_tokens`` cannot fit one slot (checked before anything starts).
        SwapRolledBackError: the new server did not start, failed its gate, its ``/props`` or its
            accelerator check (it is stopped; the old server still serves); ``.result`` holds the evidence.
        PreflightError / InputError / ContextPreflightError: external only, see :func:`_stage_external`.
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
    return StagedServer(port=new_port, pid=server.pid, base_url=server.base_url, gguf_path=new_gguf,
                        gguf_sha256=gguf_sha256, model_alias=backend.model_alias, gate=gate_result)


def _stage_external(state_path: Path, model_path: Path, model_sha256: str, backend: BackendConfig,
                    api_key: str | None) -> StagedServer:
    """:func:`stage` for an external endpoint: probe it (:func:`forgeflow.serving.external.probe`),
    then the health gate's smoke completion; nothing is started and nothing is recorded.

    Raises:
        PreflightError: the endpoint does not answer ``/models`` (URL named).
        InputError: 401/403, ``model_alias`` not listed, or ``/props`` names another model file.
        ContextPreflightError: ``/props`` reports slots smaller than ``required_context_tokens``.
        SwapRolledBackError: the smoke completion failed (``.result`` holds the gate evidence; the
            recorded endpoint did not move).
    """
    url = str(backend.base_url)
    found = external.probe(url, backend.model_alias, model_path, model_sha256,
                           required_context_tokens=backend.required_context_tokens, api_key=api_key)
    gate_result = gate(url, backend.model_alias, api_key=api_key)
    if not gate_result.passed:
        with _state_lock(state_path):
            previous = read_state(state_path)
        result = SwapResult(previous=previous, current=previous, rolled_back=True, gate=gate_result,
                            error=f"gate failed: {gate_result.error}", new_port=backend.external_port,
                            new_gguf_sha256=model_sha256)
        raise errors.SwapRolledBackError(f"swap to the external endpoint {url} rolled back (the recorded endpoint "
                                         f"did not move): gate failed: {gate_result.error}", result=result)
    smoke = EndpointCheck(name="smoke", status="passed", detail=f"{gate_result.smoke_tokens} token(s) in "
                          f"{gate_result.latency_s:.2f} s from {url}/chat/completions")
    return StagedServer(port=backend.external_port, pid=None, base_url=url, gguf_path=model_path,
                        gguf_sha256=model_sha256, model_alias=backend.model_alias, gate=gate_result, external=True,
                        api_key_secret=backend.api_key_secret, checks=(*found.checks, smoke))


def promote(state_path: Path, staged: StagedServer, min_generation: int = 1) -> SwapResult:
    """Second half of a swap: record ``staged`` as the next generation, then stop the old server.

    The new generation is the state file's generation + 1 (1 without a state file), raised to
    ``min_generation`` when that is larger: callers that share generation numbers among several
    state files (the store's ``serving_generations``) pass one more than the highest number used
    anywhere, so a number is never given twice.

    Args:
        state_path: the serving state file.
        staged: the server :func:`stage` started and gated.
        min_generation: the lowest generation number the new generation may get (>= 1).

    An external ``staged`` (no PID) is recorded as it is (``external`` True); the old server is stopped
    only when it has a PID (forgeflow started it), so external -> external just re-points the state.

    Raises:
        InputError: ``min_generation`` < 1 (nothing is recorded).
        ServerStartError: the staged server is no longer running (nothing is recorded then).
    """
    if min_generation < 1:
        raise errors.InputError(f"min_generation must be >= 1, got {min_generation}")
    with _state_lock(state_path):
        if staged.pid is not None and not _is_our_server(staged.pid, staged.port):
            raise errors.ServerStartError(f"staged server pid {staged.pid} on port {staged.port} is gone")
        previous = read_state(state_path)
        current = ServingState(
            generation=max((previous.generation if previous else 0) + 1, min_generation),
            active_port=staged.port,
            gguf_path=staged.gguf_path,
            gguf_sha256=staged.gguf_sha256,
            pid=staged.pid,
            model_alias=staged.model_alias,
            base_url=staged.base_url,
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            external=staged.external,
            api_key_secret=staged.api_key_secret,
        )
        _write_state(state_path, current)
        if previous is not None and previous.pid is not None:
            stop_pid(previous.pid, previous.active_port)
        return SwapResult(previous=previous, current=current, rolled_back=False, gate=staged.gate,
                          new_port=staged.port, new_gguf_sha256=staged.gguf_sha256)


def discard(staged: StagedServer) -> None:
    """Roll a staged server back: stop it (an external one is left alone); the recorded endpoint never changed."""
    if staged.pid is not None:
        stop_pid(staged.pid, staged.port)


def swap(state_path: Path, new_gguf: Path, gguf_sha256: str, backend: BackendConfig | None = None,
         min_generation: int = 1, api_key: str | None = None) -> SwapResult:
    """Blue/green swap in one call: :func:`stage` (start on the idle port of ``backend.ports``, gate)
    then :func:`promote` (record generation + 1, at least ``min_generation``, and stop the old server
    by its recorded PID).
    ``api_key`` goes to an external endpoint (see :func:`stage`).

    Returns:
        SwapResult with ``rolled_back`` False.

    Raises:
        InputError: as :func:`stage`, or ``min_generation`` < 1 (checked before anything starts).
        SwapRolledBackError: the new server did not start or failed its gate; ``.result`` holds the
            :class:`SwapResult` (``rolled_back`` True, gate evidence) and the old server still serves.
    """
    if min_generation < 1:
        raise errors.InputError(f"min_generation must be >= 1, got {min_generation}")
    return promote(state_path, stage(state_path, new_gguf, gguf_sha256, backend, api_key), min_generation)


def recorded_config_dir(store: Any, gguf_sha256: str) -> Path | None:
    """The HF checkpoint folder whose ``config.json`` the GGUF ``gguf_sha256`` must match, as the store
    records it: the checkpoint its recorded chain was converted from (a base model or a merged one;
    for a chain whose merged checkpoint was not recorded, the adapter's base, whose config a LoRA merge
    keeps), at a recorded path that still holds a ``config.json`` (the newest production first).

    Args:
        store: a :class:`forgeflow.ledger.store.Store`.
        gguf_sha256: the GGUF's full hex sha256.

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
    """Stop the active server by its recorded PID and record it as stopped (``pid`` None). An external
    endpoint is never signalled (it has no PID of ours): it is recorded as ``stopped`` (out of use).

    Returns:
        The state before stopping, or None if there is no state file.
    """
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
