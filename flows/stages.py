"""Stage flows that run on their own (from the UI, a schedule or the API), reading their inputs
from the store where the lifecycle left them. Each is a deployment in ``prefect.yaml``, takes one
parameter model (``params``, a :class:`flows.stagekit.StageParams`: :class:`FreezeParams`,
:class:`CompareParams`, :class:`PackageParams`, :class:`PublishParams`, :class:`ServeParams`,
:class:`BaseModelParams`) and returns one typed result; the lifecycle runs the same flows as subflows.
File digests and store reads happen in tasks (:mod:`tasks.packaging`, :mod:`tasks.serving`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flows.stagekit import StageParams, run_task
from forgeflow.common import settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.config import LifecycleConfig
from forgeflow.curation.freeze import AcceptedTask, FreezeManifest, SplitQuotas, validate_freeze_name
from forgeflow.evaluation import compare as comparison
from forgeflow.evaluation.compare.gate import Decision, GatePolicy
from forgeflow.ledger import records
from forgeflow.packaging.checkpoint import BaseModelSource, CheckpointRecord
from forgeflow.packaging.gguf import GGUFArtifact, QuantSpec, quant_plan
from forgeflow.packaging.gguf_metadata import MetadataEdit, validate_metadata_edits
from forgeflow.packaging.mmproj import MMPROJ_KEY
from forgeflow.packaging.publish import PublishRecord, check_model_name
from forgeflow.packaging.release import ReleaseSources
from forgeflow.serving.backend import BackendConfig, backend_config
from forgeflow.serving.external import EndpointCheck
from tasks import curation
from tasks import evaluation as evaluation_tasks
from tasks import packaging as model_tasks
from tasks import packaging as publish_tasks
from tasks import serving as serving_tasks
from tasks.common import record_rows, table_artifact

DEMO_FREEZE_QUOTAS: SplitQuotas = LifecycleConfig().freeze.quotas
"""The demo's freeze quotas (the lifecycle's defaults), the freeze deployment's default."""


def _param_error(exc: InputError, field: str) -> InputError:
    """``exc`` with its message naming ``params.<field>`` (a core check names the bare field or a value)."""
    message = str(exc)
    return type(exc)(f"params.{message}" if message.startswith(field) else f"params.{field}: {message}")


ModelName = Annotated[str, AfterValidator(check_model_name)]
"""A model's name in a local store: refused when the parameters are validated (``params.model_name``), before
anything is packaged, if it is not one path component (:func:`forgeflow.packaging.publish.check_model_name`)."""

class FreezeParams(StageParams):
    """The ``freeze`` flow's parameters (the freeze deployment's defaults are the demo's).

    Attributes:
        name: the freeze name (:func:`forgeflow.curation.freeze.validate_freeze_name`); a freeze is immutable.
        quotas: split minimums (tasks), the per-repository cap (tasks) and repositories overall.
        seed: orders the selection (same accepted tasks + seed, same freeze).
        instance_ids: freeze only accepted tasks among these (a curate run's candidates); None: every
            accepted task in the store.
        candidate_set: a curate run's candidate set, as the freeze-on-ready automation passes it (a
            reference: its ids are read from the store and checked against its digest); not with
            ``instance_ids``.
        out_dir: where the manifest and bundle are written; None: ``$FORGEFLOW_HOME/freezes``.
    """

    name: str = Field("demo-v1", description="the freeze name: lower-case letters, digits, '.', '_', '-', at most "
                                             "128 characters; an existing name with other content is refused")
    quotas: SplitQuotas = Field(DEMO_FREEZE_QUOTAS, description="split minimums (tasks), the per-repository cap "
                                                                "(tasks) and the minimum number of repositories")
    seed: int = Field(0, description="orders the selection: the same accepted tasks and seed give the same freeze")
    instance_ids: tuple[str, ...] | None = Field(
        None, description="freeze only accepted tasks among these instance ids (a curate run's candidates); "
                          "None: every accepted task in the store")
    candidate_set: str | None = Field(
        None, pattern=r"^candidates-[0-9a-f]{32}$", description="a curate run's candidate set (candidates-<32 hex>, "
        "as its freeze-ready event names it): freeze only accepted tasks among its ids; not with instance_ids")
    out_dir: Path | None = Field(None, description="folder for the manifest and bundle; None: "
                                                   "$FORGEFLOW_HOME/freezes")


@flow(name="freeze", log_prints=True)
def freeze(params: FreezeParams = FreezeParams()) -> FreezeManifest:
    """Freeze the accepted tasks recorded in the store under ``params.name`` (immutable), with its export
    bundle: a HF ``datasets`` DatasetDict per split (rows: instance id, repository, split,
    FAIL_TO_PASS, PASS_TO_PASS, image reference and digest, patch sha256 — what the store holds)
    and its deterministic tarball, whose sha256 the store records beside the manifest's digests.

    The manifest's ``inputs`` pin each task's image: ``image_digests`` (instance id -> manifest digest)
    for every task whose image the store records (the lifecycle runs this flow as its freeze stage).

    Args:
        params: the freeze's name, split quotas, seed and the accepted tasks it draws from.

    Returns:
        The manifest, with ``bundle_path`` and ``bundle_sha256`` of the bundle's tarball.

    Raises:
        InputError: an invalid name, ``params.instance_ids`` given but empty, both it and
            ``params.candidate_set``, or a candidate set the store does not hold (or whose ids do not
            match its digest).
        PreflightError: the quotas are not met (each unmet quota is named).
        FreezeConflictError: ``params.name`` exists with different content.
    """
    name, quotas, seed, instance_ids = params.name, params.quotas, params.seed, params.instance_ids
    try:
        validate_freeze_name(name)
    except InputError as exc:
        raise _param_error(exc, "name") from None
    if params.candidate_set is not None:
        if instance_ids is not None:
            raise InputError(f"freeze {name!r}: give params.instance_ids or params.candidate_set, not both")
        instance_ids = tuple(curation.candidate_set_ids(params.candidate_set))
    if instance_ids is not None and not instance_ids:
        raise InputError(f"freeze {name!r}: params.instance_ids is empty (None freezes every accepted task)")
    bundle_tasks = curation.accepted_for_freeze(list(instance_ids) if instance_ids is not None else None)
    accepted = [AcceptedTask(instance_id=t.instance_id, repo=t.repo) for t in bundle_tasks]
    given = f" among the {len(set(instance_ids))} instance id(s) given" if instance_ids is not None else ""
    get_run_logger().info("freeze %r: %d accepted task(s)%s; quotas %s, seed %d", name, len(accepted), given,
                          quotas.model_dump(), seed)
    image_digests = {t.instance_id: t.image_digest for t in bundle_tasks if t.image_digest}
    manifest = run_task(curation.freeze_dataset, name, accepted, quotas, seed, params.out_dir or home_dir() / "freezes",
                        {"image_digests": image_digests} if image_digests else {}, bundle_tasks)
    record_rows(settings.store_url(), "freezes", [records.FreezeRecord(
        name=manifest.name, semantic_sha256=manifest.semantic_sha256, file_sha256=manifest.file_sha256,
        manifest_path=str(manifest.path), counts=manifest.counts, bundle_sha256=manifest.bundle_sha256,
        bundle_path=str(manifest.bundle_path) if manifest.bundle_path else None,
        run_id=str(flow_run.get_id() or "") or None)])
    return manifest


class CompareParams(StageParams):
    """The ``compare`` flow's parameters.

    Attributes:
        job_a: the first canary job (the baseline), as recorded in the store.
        job_b: the second canary job (the candidate), on the same frozen split.
        report_path: the markdown report (its PNG beside it); None: ``$FORGEFLOW_HOME/compare-<a>-vs-<b>.md``.
        merge_recovery: merge each job's recovery jobs into it before comparing.
        seed: the repository-clustered bootstrap's seed.
        gate: the promotion gate's settings; None: :class:`~forgeflow.evaluation.compare.gate.GatePolicy`'s defaults.
    """

    job_a: str = Field(description="the first (baseline) canary job id, as recorded in the store")
    job_b: str = Field(description="the second (candidate) canary job id, on the same frozen split")
    report_path: Path | None = Field(None, description="markdown report path (PNG beside it); None: "
                                                       "$FORGEFLOW_HOME/compare-<job_a>-vs-<job_b>.md")
    merge_recovery: bool = Field(True, description="merge each job's recovery jobs into it before comparing")
    seed: int = Field(0, description="seed of the repository-clustered bootstrap (same seed, same interval)")
    gate: GatePolicy | None = Field(None, description="promotion gate settings; None: the defaults (30 pairs "
                                                      "from 3 repositories, 5 points of tolerated drop, alpha 0.05)")


class CompareResult(BaseModel):
    """What the ``compare`` flow found and wrote.

    Attributes:
        job_a / job_b: the two jobs compared (merged with their recovery jobs when asked: see the labels).
        paired: wins/ties/losses, exact McNemar and the delta interval.
        decision: the promotion gate's verdict under the run's gate settings.
        report_a / report_b: each job's accounting (scored, passed, exceptions, pass rate).
        costs: mean input tokens, agent steps and wall seconds over the pairs, ratios B / A.
        excluded: instances left out of the pairs, with reasons.
        files: the markdown report and its PNG, with their sha256.
    """

    model_config = ConfigDict(frozen=True)

    job_a: comparison.MergedJob
    job_b: comparison.MergedJob
    paired: comparison.PairedComparison
    decision: Decision
    report_a: comparison.JobReport
    report_b: comparison.JobReport
    costs: comparison.CostComparison
    excluded: list[comparison.ExcludedTask]
    files: evaluation_tasks.ComparisonFiles


@flow(name="compare", log_prints=True)
def compare(params: CompareParams) -> CompareResult:
    """Paired comparison of two canary jobs recorded in the store, on the same frozen split.

    Writes the markdown report (wins/ties/losses, exact McNemar, the delta interval — Newcombe's
    paired interval united with the repository-clustered bootstrap —, excluded tasks with reasons,
    cost ratios and the promotion gate's verdict under ``params.gate``'s settings, default
    :class:`forgeflow.evaluation.compare.gate.GatePolicy`; each job merged with its recovery jobs unless
    ``params.merge_recovery`` is False, and said so) and beside it a PNG (pass rates with Wilson
    intervals, wins/losses per repository) that the report and the markdown artifact show.

    The comparison is cached on what it reads from the store (``tasks.evaluation.compare_stored_jobs``);
    the report, plot and artifact are written on every run. The lifecycle's compare stage runs this
    flow as a subflow on its two canary jobs.

    Args:
        params: the two jobs to compare (baseline, candidate), the report path, the seed and the gate policy.

    Returns:
        :class:`CompareResult`: the comparison, the gate's decision, and the files with their digests.

    Raises:
        InputError: a job has no trials in the store, or the jobs ran different frozen splits.
    """
    job_a, job_b = params.job_a, params.job_b
    md_path = Path(params.report_path or home_dir() / f"compare-{job_a}-vs-{job_b}.md")
    result = run_task(evaluation_tasks.compare_stored_jobs, job_a, job_b, params.merge_recovery, params.seed,
                      params.gate, md_path.with_suffix(".png").name)
    files = evaluation_tasks.write_stored_comparison(result, md_path)
    paired = result.paired
    get_run_logger().info("wins %d ties %d losses %d, McNemar p %.3g; excluded %d; promotion gate: %s (%s); report %s",
                          paired.wins, paired.ties, paired.losses, paired.mcnemar_p, len(result.excluded),
                          result.decision.verdict, result.decision.reason, md_path)
    return CompareResult(job_a=result.job_a, job_b=result.job_b, paired=paired, decision=result.decision,
                         report_a=result.report_a, report_b=result.report_b, costs=result.costs,
                         excluded=result.excluded, files=files)


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


class PackageParams(StageParams):
    """The ``package`` flow's parameters (see :func:`package` for the quantization plan, metadata edits
    and publishing).

    Attributes:
        hf_dir: the HF checkpoint folder to package (``config.json``, weights, tokenizer).
        out_dir: where the GGUFs (``model-<key>.gguf``) and, with an adapter, ``merged/`` are written.
        quantizations: the quantization plan: names of :data:`forgeflow.packaging.gguf.QUANT_PLANS`
            and/or :class:`forgeflow.packaging.gguf.QuantSpec` objects.
        adapter_dir: a LoRA adapter folder merged into ``hf_dir`` first; None: nothing merged.
        publish: a ModelStore block to publish to; None: nothing published.
        publish_quantization: the artifact key published; None: the first of ``quantizations``.
        model_name: the model's name in a local store.
        metadata_edits: GGUF metadata edits (:class:`forgeflow.packaging.gguf_metadata.MetadataEdit`).
        publish_checkpoint: publish the checkpoint the GGUF was converted from too.
    """

    hf_dir: Path = Field(description="the HF checkpoint folder to package (config.json, weights, tokenizer)")
    out_dir: Path = Field(description="output folder for model-<key>.gguf files (and merged/ with an adapter)")
    quantizations: tuple[str | QuantSpec, ...] = Field(
        ("Q8_0", "Q4_K_M"), description="quantization plan: QUANT_PLANS names (Q8_0, Q4_K_M, "
                                        "Q4_K_M+attn-embd-output-Q8_0) and/or {preset, tensor_types, name} specs")
    adapter_dir: Path | None = Field(None, description="LoRA adapter folder merged into hf_dir first; None: no merge")
    publish: str | None = Field(None, description="ModelStore block name to publish to; None: nothing published")
    publish_quantization: str | None = Field(None, description="artifact key to publish; None: the first of "
                                                               "quantizations")
    model_name: ModelName = Field("forgeflow", description="the model's name in a local store (one path component)")
    metadata_edits: tuple[MetadataEdit | dict[str, Any], ...] = Field(
        (), description="GGUF metadata edits {op: set|add|delete, key, value, type, sub_type, artifacts}, applied "
                        "after every artifact passed its check and loaded")
    publish_checkpoint: bool = Field(False, description="publish the checkpoint the GGUF was converted from too "
                                                        "(under checkpoint/)")


@flow(name="package", log_prints=True)
def package(params: PackageParams) -> PackageResult:
    """Merge (optional adapter) -> GGUF f16 -> quantize -> metadata check -> load [-> metadata edits ->
    verify -> check -> load] [-> publish].

    ``params.quantizations`` is the quantization plan: names of :data:`forgeflow.packaging.gguf.QUANT_PLANS`
    (``Q8_0``, ``Q4_K_M``, ``Q4_K_M+attn-embd-output-Q8_0``: attention, embedding and output at Q8_0,
    the rest Q4_K_M, as the hand-run pipeline served) and/or specs ``{"preset": "Q4_K_M",
    "tensor_types": {regex: ggml type}, "name": ...}``; each mixed artifact is checked tensor by
    tensor after quantization. The result is keyed by :attr:`forgeflow.packaging.gguf.QuantSpec.key`.

    ``params.metadata_edits`` fixes GGUF metadata as the hand-run pipeline patched it: a list of
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

    With ``params.publish`` (the name of a ModelStore block: local directory or HF Hub), the GGUF of
    ``params.publish_quantization`` (default: the first of ``quantizations``) and its
    ``<stem>.lineage.json`` are published once every artifact passed the GGUF check and loaded
    (:func:`tasks.packaging.publish_gguf`), with the merged adapter's files (``adapter/``) and,
    with ``params.publish_checkpoint``, the checkpoint the GGUF was converted from (``checkpoint/``: the
    merged one when an adapter was merged); the result's ``published`` is then the record.

    The run shows the artifacts as a table artifact (``package``: key, path, size, sha256). The
    lifecycle's base-model and package stages run this flow.

    Every artifact is recorded in the store as the lifecycle's package stage records it
    (:func:`tasks.packaging.record_package`: the merged checkpoint from the adapter, the f16 GGUF from the
    checkpoint it was converted from, each quantized GGUF from the f16 one, with this flow run's
    id), so ``forgeflow lineage`` lists this run as their producer; the base checkpoint ``hf_dir`` and
    the adapter are recorded too when the store does not know them yet.

    Args:
        params: the checkpoint or adapter to merge, convert and quantize; the quantizations, metadata edits.

    Raises:
        InputError: before any compute: the store block is missing or inconsistent (``params.publish: ...``, read
            in a task), or ``params.publish_quantization`` is not among the artifacts this run makes, an unknown
            quantization plan name or preset, repeated artifact keys (``params.quantizations``), an
            invalid metadata edit (``params.metadata_edits[i] (key ...)``: unknown op, empty key, a value
            that does not fit its type, a repeated key, a delete of a key the architecture needs such as
            ``general.architecture``, an unknown artifact key).
        GGUFError: a GGUF fails its check, or an edit does not fit the file (a set/delete of an
            absent key, an add of a present one); nothing is published.
    """
    hf_dir, out_dir, adapter_dir = params.hf_dir, params.out_dir, params.adapter_dir
    quantizations = params.quantizations
    try:
        keys = [spec.key for spec in quant_plan(quantizations)]  # refused before any compute
    except InputError as exc:
        raise _param_error(exc, "quantizations") from None
    try:
        edits = validate_metadata_edits(params.metadata_edits, ("f16", *keys))
    except InputError as exc:
        raise _param_error(exc, "metadata_edits") from None
    target = _publish_preflight(params.publish, params.publish_quantization or (keys[0] if keys else "f16"),
                                ("f16", *keys)) if params.publish else None
    inputs = model_tasks.package_inputs(hf_dir, adapter_dir)
    artifacts = run_task(model_tasks.package, hf_dir, inputs.hf_sha256, out_dir, tuple(quantizations), adapter_dir,
                         inputs.adapter_tree_sha256, edits)
    model_tasks.record_packaged(artifacts, hf_dir, adapter_dir, inputs, Path(out_dir),
                                str(flow_run.get_id() or "") or None)
    table_artifact("package", [{"type": q, "path": str(a.path), "size_bytes": a.size_bytes, "sha256": a.sha256}
                               for q, a in artifacts.items()], f"GGUF artifacts of {hf_dir}"
                   + (f" merged with the adapter {adapter_dir}" if adapter_dir else ""))
    if params.publish and target:
        art = artifacts[target]
        source = Path(out_dir) / "merged" if adapter_dir else Path(hf_dir)  # what the GGUF was converted from
        sources = ReleaseSources(hf_sha256=model_tasks.checkpoint_sha256(source), adapter_dir=adapter_dir,
                                 checkpoint_dir=source if params.publish_checkpoint else None,  # the projector too:
                                 mmproj_path=artifacts[MMPROJ_KEY].path if MMPROJ_KEY in artifacts else None)
        record = publish_tasks.publish_gguf(params.publish, art.path, art.sha256, art.type, params.model_name,
                                            sources, art.tensor_types, str(flow_run.get_id() or ""))
        return PackageResult(artifacts=artifacts, published=record)
    return PackageResult(artifacts=artifacts)


def _publish_preflight(store_block: str, quantization: str, produced: tuple[str, ...]) -> str:
    """Fail before compute when the store block or the quantization to publish cannot work; returns ``quantization``.

    Raises:
        InputError: ``params.publish_quantization`` is not in ``produced``, or ``params.publish: ...`` the block
            is missing or inconsistent (:func:`tasks.packaging.model_store_preflight`, a task run).
    """
    if quantization not in produced:
        raise InputError(f"params.publish_quantization {quantization!r} is not one of the artifacts {list(produced)}")
    try:
        publish_tasks.model_store_preflight(store_block)
    except InputError as exc:
        raise _param_error(exc, "publish") from None
    return quantization


class PublishParams(StageParams):
    """The ``publish`` flow's parameters.

    Attributes:
        gguf_path: the GGUF (as the package stage wrote it).
        store: name of a ModelStore block (``forgeflow up`` saves a local one as ``forgeflow-models``).
        hf_dir: the HF checkpoint the GGUF was converted from (the merged one when an adapter was merged).
        adapter_dir: the adapter merged into it, if any (its files are published with the GGUF,
            under ``adapter/``).
        model_name: the model's name in a local store.
        include_checkpoint: publish ``hf_dir`` itself too (under ``checkpoint/``, every file
            sha256-verified like the GGUF): the release then holds the weights the GGUF came from.
        mmproj_path: the vision projector GGUF a multimodal model's GGUF serves with (the package stage's
            ``mmproj-f16.gguf``): published beside it, its sha256 in the release JSON; None: text-only.
    """

    gguf_path: Path = Field(description="the GGUF file to publish")
    store: str = Field("forgeflow-models", description="name of the ModelStore block to publish to")
    hf_dir: Path = Field(description="the HF checkpoint folder the GGUF was converted from (the merged one "
                                     "when an adapter was merged)")
    adapter_dir: Path | None = Field(None, description="the adapter folder merged into hf_dir, if any "
                                                       "(published under adapter/)")
    model_name: ModelName = Field("forgeflow", description="the model's name in a local store (one path component)")
    include_checkpoint: bool = Field(False, description="publish hf_dir too (under checkpoint/, every file "
                                                        "sha256-verified)")
    mmproj_path: Path | None = Field(None, description="the vision projector GGUF the model serves with "
                                                       "(published beside the GGUF); None: a text-only model")


@flow(name="publish", log_prints=True)
def publish(params: PublishParams) -> PublishRecord:
    """Publish a GGUF the package stage wrote (e.g. once the promotion gate chose it) to a model store.

    The GGUF is checked against ``params.hf_dir`` again (:func:`forgeflow.packaging.gguf.check_gguf`; keys
    the store records a ``package`` run's metadata edits set on it against those edits) before anything is
    sent; its ``<stem>.lineage.json`` names ``hf_dir``'s digest and, with ``adapter_dir``, the adapter's
    lineage.

    When the store (the ledger) knows the GGUF, ``params.hf_dir`` must be the checkpoint its recorded chain
    was converted from and ``params.adapter_dir`` the adapter merged into it (required when the chain has
    one; :func:`forgeflow.packaging.lineage.check_release_sources`), checked before anything is written or
    sent: the GGUF metadata check cannot tell a LoRA-merged checkpoint from its base. When the
    store does not know the GGUF, it is published as given and a warning says the lineage was not
    cross-checked. The files are hashed and the store read in a task (:func:`tasks.packaging.release_inputs`).

    Args:
        params: the GGUF (and optional checkpoint, adapter) to publish, the model store block, the name.

    Raises:
        InputError: the store block is missing or inconsistent (``params.store: ...``, read in a task);
            ``params.gguf_path``/``params.hf_dir`` is missing; ``hf_dir``/``adapter_dir`` is not what the store
            records the GGUF was converted from.
        GGUFError: the check failed.
    """
    try:
        publish_tasks.model_store_preflight(params.store)
    except InputError as exc:
        raise _param_error(exc, "store") from None
    inputs = publish_tasks.release_inputs(params.gguf_path, params.hf_dir, params.adapter_dir)
    check = publish_tasks.check_release(params.gguf_path, inputs.gguf_sha256, params.hf_dir, inputs.hf_sha256,
                                        inputs.edited or None)
    get_run_logger().info("%s passed the GGUF check against %s (%s, %d blocks, vocabulary %d)",
                          Path(params.gguf_path).name, params.hf_dir, check.file_type, check.block_count,
                          check.vocab_size)
    sources = ReleaseSources(hf_sha256=inputs.hf_sha256, adapter_dir=params.adapter_dir,
                             checkpoint_dir=Path(params.hf_dir) if params.include_checkpoint else None,
                             mmproj_path=params.mmproj_path)
    return publish_tasks.publish_gguf(params.store, params.gguf_path, inputs.gguf_sha256, check.file_type,
                                      params.model_name, sources, None, str(flow_run.get_id() or ""))


class ServeParams(StageParams):
    """The ``serve`` flow's parameters.

    Attributes:
        gguf_path: the GGUF to serve (external: the model file the endpoint serves).
        state_path: the serving state file; None: ``$FORGEFLOW_HOME/serving/state.json``.
        ports: the two blue/green ports on 127.0.0.1; None: the serving backend's (8801/8802).
        hf_dir: the HF checkpoint folder (``config.json``) the GGUF was converted from; None: the one
            the store records for it.
        serving_block: a ``forgeflow-serving`` block (:class:`blocks.core.ServingBackend`); None:
            llama-cpp-python with a 4,096-token context.
        mmproj_path: the vision projector to serve the GGUF with, in place of the block's ``mmproj`` (the
            package stage's ``mmproj`` artifact of a multimodal model; needs a ``llama-server`` block).
    """

    gguf_path: Path = Field(description="the GGUF to serve (external endpoint: the model file it serves)")
    state_path: Path | None = Field(None, description="the serving state file; None: "
                                                      "$FORGEFLOW_HOME/serving/state.json")
    ports: tuple[int, int] | None = Field(None, description="the two blue/green TCP ports on 127.0.0.1 "
                                                            "(1024..65535, distinct); None: the backend's")
    hf_dir: Path | None = Field(None, description="the HF checkpoint folder (config.json) the GGUF was converted "
                                                  "from; None: the one the store records")
    serving_block: str | None = Field(None, description="a forgeflow-serving block name; None: llama-cpp-python, "
                                                        "4,096-token context")
    mmproj_path: Path | None = Field(None, description="the vision projector GGUF served with it (replaces the "
                                                       "block's mmproj; llama-server blocks only)")


def with_projector(backend: BackendConfig, mmproj_path: Path | None) -> BackendConfig:
    """``backend`` with its ``mmproj`` replaced by ``mmproj_path``, or ``backend`` when that is None (text-only).

    Raises:
        InputError: ``backend`` cannot take a projector (not ``kind="llama-server"``; the reason named).
    """
    return backend if mmproj_path is None else backend_config(
        {**backend.model_dump(), "mmproj": Path(mmproj_path)}, f"the serving block with the projector {mmproj_path}")


@flow(name="serve", log_prints=True)
def serve(params: ServeParams) -> serving_tasks.SwapOutcome:
    """Blue/green swap of the serving endpoint to ``params.gguf_path`` (check, gate, switch, stop the old one).

    Before any server starts, the GGUF's metadata is checked against its HF config
    (:func:`tasks.serving.check_serving_gguf`, the package stage's check): the config of ``params.hf_dir``,
    or by default of the checkpoint the store records the GGUF was converted from. A GGUF that fails
    is refused with the file and the mismatching key named, and nothing starts.

    The endpoint is the state file ``params.state_path`` (default ``$FORGEFLOW_HOME/serving/state.json``,
    the one the ``canary`` flow reads by default). A promotion is recorded in the store as the
    lifecycle records its swaps (:func:`tasks.serving.record_swap`): the new generation active, the
    one it replaced retired, with this flow run's id; ``forgeflow status`` and ``forgeflow lineage``
    read it from there. A swap whose new server fails to start or gate is recorded as a
    ``rolled_back`` generation (numbered above every generation, so numbers stay unique; the state
    file and the old server are untouched).

    With an external endpoint (a block of ``kind="external"``: vLLM, a llama-server the team runs, a
    hosted API) nothing starts or stops: ``params.gguf_path`` is the model file the user says the endpoint
    serves, and its sha256 is the ``model_sha256`` recorded (in the state file and the store, what the
    canary and ``promote`` compare against). A GGUF is checked against its HF config as above; another
    file (e.g. the checkpoint a vLLM endpoint loaded) is not, and ``checks`` says so. The endpoint must
    list ``model_alias`` on ``/models`` and answer a smoke completion; if it answers llama-server's
    ``/props``, the file it loaded and its per-slot context are checked too; the result's ``checks``
    name each check and whether it ran (the accelerator check never does).

    The ``serving_block``'s slot plan is checked against ``required_context_tokens`` and the GGUF's
    training context before any server starts.

    Args:
        params: the GGUF to serve, the serving state file, the blue/green ports and the serving block.

    Returns:
        :class:`tasks.serving.SwapOutcome` (``promoted``, ``verdict``, ``state``: the endpoint now
        recorded, ``previous``, ``checks``: external endpoints' checks, each ``passed``, ``partial`` or
        ``not_run``). The lifecycle's ``serve_baseline`` stage runs this flow.

    Raises:
        InputError: ``params.gguf_path`` is not a file, no config to check it against (no ``params.hf_dir``
            and the store records none), ``params.ports`` are not two distinct ports, ``params.serving_block``
            does not exist or is not a valid backend, or nothing serves and both ports are held by other
            processes.
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
    gguf_path = params.gguf_path
    gguf_sha256 = serving_tasks.model_file_sha256(gguf_path)  # refuses a missing file
    backend = with_projector(serving_tasks.serving_backend(params.serving_block, params.ports,
                                                           ports_field="params.ports"), params.mmproj_path)
    check = serving_tasks.check_serving_gguf(gguf_path, gguf_sha256, params.hf_dir,
                                             external=backend.kind == "external")
    serving_tasks.preflight_serving(backend, check.context_length if check is not None else None)
    outcome = serving_tasks.swap_transaction(params.state_path or home_dir() / "serving" / "state.json", gguf_path,
                                             gguf_sha256, backend, lambda staged: "promote")
    serving_tasks.record_promotion(outcome, str(flow_run.get_id() or "") or None)
    if backend.kind == "external":
        metadata = (EndpointCheck(name="gguf_metadata", status="not_run", detail=f"{gguf_path} is not a GGUF")
                    if check is None else EndpointCheck(name="gguf_metadata", status="passed",
                                                        detail=f"{Path(gguf_path).name} matches its HF config"))
        outcome = outcome.model_copy(update={"checks": (metadata, *outcome.checks)})
    return outcome


class BaseModelParams(StageParams):
    """The ``base-model`` flow's parameters.

    Attributes:
        source: where the checkpoint is (:class:`forgeflow.packaging.checkpoint.BaseModelSource`: a local
            folder, a Hub repository at a revision, or ``tiny-vl``: the tiny Qwen3.5-shaped multimodal model
            with its vision tower, built here; the tiny text model is the lifecycle's own default, not a
            source for this flow).
        hub_dir: where Hub snapshots go; None: ``$FORGEFLOW_HOME/models/hub``.
    """

    source: BaseModelSource = Field(description="the checkpoint: {local_dir} or {repo_id, revision, token_secret, "
                                                "endpoint}")
    hub_dir: Path | None = Field(None, description="folder for Hub snapshots; None: $FORGEFLOW_HOME/models/hub")


@flow(name="base-model", log_prints=True)
def base_model(params: BaseModelParams) -> CheckpointRecord:
    """Check the team's base checkpoint (a text causal LM, or an image-text-to-text one with its vision tower)
    and record it in the store as a ``base`` artifact.

    ``params.source`` is a local folder (used in place) or an HF Hub repository at a revision (fetched with
    ``huggingface_hub.snapshot_download`` at the commit the revision resolves to now, token from
    the Secret block ``source.token_secret``). The record (path, sha256 over every file, parameter
    count, provenance: repo id, revision, commit) is what ``package`` (its ``hf_dir``) and the
    lifecycle's ``base_model`` take; ``forgeflow lineage <sha256>`` shows it as a root.

    Args:
        params: the base model's source (tiny-vl, a local folder or a Hub repository at a revision).

    Raises:
        InputError: no source given (the tiny text model), the folder is not an HF checkpoint (each
            missing piece named), the repository/revision does not exist or the token is refused,
            the Secret block is missing.
        TransientInfraError: the Hub did not answer after retries.
    """
    source = params.source
    if source.kind == "tiny":
        raise InputError("base-model: give params.source.local_dir or params.source.repo_id + "
                         "params.source.revision")
    record = run_task(model_tasks.base_checkpoint, source, params.hub_dir or home_dir() / "models" / "hub")
    provenance = record.provenance
    record_rows(settings.store_url(), "model_artifacts", [records.ModelArtifactRecord(
        sha256=record.sha256, kind="base", path=str(record.path), lineage=provenance,
        run_id=str(flow_run.get_id() or "") or None)])
    get_run_logger().info("base model %s: sha256 %s, %d parameters (%s)", record.path, record.sha256,
                          record.num_parameters, ", ".join(f"{k}={v}" for k, v in provenance.items()))
    return record
