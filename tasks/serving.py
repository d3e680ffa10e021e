"""Prefect tasks of serving: blue/green swaps (stage, promote, discard, roll back), their store records, and the
GGUF check before a server starts. The store is ``settings.store_url()``'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction, transaction

from forgeflow.common import errors, settings
from forgeflow.common.fsutil import sha256_file
from forgeflow.evaluation.compare.gate import Decision
from forgeflow.ledger import records, tables
from forgeflow.ledger import store as ledger
from forgeflow.packaging import gguf
from forgeflow.packaging.gguf_metadata import recorded_edited_values
from forgeflow.serving import bluegreen
from forgeflow.serving.backend import BackendConfig, backend_config
from forgeflow.serving.llama_server import ContextPlan
from forgeflow.serving.multimodal import check_projector
from tasks.common import flow_run_id, load_block, run_logger, shared_store


@task(cache_policy=NO_CACHE)
def serving_backend(block_name: str | None, ports: tuple[int, int] | None = None,
                    started_only: bool = False, ports_field: str = "ports") -> BackendConfig:
    """The backend of the ``forgeflow-serving`` block ``block_name``, or the default (llama-cpp-python, 4,096 tokens,
    ports 8801/8802); ``ports`` replace its two ports; ``started_only`` refuses an external endpoint. Raises InputError:
    no such block, an invalid backend, ``ports`` not two distinct ports in 1024..65535 or given for an external endpoint
    (named as ``ports_field``), or ``started_only`` and the block is external."""
    if block_name is None:
        backend = BackendConfig()
    else:
        from blocks.core import ServingBackend

        backend = load_block(ServingBackend, block_name, "serving").config()
    if started_only and backend.kind == "external":
        raise errors.InputError(f"serving block {block_name!r} is kind 'external' ({backend.base_url}): the lifecycle "
                                "serves the GGUFs it makes and needs a server it starts (llama-cpp-python or "
                                "llama-server); use the serve or promote flow for an external endpoint")
    if ports is not None:
        backend = backend_config({**backend.model_dump(), "ports": tuple(ports)}, ports_field)
    run_logger().info("serving backend%s: %s", f" {block_name!r}" if block_name else "", backend.describe())
    return backend


def endpoint_api_key(backend: BackendConfig | None) -> str | None:
    """The key of an external endpoint from its ``api_key_secret`` Secret block, or None. Read inside the task that
    calls the endpoint: never a task parameter, result or log line. Raises InputError: the Secret block does not exist
    or holds an empty value."""
    if backend is None or not backend.api_key_secret:
        return None
    from blocks.core import secret_token

    return secret_token(backend.api_key_secret, "serving api_key_secret").get_secret_value()


@task(cache_policy=NO_CACHE)
def preflight_serving(backend: BackendConfig, n_ctx_train: int | None) -> ContextPlan | None:
    """Before any server starts, the backend's slot plan (capped by the GGUF's ``n_ctx_train``, tokens); None for an
    external endpoint (its ``/props`` tells later). Raises ContextPreflightError: a slot holds fewer tokens than
    ``backend.required_context_tokens``."""
    plan = backend.preflight(n_ctx_train)
    if plan is None:
        run_logger().info("external endpoint: no slot plan before the swap (read from /props if it answers)")
        return None
    run_logger().info("serving plan: %d slot(s) of %d tokens (pool %d%s)", plan.n_parallel, plan.per_slot,
                      plan.n_ctx, ", unified" if plan.kv_unified else "")
    return plan


def record_rollback(result: bluegreen.SwapResult | None, run_id: str | None) -> records.ServingGenerationRecord | None:
    """Record a rolled-back swap (the failed server's port and GGUF) as a ``rolled_back`` generation numbered
    above every recorded one; None when ``result`` names no port and GGUF."""
    if result is None or result.new_port is None or result.new_gguf_sha256 is None:
        return None
    row = shared_store(settings.store_url()).record_rolled_back_swap(result.new_port, result.new_gguf_sha256, run_id)
    run_logger().warning("swap to %s on port %d rolled back: recorded as generation %d (rolled_back); %s",
                      result.new_gguf_sha256[:12], result.new_port, row.generation, result.error or "")
    return row


@task(cache_policy=NO_CACHE)
def model_file_sha256(gguf_path: Path) -> str:
    """The sha256 of the model file to serve (``params.gguf_path``) as it is now (a path's bytes can change). Raises
    InputError: ``gguf_path`` is not a file."""
    if not Path(gguf_path).is_file():
        raise errors.InputError(f"params.gguf_path {str(gguf_path)!r} is not a file")
    return sha256_file(gguf_path)


@task(cache_policy=NO_CACHE)
def check_serving_gguf(gguf_path: Path, gguf_sha256: str, hf_dir: Path | None = None,
                       external: bool = False) -> gguf.GGUFCheck | None:
    """Before any server starts, :func:`forgeflow.packaging.gguf.check_gguf` of the GGUF against ``hf_dir``'s config,
    else the checkpoint the store records it was converted from; keys a recorded metadata edit set are checked against
    the edit. With ``external``, a file that is no GGUF is not checked (None, a warning). Raises GGUFError (an
    InputError): the file is not a readable GGUF, or a key differs from the config (the message names the file, the key,
    the expected and the found value); InputError: ``hf_dir`` is not a folder with a ``config.json``, or none is given
    and the store records no checkpoint (with a ``config.json``) the GGUF was converted from."""
    if external and not _is_gguf(Path(gguf_path)):
        run_logger().warning("%s is not a GGUF: its metadata is not checked against an HF config; the swap records "
                             "its sha256 %s as the served model's", gguf_path, gguf_sha256)
        return None
    store = shared_store(settings.store_url())
    edited = recorded_edited_values(store, gguf_sha256)  # keys the package run's metadata edits set
    if hf_dir is None:
        hf_dir = bluegreen.recorded_config_dir(store, gguf_sha256)
    if hf_dir is None:
        raise errors.InputError(
            f"serve: {gguf_path} (sha256 {gguf_sha256}) cannot be checked against its HF config: the store "
            f"({store.display_url}) records no checkpoint with a config.json it was converted from; give "
            "params.hf_dir (the HF checkpoint folder the GGUF was converted from)")
    elif not Path(hf_dir).is_dir():
        raise errors.InputError(f"params.hf_dir {str(hf_dir)!r} is not a folder")
    check = gguf.check_gguf(gguf_path, hf_dir, edited=edited)
    run_logger().info("%s matches the config of %s (%s, %d blocks, context %d, vocabulary %d)", Path(gguf_path).name,
                   hf_dir, check.architecture, check.block_count, check.context_length, check.vocab_size)
    return check


def _is_gguf(path: Path) -> bool:
    """True when the file starts with the GGUF magic ``GGUF``."""
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def store_min_generation() -> int:
    """One more than the highest serving generation the store records (1 for none): generations are keyed by
    number alone while each state file counts its own, so a swap never reuses another file's number."""
    return shared_store(settings.store_url()).highest_serving_generation() + 1


STAGED_SERVER_KEY = "forgeflow.staged_server"
"""Transaction value holding the staged swap, read by :func:`_stop_staged_server` on rollback."""


@task(cache_policy=NO_CACHE)
def stage_server(state_path: Path, gguf_path: Path, gguf_sha256: str,
                 backend: BackendConfig | None = None) -> bluegreen.SwapResult:
    """Start the GGUF on the idle port of ``backend`` and gate it (health + smoke): the staged swap
    (:func:`forgeflow.serving.bluegreen.stage`; ``current`` the new server); the recorded endpoint moves only in
    :func:`promote_server`. Inside a transaction (:func:`swap_transaction`) a later failure stops it (``on_rollback``).
    An external endpoint is probed and gated, nothing started. Raises InputError: the projector pairing is refused
    (:func:`check_projector_pairing`); SwapRolledBackError: the server did not start or failed its gate (recorded as
    rolled back)."""
    check_projector_pairing(gguf_path, gguf_sha256, backend)
    try:
        staged = bluegreen.stage(state_path, gguf_path, gguf_sha256, backend, endpoint_api_key(backend))
    except errors.SwapRolledBackError as exc:
        record_rollback(exc.result, flow_run_id())
        raise
    for check in staged.checks:
        run_logger().info("%s check %s: %s", check.name, check.status.replace("_", " "), check.detail)
    if staged.gate is not None and staged.gate.image is not None:  # the evidence that the visual path is used
        smoke = staged.gate.image
        run_logger().info("image smoke passed on port %d: the image added %d prompt tokens (%d without, %d with), "
                          "props vision %s", staged.new_port, smoke.image_tokens, smoke.text_prompt_tokens,
                          smoke.image_prompt_tokens, smoke.vision)
    txn = get_transaction()
    if txn is not None:
        txn.set(STAGED_SERVER_KEY, staged.model_dump(mode="json"))
    return staged


def recorded_projector(gguf_sha256: str) -> tuple[bool, str | None]:
    """Whether the store records the GGUF, and the ``mmproj_sha256`` its lineage names (None: text-only, unknown)."""
    producers = shared_store(settings.store_url()).producers(gguf_sha256)
    found = [r.lineage.get("mmproj_sha256") for r in producers if r.lineage.get("mmproj_sha256")]
    return bool(producers), (found[-1] if found else None)


def check_projector_pairing(gguf_path: Path, gguf_sha256: str, backend: BackendConfig | None) -> None:
    """Before a server starts: a GGUF packaged with a projector is served with that projector. Raises InputError: a
    recorded projector is missing from ``backend`` or another file; ``backend.mmproj`` is set for a text-only GGUF, or
    does not fit it (:func:`forgeflow.serving.multimodal.check_projector`)."""
    if backend is None or backend.kind == "external":
        return
    known, recorded = recorded_projector(gguf_sha256)
    if known and recorded is None and backend.mmproj is not None:
        raise errors.InputError(
            f"{Path(gguf_path).name} is a text-only GGUF (packaged without a vision projector) but the serving "
            f"block requires the projector {backend.mmproj}: serve it with a block without mmproj, or package "
            "the image-text-to-text checkpoint")
    if recorded is not None and backend.mmproj is None:
        raise errors.InputError(
            f"{Path(gguf_path).name} was packaged with a vision projector (mmproj sha256 {recorded}) and is served "
            "here without one: set the serving block's mmproj (kind llama-server) to that projector")
    if backend.mmproj is not None:
        check = check_projector(Path(gguf_path), Path(backend.mmproj), recorded)
        run_logger().info("projector %s (%s) fits %s (width %d)%s", check.path.name, check.projector_type,
                          Path(gguf_path).name, check.projection_dim, ", as recorded" if recorded else "")


@stage_server.on_rollback
def _stop_staged_server(txn: Transaction) -> None:
    """Rollback of a swap transaction: stop the staged server (idempotent) and record the swap ``rolled_back``."""
    staged = txn.get(STAGED_SERVER_KEY, None)
    if staged is not None:
        swap = bluegreen.SwapResult.model_validate(staged)
        bluegreen.discard(swap)
        record_rollback(swap.model_copy(update={
            "previous": None, "current": None, "rolled_back": True,
            "error": "a step after staging failed; the staged server was stopped"}), flow_run_id())


@task(cache_policy=NO_CACHE)
def promote_server(state_path: Path, staged: bluegreen.SwapResult) -> bluegreen.SwapResult:
    """Record the staged server (``staged.current``, :func:`stage_server`'s result) as the next generation (above
    every recorded one) and stop the old one."""
    return bluegreen.promote(state_path, staged, store_min_generation())


@task(cache_policy=NO_CACHE)
def discard_server(staged: bluegreen.SwapResult) -> None:
    """Stop a staged server the gates refused; the recorded endpoint never moved."""
    bluegreen.discard(staged)


def swap_transaction(state_path: Path, gguf_path: Path, gguf_sha256: str, backend: BackendConfig | None,
                     gate: Callable[[bluegreen.SwapResult], str]) -> bluegreen.SwapResult:
    """A blue/green swap as one Prefect transaction (call it from a flow): stage, run ``gate`` on the staged swap,
    promote on ``"promote"``, else discard (the result ``rolled_back``, ``current`` the recorded state, ``error``
    naming the gate's verdict). An exception after staging rolls back (the staged server stops, the old one
    keeps serving) and propagates. Raises SwapRolledBackError: the new server did not start or failed its health/smoke
    gate; Whatever ``gate`` raises (after the rollback)."""
    with transaction():
        staged = stage_server(state_path, gguf_path, gguf_sha256, backend)
        verdict = gate(staged)
        if verdict == "promote":
            return promote_server(state_path, staged)
        discard_server(staged)
        recorded = bluegreen.read_state(state_path)
        return staged.model_copy(update={"previous": recorded, "current": recorded, "rolled_back": True,
                                         "error": f"the promotion gate said {verdict!r}"})


@task(cache_policy=NO_CACHE)
def hold_promotion(state_path: Path, decision: Decision, report_path: Path) -> bluegreen.SwapResult:
    """The ``promote`` flow's result when the gate did not say promote: :func:`forgeflow.serving.bluegreen.held`
    (nothing started; the recorded endpoint in ``state_path`` stays)."""
    return bluegreen.held(state_path, decision, report_path)


@task(cache_policy=NO_CACHE)
def record_promotion(outcome: bluegreen.SwapResult, run_id: str | None) -> None:
    """Record a promoted swap (:func:`record_swap`); nothing for one rolled back."""
    if outcome.rolled_back or outcome.current is None:
        return
    record_swap(shared_store(settings.store_url()), outcome.previous, outcome.current, run_id)


@task(cache_policy=NO_CACHE)
def stop_serving(state_path: Path) -> bluegreen.ServingState | None:
    """Stop the server ``state_path`` records; the state it stopped (None: nothing recorded)."""
    return bluegreen.stop_active(state_path)


def generation_row(state: bluegreen.ServingState, status: tables.ServingStatus,
                   run_id: str | None) -> records.ServingGenerationRecord:
    """The ``serving_generations`` row of a serving state with ``status`` and the recording run's id."""
    return records.ServingGenerationRecord(generation=state.generation, port=state.active_port,
                                          gguf_sha256=state.gguf_sha256, status=status, run_id=run_id)


def swap_rows(previous: bluegreen.ServingState | None, current: bluegreen.ServingState,
              run_id: str | None) -> list[records.ServingGenerationRecord]:
    """The rows of a promotion: ``previous`` (another generation) retired, then ``current`` active."""
    retired = ([generation_row(previous, "retired", run_id)]
               if previous is not None and previous.generation != current.generation else [])
    return [*retired, generation_row(current, "active", run_id)]


def record_swap(store: ledger.Store, previous: bluegreen.ServingState | None, current: bluegreen.ServingState,
                run_id: str | None) -> None:
    """Record a promotion in the store: the rows of :func:`swap_rows`."""
    for row in swap_rows(previous, current, run_id):
        store.record_serving_generation(row)


