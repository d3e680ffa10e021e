"""Stage flows that run on their own (UI, schedule, API), reading their inputs from the store.

Each takes one ``params`` model and returns one typed result; the lifecycle runs the same flows as subflows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flows.stagekit import StageParams, param_error, run_task
from forgeflow.common import settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.config import LifecycleConfig, PackageSettings
from forgeflow.curation.freeze import FreezeManifest, FreezeName, SplitQuotas, TaskRef
from forgeflow.evaluation import compare as comparison
from forgeflow.ledger import records
from forgeflow.packaging.checkpoint import BaseModelSource, CheckpointRecord
from forgeflow.packaging.gguf import GGUFArtifact, quant_plan
from forgeflow.packaging.mmproj import MMPROJ_KEY
from forgeflow.packaging.publish import PublishRecord, check_model_name
from forgeflow.packaging.release import ReleaseSources
from forgeflow.serving.backend import BackendConfig, backend_config
from forgeflow.serving.bluegreen import SwapResult
from forgeflow.serving.external import EndpointCheck
from tasks import curation
from tasks import evaluation as evaluation_tasks
from tasks import packaging as model_tasks
from tasks import packaging as publish_tasks
from tasks import serving as serving_tasks
from tasks.common import record_rows, table_artifact

DEMO_FREEZE_QUOTAS: SplitQuotas = LifecycleConfig().freeze.quotas
"""The demo's freeze quotas (the lifecycle's defaults), the freeze deployment's default."""


ModelName = Annotated[str, AfterValidator(check_model_name)]
"""A model's name in a local store: refused when the parameters are validated (``params.model_name``), before
anything is packaged, if it is not one path component (:func:`forgeflow.packaging.publish.check_model_name`)."""

class FreezeParams(StageParams):
    """The ``freeze`` flow's parameters (the freeze deployment's defaults are the demo's)."""

    name: FreezeName = Field("demo-v1", description="the freeze name: lower-case letters, digits, '.', '_', '-', "
                                                    "at most 128 characters; an existing name with other content is "
                                                    "refused")
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
    """Freeze the accepted tasks in the store under ``params.name`` (immutable), with its export bundle.

    The bundle (a HF DatasetDict per split, as a deterministic tarball) has its sha256 in the manifest.

    Args:
        params: the freeze's name, split quotas, seed and the accepted tasks it draws from.

    Raises:
        InputError: an invalid name, empty ``instance_ids``, both it and ``candidate_set``, or an unknown set.
        PreflightError: the quotas are not met (each unmet quota is named).
        FreezeConflictError: ``params.name`` exists with different content.
    """
    name, quotas, seed, instance_ids = params.name, params.quotas, params.seed, params.instance_ids
    if params.candidate_set is not None:
        if instance_ids is not None:
            raise InputError(f"freeze {name!r}: give params.instance_ids or params.candidate_set, not both")
        instance_ids = tuple(curation.candidate_set_ids(params.candidate_set))
    if instance_ids is not None and not instance_ids:
        raise InputError(f"freeze {name!r}: params.instance_ids is empty (None freezes every accepted task)")
    bundle_tasks = curation.accepted_for_freeze(list(instance_ids) if instance_ids is not None else None)
    accepted = [TaskRef(instance_id=t.instance_id, repo=t.repo) for t in bundle_tasks]
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


class CompareParams(comparison.ComparisonSettings, StageParams):
    """The ``compare`` flow's parameters: the two jobs, and how they are compared (the report path, recovery merge,
    seed and gate of :class:`~forgeflow.evaluation.compare.ComparisonSettings`)."""

    job_a: str = Field(description="the first (baseline) canary job id, as recorded in the store")
    job_b: str = Field(description="the second (candidate) canary job id, on the same frozen split")


@flow(name="compare", log_prints=True)
def compare(params: CompareParams) -> comparison.StoredJobsComparison:
    """Paired comparison of two canary jobs recorded in the store, on the same frozen split.

    The delta interval is Newcombe's paired interval united with the repository-clustered bootstrap.

    Args:
        params: the two jobs to compare (baseline, candidate), the report path, the seed and the gate policy.

    Returns:
        The comparison (merged jobs, reports, pairs, costs, excluded tasks, the gate's decision, the markdown) with
        ``files``: the report and its PNG, with sha256.

    Raises:
        InputError: a job has no trials in the store, or the jobs ran different frozen splits.
    """
    job_a, job_b = params.job_a, params.job_b
    md_path = Path(params.report_path or home_dir() / f"compare-{job_a}-vs-{job_b}.md")
    result = run_task(evaluation_tasks.compare_stored_jobs, job_a, job_b, params.merge_recovery, params.seed,
                      params.gate, md_path.with_suffix(".png").name)
    result = evaluation_tasks.write_stored_comparison(result, md_path)
    paired = result.paired
    get_run_logger().info("wins %d ties %d losses %d, McNemar p %.3g; excluded %d; promotion gate: %s (%s); report %s",
                          paired.wins, paired.ties, paired.losses, paired.mcnemar_p, len(result.excluded),
                          result.decision.verdict, result.decision.reason, md_path)
    return result


class PackageResult(BaseModel):
    """What the ``package`` flow made: the checked GGUFs, and the release when it published one."""

    model_config = ConfigDict(frozen=True)

    artifacts: dict[str, GGUFArtifact] = Field(description="the checked, loaded GGUFs by artifact key (f16, quants)")
    published: PublishRecord | None = Field(None, description="the release record when the flow published one")


class PackageParams(PackageSettings, StageParams):
    """The ``package`` flow's parameters: what it makes (the quantizations and metadata edits of
    :class:`~forgeflow.config.PackageSettings`, the lifecycle's ``package`` group), from which checkpoint, and
    where it publishes."""

    hf_dir: Path = Field(description="the HF checkpoint folder to package (config.json, weights, tokenizer)")
    out_dir: Path = Field(description="output folder for model-<key>.gguf files (and merged/ with an adapter)")
    adapter_dir: Path | None = Field(None, description="LoRA adapter folder merged into hf_dir first; None: no merge")
    store: str | None = Field(None, description="ModelStore block name to publish to; None: nothing published")
    publish_quantization: str | None = Field(None, description="artifact key to publish; None: the first of "
                                                               "quantizations")
    model_name: ModelName = Field("forgeflow", description="the model's name in a local store (one path component)")
    include_checkpoint: bool = Field(False, description="publish the checkpoint the GGUF was converted from too "
                                                        "(under checkpoint/)")

    @field_validator("publish_quantization")
    @classmethod
    def _made(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and "quantizations" in info.data:
            made = ["f16", *(spec.key for spec in quant_plan(info.data["quantizations"]))]
            if value not in made:
                raise ValueError(f"{value!r} is not one of the artifacts {made}")
        return value


@flow(name="package", log_prints=True)
def package(params: PackageParams) -> PackageResult:
    """Merge (optional adapter) -> GGUF f16 -> quantize -> check -> load [-> metadata edits] [-> publish].

    Metadata edits run after every artifact passed its check and loaded, in one bounded-memory pass verified
    against the source; the check and load then run again on the edited file. Every artifact is recorded in
    the store with this flow run as its producer.

    Args:
        params: the checkpoint or adapter to merge, convert and quantize; the quantizations, metadata edits.

    Raises:
        InputError: before any compute: a bad store block (the quantization plan, the artifact key to publish and
            the metadata edits are refused when ``params`` is validated).
        GGUFError: a GGUF fails its check, or an edit does not fit the file; nothing is published.
    """
    hf_dir, out_dir, adapter_dir = params.hf_dir, params.out_dir, params.adapter_dir
    quantizations, edits, keys = params.quantizations, params.metadata_edits, params.artifact_keys
    target = (params.publish_quantization or (keys[0] if keys else "f16")) if params.store else None
    if params.store:
        _store_preflight(params.store)  # before any compute
    inputs = model_tasks.package_inputs(hf_dir, adapter_dir)
    artifacts = run_task(model_tasks.package, hf_dir, inputs.hf_sha256, out_dir, tuple(quantizations), adapter_dir,
                         inputs.adapter_tree_sha256, edits)
    model_tasks.record_packaged(artifacts, hf_dir, adapter_dir, inputs, Path(out_dir),
                                str(flow_run.get_id() or "") or None)
    table_artifact("package", [{"type": q, "path": str(a.path), "size_bytes": a.size_bytes, "sha256": a.sha256}
                               for q, a in artifacts.items()], f"GGUF artifacts of {hf_dir}"
                   + (f" merged with the adapter {adapter_dir}" if adapter_dir else ""))
    if params.store and target:
        art = artifacts[target]
        source = Path(out_dir) / "merged" if adapter_dir else Path(hf_dir)  # what the GGUF was converted from
        sources = ReleaseSources(hf_sha256=model_tasks.checkpoint_sha256(source), adapter_dir=adapter_dir,
                                 checkpoint_dir=source if params.include_checkpoint else None,  # the projector too:
                                 mmproj_path=artifacts[MMPROJ_KEY].path if MMPROJ_KEY in artifacts else None)
        record = publish_tasks.publish_gguf(params.store, art.path, art.sha256, art.type, params.model_name,
                                            sources, art.tensor_types, str(flow_run.get_id() or ""))
        return PackageResult(artifacts=artifacts, published=record)
    return PackageResult(artifacts=artifacts)


def _store_preflight(store_block: str) -> None:
    """Fail before compute when the ``store`` block cannot be published to (InputError naming ``params.store``)."""
    try:
        publish_tasks.model_store_preflight(store_block)
    except InputError as exc:
        raise param_error(exc, "store") from None


class PublishParams(StageParams):
    """The ``publish`` flow's parameters."""

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
    """Publish a GGUF the package stage wrote to a model store, after checking it against ``params.hf_dir``.

    When the store knows the GGUF, ``hf_dir`` and ``adapter_dir`` must be what its recorded chain was converted
    from (the metadata check cannot tell a LoRA-merged checkpoint from its base); otherwise a warning says so.

    Args:
        params: the GGUF (and optional checkpoint, adapter) to publish, the model store block, the name.

    Raises:
        InputError: a bad store block, a missing path, or sources other than the store records.
        GGUFError: the check failed.
    """
    _store_preflight(params.store)
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
    """The ``serve`` flow's parameters."""

    gguf_path: Path = Field(description="the GGUF to serve (external endpoint: the model file it serves)")
    state_path: Path | None = Field(None, description="the serving state file; None: "
                                                      "$FORGEFLOW_HOME/serving/state.json")
    ports: tuple[int, int] | None = Field(None, description="the two blue/green TCP ports on 127.0.0.1 "
                                                            "(1024..65535, distinct); None: the backend's")
    hf_dir: Path | None = Field(None, description="the HF checkpoint folder (config.json) the GGUF was converted "
                                                  "from; None: the one the store records")
    block: str | None = Field(None, description="a forgeflow-serving block name; None: llama-cpp-python, "
                                                "4,096-token context")
    mmproj_path: Path | None = Field(None, description="the vision projector GGUF served with it (replaces the "
                                                       "block's mmproj; llama-server blocks only)")


def with_projector(backend: BackendConfig, mmproj_path: Path | None) -> BackendConfig:
    """``backend`` with its ``mmproj`` replaced by ``mmproj_path`` (InputError unless ``kind="llama-server"``)."""
    return backend if mmproj_path is None else backend_config(
        {**backend.model_dump(), "mmproj": Path(mmproj_path)}, f"the serving block with the projector {mmproj_path}")


@flow(name="serve", log_prints=True)
def serve(params: ServeParams) -> SwapResult:
    """Blue/green swap of the serving endpoint to ``params.gguf_path`` (check, gate, switch, stop the old one).

    Before any server starts the GGUF is checked against its HF config and the block's slot plan against
    ``required_context_tokens``. A failed swap is recorded as a ``rolled_back`` generation (the old server serves
    on). An external endpoint is checked, not started: the result's ``checks`` say which checks ran.

    Args:
        params: the GGUF to serve, the serving state file, the blue/green ports and the serving block.

    Raises:
        InputError: a missing GGUF or config, bad ports or block, both ports held; external: 401/403, an
            unlisted ``model_alias`` or ``/props`` naming another file.
        ContextPreflightError / GGUFError: a slot too small, a GGUF that differs from its config (nothing started).
        SwapRolledBackError: the new server did not start or failed its gate; external: its smoke completion.
        PreflightError: external: the endpoint does not answer (nothing recorded).
    """
    gguf_path = params.gguf_path
    gguf_sha256 = serving_tasks.model_file_sha256(gguf_path)  # refuses a missing file
    backend = with_projector(serving_tasks.serving_backend(params.block, params.ports,
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
    """The ``base-model`` flow's parameters."""

    source: BaseModelSource = Field(description="the checkpoint: {local_dir} or {repo_id, revision, token_secret, "
                                                "endpoint}")
    hub_dir: Path | None = Field(None, description="folder for Hub snapshots; None: $FORGEFLOW_HOME/models/hub")


@flow(name="base-model", log_prints=True)
def base_model(params: BaseModelParams) -> CheckpointRecord:
    """Check the team's base checkpoint (text, or image-text-to-text) and record it as a ``base`` artifact.

    Args:
        params: the base model's source (tiny-vl, a local folder or a Hub repository at a revision).

    Raises:
        InputError: no source, not an HF checkpoint, unknown repository/revision, token refused, no Secret block.
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
