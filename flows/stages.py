"""Stage flows that run on their own (from the UI, a schedule or the API), reading their inputs
from the store where the lifecycle left them. Each is a deployment in ``prefect.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from flows.stagekit import run_task
from forgeflow.common import settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.config import LifecycleConfig
from forgeflow.curation.freeze import AcceptedTask, FreezeManifest, SplitQuotas, validate_freeze_name
from forgeflow.evaluation import compare as comparison
from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.ledger import records
from forgeflow.ledger import store as ledger
from forgeflow.packaging.checkpoint import BaseModelSource, CheckpointRecord
from forgeflow.packaging.gguf import GGUFArtifact, QuantSpec, quant_plan
from forgeflow.packaging.gguf_metadata import MetadataEdit, recorded_edited_values, validate_metadata_edits
from forgeflow.packaging.publish import PublishRecord
from forgeflow.packaging.release import ReleaseSources
from forgeflow.serving.external import EndpointCheck
from tasks import curation
from tasks import evaluation as evaluation_tasks
from tasks import packaging as model_tasks
from tasks import packaging as publish_tasks
from tasks import serving as serving_tasks
from tasks.common import record_rows, table_artifact

DEMO_FREEZE_QUOTAS: SplitQuotas = LifecycleConfig().freeze.quotas
"""The demo's freeze quotas (the lifecycle's defaults), the freeze deployment's default."""


@flow(name="freeze", log_prints=True)
def freeze(name: str, quotas: SplitQuotas = DEMO_FREEZE_QUOTAS, seed: int = 0,
           instance_ids: list[str] | None = None, out_dir: Path | None = None) -> FreezeManifest:
    """Freeze the accepted tasks recorded in the store under ``name`` (immutable), with its export
    bundle: a HF ``datasets`` DatasetDict per split (rows: instance id, repository, split,
    FAIL_TO_PASS, PASS_TO_PASS, image reference and digest, patch sha256 — what the store holds)
    and its deterministic tarball, whose sha256 the store records beside the manifest's digests.

    Args:
        name: the freeze name (:func:`forgeflow.curation.freeze.validate_freeze_name`).
        quotas: split minimums, per-repository cap, repositories overall.
        seed: orders the selection (same accepted tasks + seed, same freeze).
        instance_ids: freeze only accepted tasks among these (a curate run's candidates, as the
            freeze-on-ready automation passes them); None: every accepted task in the store.
        out_dir: where the manifest and bundle are written; default ``$FORGEFLOW_HOME/freezes``.

    The manifest's ``inputs`` pin each task's image: ``image_digests`` (instance id -> manifest digest)
    for every task whose image the store records (the lifecycle runs this flow as its freeze stage).

    Returns:
        The manifest, with ``bundle_path`` and ``bundle_sha256`` of the bundle's tarball.

    Raises:
        InputError: an invalid name, or ``instance_ids`` given but empty.
        PreflightError: the quotas are not met (each unmet quota is named).
        FreezeConflictError: ``name`` exists with different content.
    """
    validate_freeze_name(name)
    if instance_ids is not None and not instance_ids:
        raise InputError(f"freeze {name!r}: instance_ids is empty (None freezes every accepted task)")
    bundle_tasks = curation.accepted_for_freeze(instance_ids)
    accepted = [AcceptedTask(instance_id=t.instance_id, repo=t.repo) for t in bundle_tasks]
    get_run_logger().info("freeze %r: %d accepted task(s)%s; quotas %s, seed %d", name, len(accepted),
                          f" among {len(set(instance_ids))} candidates" if instance_ids is not None else "",
                          quotas.model_dump(), seed)
    image_digests = {t.instance_id: t.image_digest for t in bundle_tasks if t.image_digest}
    manifest = run_task(curation.freeze_dataset, name, accepted, quotas, seed, out_dir or home_dir() / "freezes",
                        {"image_digests": image_digests} if image_digests else {}, bundle_tasks)
    record_rows(settings.store_url(), "freezes", [records.FreezeRecord(
        name=manifest.name, semantic_sha256=manifest.semantic_sha256, file_sha256=manifest.file_sha256,
        manifest_path=str(manifest.path), counts=manifest.counts, bundle_sha256=manifest.bundle_sha256,
        bundle_path=str(manifest.bundle_path) if manifest.bundle_path else None,
        run_id=str(flow_run.get_id() or "") or None)])
    return manifest


@flow(name="compare", log_prints=True)
def compare(job_a: str, job_b: str, report_path: Path | None = None, merge_recovery: bool = True,
            seed: int = 0, gate: GatePolicy | None = None) -> comparison.PairedComparison:
    """Paired comparison of two canary jobs recorded in the store, on the same frozen split.

    Writes the markdown report (wins/ties/losses, exact McNemar, the delta interval — Newcombe's
    paired interval united with the repository-clustered bootstrap —, excluded tasks with reasons,
    cost ratios and the promotion gate's verdict under ``gate``'s settings, default
    :class:`forgeflow.evaluation.compare.gate.GatePolicy`; each job merged with its recovery jobs unless
    ``merge_recovery`` is False, and said so) and beside it a PNG (pass rates with Wilson
    intervals, wins/losses per repository) that the report and the markdown artifact show.

    Raises:
        InputError: a job has no trials in the store, or the jobs ran different frozen splits.
    """
    md_path = Path(report_path or home_dir() / f"compare-{job_a}-vs-{job_b}.md")
    result = evaluation_tasks.compare_stored(job_a, job_b, md_path, merge_recovery, seed, gate)
    paired = result.paired
    get_run_logger().info("wins %d ties %d losses %d, McNemar p %.3g; excluded %d; promotion gate: %s (%s); report %s",
                          paired.wins, paired.ties, paired.losses, paired.mcnemar_p, len(result.excluded),
                          result.decision.verdict, result.decision.reason, md_path)
    return paired


class PackageResult(BaseModel):
    """What the ``package`` flow made: the checked GGUFs, and the release when it published one.

    Attributes:
        artifacts: the GGUFs by artifact key (``f16`` and each quantization's
            :attr:`forgeflow.packaging.gguf.QuantSpec.key`), each checked against the HF config and loaded.
        published: the release record (:class:`forgeflow.packaging.publish.PublishRecord`) when the flow
            published (``publish``); None otherwise.
    """

    model_config = ConfigDict(frozen=True)

    artifacts: dict[str, GGUFArtifact]
    published: PublishRecord | None = None


@flow(name="package", log_prints=True)
def package(hf_dir: Path, out_dir: Path, quantizations: tuple[str | QuantSpec, ...] = ("Q8_0", "Q4_K_M"),
            adapter_dir: Path | None = None, publish: str | None = None, publish_quantization: str | None = None,
            model_name: str = "forgeflow",
            metadata_edits: list[MetadataEdit | dict[str, Any]] | None = None,
            publish_checkpoint: bool = False) -> PackageResult:
    """Merge (optional adapter) -> GGUF f16 -> quantize -> metadata check -> load [-> metadata edits ->
    verify -> check -> load] [-> publish].

    ``quantizations`` is the quantization plan: names of :data:`forgeflow.packaging.gguf.QUANT_PLANS`
    (``Q8_0``, ``Q4_K_M``, ``Q4_K_M+attn-embd-output-Q8_0``: attention, embedding and output at Q8_0,
    the rest Q4_K_M, as the hand-run pipeline served) and/or specs ``{"preset": "Q4_K_M",
    "tensor_types": {regex: ggml type}, "name": ...}``; each mixed artifact is checked tensor by
    tensor after quantization. The result is keyed by :attr:`forgeflow.packaging.gguf.QuantSpec.key`.

    ``metadata_edits`` fixes GGUF metadata as the hand-run pipeline patched it: a list of
    ``{"op": "set"|"add"|"delete", "key": ..., "value": ..., "type": <GGUFValueType name, optional>,
    "sub_type": <ARRAY element type>, "artifacts": [<artifact keys>, optional]}``
    (:class:`forgeflow.packaging.gguf_metadata.MetadataEdit`), e.g. ``[{"op": "set", "key":
    "tokenizer.chat_template", "value": "..."}, {"op": "set", "key": "general.name", "value": "agent-v3"},
    {"op": "add", "key": "forgeflow.release", "value": "3", "type": "STRING"}, {"op": "delete", "key":
    "general.url"}]``. A ``set`` keeps the stored type unless ``type`` is given; an ``add`` without
    ``type`` infers it as gguf-py does (int INT32, float FLOAT32). After every artifact passed its check
    and loaded, the edits are applied to each GGUF they name (all, f16 included, by default) in one
    bounded-memory pass (:func:`forgeflow.packaging.gguf_metadata.apply_metadata_edits`; tensor infos,
    untouched entries and sampled tensor data verified against the source), then the GGUF check (edited
    keys against their edits) and the load run again on the edited file. The store records the edited
    file's sha256 with ``lineage`` = ``{"edited_from_sha256": ..., "metadata_edits": [...]}``.

    With ``publish`` (the name of a ModelStore block: local directory or HF Hub), the GGUF of
    ``publish_quantization`` (default: the first of ``quantizations``) and its
    ``<stem>.lineage.json`` are published once every artifact passed the GGUF check and loaded
    (:func:`tasks.packaging.publish_gguf`), with the merged adapter's files (``adapter/``) and,
    with ``publish_checkpoint``, the checkpoint the GGUF was converted from (``checkpoint/``: the
    merged one when an adapter was merged); the result's ``published`` is then the record.

    The run shows the artifacts as a table artifact (``package``: key, path, size, sha256). The
    lifecycle's base-model and package stages run this flow.

    Every artifact is recorded in the store as the lifecycle's package stage records it
    (:func:`tasks.packaging.record_package`: the merged checkpoint from the adapter, the f16 GGUF from the
    checkpoint it was converted from, each quantized GGUF from the f16 one, with this flow run's
    id), so ``forgeflow lineage`` lists this run as their producer; the base checkpoint ``hf_dir`` and
    the adapter are recorded too when the store does not know them yet.

    Raises:
        InputError: before any compute: the store block is missing or inconsistent, or
            ``publish_quantization`` is not among the artifacts this run makes, an unknown
            quantization plan name or preset, repeated artifact keys, an invalid metadata edit
            (``metadata_edits[i] (key ...)``: unknown op, empty key, a value that does not fit its
            type, a repeated key, a delete of a key the architecture needs such as
            ``general.architecture``, an unknown artifact key).
        GGUFError: a GGUF fails its check, or an edit does not fit the file (a set/delete of an
            absent key, an add of a present one); nothing is published.
    """
    from forgeflow.common.fsutil import sha256_tree

    keys = [spec.key for spec in quant_plan(quantizations)]  # refused before any compute
    edits = validate_metadata_edits(metadata_edits, ("f16", *keys))
    target = _publish_preflight(publish, publish_quantization or (keys[0] if keys else "f16"),
                                ("f16", *keys)) if publish else None
    inputs = model_tasks.package_inputs(hf_dir, adapter_dir)
    artifacts = run_task(model_tasks.package, hf_dir, inputs.hf_sha256, out_dir, tuple(quantizations), adapter_dir,
                         inputs.adapter_tree_sha256, edits)
    model_tasks.record_packaged(artifacts, hf_dir, adapter_dir, inputs, Path(out_dir),
                                str(flow_run.get_id() or "") or None)
    table_artifact("package", [{"type": q, "path": str(a.path), "size_bytes": a.size_bytes, "sha256": a.sha256}
                               for q, a in artifacts.items()], f"GGUF artifacts of {hf_dir}"
                   + (f" merged with the adapter {adapter_dir}" if adapter_dir else ""))
    if publish and target:
        art = artifacts[target]
        source = Path(out_dir) / "merged" if adapter_dir else Path(hf_dir)  # what the GGUF was converted from
        sources = ReleaseSources(hf_sha256=sha256_tree(source), adapter_dir=adapter_dir,
                                 checkpoint_dir=source if publish_checkpoint else None)
        record = publish_tasks.publish_gguf(publish, art.path, art.sha256, art.type, model_name, sources,
                                            art.tensor_types, str(flow_run.get_id() or ""))
        return PackageResult(artifacts=artifacts, published=record)
    return PackageResult(artifacts=artifacts)


def _publish_preflight(store_block: str, quantization: str, produced: tuple[str, ...]) -> str:
    """Fail before compute when the store block or the quantization to publish cannot work."""
    if quantization not in produced:
        raise InputError(f"publish_quantization {quantization!r} is not one of the artifacts {list(produced)}")
    publish_tasks.load_model_store(store_block)
    return quantization


@flow(name="publish", log_prints=True)
def publish(gguf_path: Path, store: str, hf_dir: Path, adapter_dir: Path | None = None,
            model_name: str = "forgeflow", include_checkpoint: bool = False) -> PublishRecord:
    """Publish a GGUF the package stage wrote (e.g. once the promotion gate chose it) to a model store.

    The GGUF is checked against ``hf_dir`` again (:func:`forgeflow.packaging.gguf.check_gguf`; keys the store
    records a ``package`` run's metadata edits set on it against those edits) before anything is sent; its
    ``<stem>.lineage.json`` names ``hf_dir``'s digest and, with ``adapter_dir``, the adapter's lineage.

    Args:
        gguf_path: the GGUF.
        store: name of a ModelStore block.
        hf_dir: the HF checkpoint the GGUF was converted from (the merged one when an adapter was merged).
        adapter_dir: the adapter merged into it, if any (its files are published with the GGUF,
            under ``adapter/``).
        model_name: the model's name in a local store.
        include_checkpoint: publish ``hf_dir`` itself too (under ``checkpoint/``, every file
            sha256-verified like the GGUF): the release then holds the weights the GGUF came from.

    When the store (the ledger) knows the GGUF, ``hf_dir`` must be the checkpoint its recorded chain
    was converted from and ``adapter_dir`` the adapter merged into it (required when the chain has
    one; :func:`forgeflow.packaging.lineage.check_release_sources`), checked before anything is written or
    sent: the GGUF metadata check cannot tell a LoRA-merged checkpoint from its base. When the
    store does not know the GGUF, it is published as given and a warning says the lineage was not
    cross-checked.

    Raises:
        InputError: the store block is missing or inconsistent; ``gguf_path``/``hf_dir`` is missing;
            ``hf_dir``/``adapter_dir`` is not what the store records the GGUF was converted from.
        GGUFError: the check failed.
    """
    from forgeflow.common.fsutil import sha256_file, sha256_tree
    from forgeflow.packaging.lineage import check_release_sources

    publish_tasks.load_model_store(store)
    if not Path(gguf_path).is_file():
        raise InputError(f"gguf_path {str(gguf_path)!r} is not a file")
    if not Path(hf_dir).is_dir():
        raise InputError(f"hf_dir {str(hf_dir)!r} is not a folder")
    if adapter_dir is not None and not Path(adapter_dir).is_dir():
        raise InputError(f"adapter_dir {str(adapter_dir)!r} is not a folder")
    gguf_sha, hf_sha = sha256_file(gguf_path), sha256_tree(hf_dir)
    ledger_store = ledger.Store()
    ledger_store.upgrade()
    if check_release_sources(ledger_store, gguf_sha, hf_sha, Path(hf_dir), adapter_dir) is None:
        get_run_logger().warning("the store (%s) does not know GGUF %s: its lineage (hf_dir %s, adapter_dir %s) "
                                 "could not be cross-checked", ledger_store.display_url, gguf_sha, hf_dir, adapter_dir)
    edited = recorded_edited_values(ledger_store, gguf_sha)  # keys the package run's metadata edits set
    check = publish_tasks.check_release(gguf_path, gguf_sha, hf_dir, hf_sha, edited or None)
    get_run_logger().info("%s passed the GGUF check against %s (%s, %d blocks, vocabulary %d)", Path(gguf_path).name,
                          hf_dir, check.file_type, check.block_count, check.vocab_size)
    sources = ReleaseSources(hf_sha256=hf_sha, adapter_dir=adapter_dir,
                             checkpoint_dir=Path(hf_dir) if include_checkpoint else None)
    return publish_tasks.publish_gguf(store, gguf_path, gguf_sha, check.file_type, model_name, sources, None,
                                      str(flow_run.get_id() or ""))


@flow(name="serve", log_prints=True)
def serve(gguf_path: Path, state_path: Path | None = None, ports: tuple[int, int] | None = None,
          hf_dir: Path | None = None, serving_block: str | None = None) -> serving_tasks.SwapOutcome:
    """Blue/green swap of the serving endpoint to ``gguf_path`` (check, gate, switch, stop the old one).

    Before any server starts, the GGUF's metadata is checked against its HF config
    (:func:`tasks.serving.check_serving_gguf`, the package stage's check): the config of ``hf_dir``,
    or by default of the checkpoint the store records the GGUF was converted from. A GGUF that fails
    is refused with the file and the mismatching key named, and nothing starts.

    The endpoint is the state file ``state_path`` (default ``$FORGEFLOW_HOME/serving/state.json``,
    the one the ``canary`` flow reads by default). A promotion is recorded in the store as the
    lifecycle records its swaps (:func:`tasks.serving.record_swap`): the new generation active, the
    one it replaced retired, with this flow run's id; ``forgeflow status`` and ``forgeflow lineage``
    read it from there. A swap whose new server fails to start or gate is recorded as a
    ``rolled_back`` generation (numbered above every generation, so numbers stay unique; the state
    file and the old server are untouched).

    With an external endpoint (a block of ``kind="external"``: vLLM, a llama-server the team runs, a
    hosted API) nothing starts or stops: ``gguf_path`` is the model file the user says the endpoint
    serves, and its sha256 is the ``model_sha256`` recorded (in the state file and the store, what the
    canary and ``promote`` compare against). A GGUF is checked against its HF config as above; another
    file (e.g. the checkpoint a vLLM endpoint loaded) is not, and ``checks`` says so. The endpoint must
    list ``model_alias`` on ``/models`` and answer a smoke completion; if it answers llama-server's
    ``/props``, the file it loaded and its per-slot context are checked too; the result's ``checks``
    name each check and whether it ran (the accelerator check never does).

    Args:
        gguf_path: the GGUF to serve (external: the model file the endpoint serves; required).
        state_path: the serving state file.
        ports: the two blue/green ports on 127.0.0.1 (default: the serving backend's, 8801/8802).
        hf_dir: the HF checkpoint folder (``config.json``) the GGUF was converted from; default: the one
            the store records for it.
        serving_block: a ``forgeflow-serving`` block (:class:`blocks.core.ServingBackend`): which
            server (llama-cpp-python, or llama-server with slots, KV cache type and GPU offload),
            context, alias; default: llama-cpp-python with a 4,096-token context. Its slot plan is
            checked against ``required_context_tokens`` and the GGUF's training context before any
            server starts. ``kind="external"``: the endpoint at the block's ``base_url`` is used instead.

    Returns:
        :class:`tasks.serving.SwapOutcome` (``promoted``, ``verdict``, ``state``: the endpoint now
        recorded, ``previous``, ``checks``: external endpoints' checks, each ``passed``, ``partial`` or
        ``not_run``). The lifecycle's ``serve_baseline`` stage runs this flow.

    Raises:
        InputError: ``gguf_path`` is not a file, no config to check it against (no ``hf_dir`` and the
            store records none), ``ports`` are not two distinct ports, ``serving_block`` does not exist
            or is not a valid backend, or nothing serves and both ports are held by other processes.
        ContextPreflightError: a slot of the backend cannot hold ``required_context_tokens`` (nothing
            started).
        GGUFError: the GGUF is unreadable or differs from its config (nothing started).
        SwapRolledBackError: the new server did not start or failed its gate, ``/props`` (llama-server:
            another file, a smaller slot) or its accelerator check (the old one serves on; the attempt
            is recorded as ``rolled_back``); external: its smoke completion failed.
        PreflightError: external: the endpoint does not answer (the URL named; nothing recorded).
        InputError: external: it answered 401/403, does not list ``model_alias``, or its ``/props``
            names another model file (the URL named; nothing recorded).
    """
    from forgeflow.common.fsutil import sha256_file

    if not Path(gguf_path).is_file():
        raise InputError(f"gguf_path {str(gguf_path)!r} is not a file")
    backend = serving_tasks.serving_backend(serving_block, tuple(ports) if ports is not None else None)
    gguf_sha256 = sha256_file(gguf_path)
    check = serving_tasks.check_serving_gguf(gguf_path, gguf_sha256, hf_dir, external=backend.kind == "external")
    serving_tasks.preflight_serving(backend, check.context_length if check is not None else None)
    outcome = serving_tasks.swap_transaction(state_path or home_dir() / "serving" / "state.json", gguf_path,
                                             gguf_sha256, backend, lambda staged: "promote")
    serving_tasks.record_promotion(outcome, str(flow_run.get_id() or "") or None)
    if backend.kind == "external":
        metadata = (EndpointCheck(name="gguf_metadata", status="not_run", detail=f"{gguf_path} is not a GGUF")
                    if check is None else EndpointCheck(name="gguf_metadata", status="passed",
                                                        detail=f"{Path(gguf_path).name} matches its HF config"))
        outcome = outcome.model_copy(update={"checks": (metadata, *outcome.checks)})
    return outcome


@flow(name="base-model", log_prints=True)
def base_model(source: BaseModelSource, hub_dir: Path | None = None) -> CheckpointRecord:
    """Check the team's base checkpoint and record it in the store as a ``base`` artifact.

    ``source`` is a local folder (used in place) or an HF Hub repository at a revision (fetched with
    ``huggingface_hub.snapshot_download`` at the commit the revision resolves to now, token from
    the Secret block ``source.token_secret``). The record (path, sha256 over every file, parameter
    count, provenance: repo id, revision, commit) is what ``package`` (its ``hf_dir``) and the
    lifecycle's ``base_model`` take; ``forgeflow lineage <sha256>`` shows it as a root.

    Args:
        source: where the checkpoint is (:class:`forgeflow.packaging.checkpoint.BaseModelSource`;
            the tiny model is the lifecycle's own default, not a source for this flow).
        hub_dir: where Hub snapshots go; default ``$FORGEFLOW_HOME/models/hub``.

    Raises:
        InputError: no source given (the tiny model), the folder is not an HF checkpoint (each
            missing piece named), the repository/revision does not exist or the token is refused,
            the Secret block is missing.
        TransientInfraError: the Hub did not answer after retries.
    """
    if source.kind == "tiny":
        raise InputError("base-model: give source.local_dir or source.repo_id + source.revision")
    record = run_task(model_tasks.base_checkpoint, source, hub_dir or home_dir() / "models" / "hub")
    provenance = record.provenance
    record_rows(settings.store_url(), "model_artifacts", [records.ModelArtifactRecord(
        sha256=record.sha256, kind="base", path=str(record.path), lineage=provenance,
        run_id=str(flow_run.get_id() or "") or None)])
    get_run_logger().info("base model %s: sha256 %s, %d parameters (%s)", record.path, record.sha256,
                          record.num_parameters, ", ".join(f"{k}={v}" for k, v in provenance.items()))
    return record
