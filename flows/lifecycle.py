"""The ``lifecycle`` flow: every stage of the lifecycle (docs/architecture.md), end to end.

environments -> migrate -> generate -> prewarm (+ task images) -> validate (NOP/Oracle) -> freeze
-> base model (+ GGUF) -> serve -> canary (baseline) -> burst -> package -> serve stage
-> canary (candidate) -> compare + promotion gate -> serve swap.

The candidate is canaried on the idle port and promoted by the gate before the recorded endpoint moves; a
hold/reject or any failure stops the staged server. Every stage is a subflow run whose tasks have the
resumable cache policy, and runs the flow a user runs alone (``curate``, ``freeze``, ``canary``, ...) as a
subflow: one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.transactions import transaction

from blocks.core import RegistryEndpoint
from flows.canary import CanaryParams
from flows.canary import canary as canary_flow
from flows.curate import CurateParams
from flows.curate import curate as curate_flow
from flows.registry import MigrateParams, PrewarmPlanParams, registry_blocks, repository_prefix, run_registries
from flows.registry import migrate_images as migrate_images_flow
from flows.registry import prewarm_plan as prewarm_plan_flow
from flows.stagekit import StageLog, run_stage_flow
from flows.stages import (
    BaseModelParams,
    CompareParams,
    FreezeParams,
    PackageParams,
    ServeParams,
    with_projector,
)
from flows.stages import base_model as base_model_flow
from flows.stages import compare as compare_flow
from flows.stages import freeze as freeze_flow
from flows.stages import package as package_flow
from flows.stages import serve as serve_flow
from flows.training import SFTBurstParams
from flows.training import sft_burst as sft_burst_flow
from forgeflow.common.errors import MigrationIncompleteError, PreflightError
from forgeflow.common.settings import apply_container_env
from forgeflow.common.settings import store_url as default_store_url
from forgeflow.config import LifecycleConfig
from forgeflow.curation import generated
from forgeflow.curation.bugs import Candidate
from forgeflow.curation.freeze import (
    FreezeManifest,
    check_freeze_inputs,
)
from forgeflow.curation.task_rows import TaskSource
from forgeflow.evaluation.canary_params import CanaryEndpoint
from forgeflow.evaluation.compare import StoredJobsComparison
from forgeflow.ledger import records
from forgeflow.packaging.mmproj import MMPROJ_KEY
from forgeflow.registry import migration as migrate
from forgeflow.registry import projects
from forgeflow.serving import bluegreen
from forgeflow.serving.backend import BackendConfig
from forgeflow.training.adapters import AdapterRecord
from tasks import curation
from tasks import packaging as packaging_tasks
from tasks import registry as registry_tasks
from tasks import serving as serving_tasks
from tasks import training as training_tasks
from tasks.common import record_rows, upgrade_store

MODEL_ALIAS = "forgeflow"


@flow(name="lifecycle", log_prints=True)
def lifecycle(config: LifecycleConfig = LifecycleConfig()) -> dict[str, Any]:
    """Run the whole post-training lifecycle once; returns the summary written to summary.json.

    Args:
        config: the whole run: projects, candidates, freeze, canary, training, packaging and serving.

    Raises:
        PreflightError: a stage's prerequisites are missing (e.g. no accepted task to freeze).
        InfraError: the infrastructure failed (registry, podman, model server) after retries.
    """
    logger = get_run_logger()
    apply_container_env()
    out_dir = config.output_dir.resolve()
    # before anything is written: a freeze name already used with other inputs can only end in a
    # FreezeConflictError at the freeze stage, after generation and prewarm rewrote shared files
    check_freeze_inputs(config.freeze.name, out_dir / "freezes", config.freeze_inputs())
    if config.base_model.kind != "tiny":  # the team's checkpoint can be had, before any image is built
        packaging_tasks.base_model_preflight(config.base_model)
    blocks = registry_blocks(config.registries)  # the team's registries: a missing or half-set block is refused now
    # a missing block, or an external endpoint (it cannot load the GGUFs this run makes): refused now
    serving = serving_tasks.serving_backend(config.serving.block, config.serving.ports, started_only=True)
    serving_tasks.preflight_serving(serving, None)  # the slot plan holds required_context_tokens
    if config.base_model.kind == "tiny-vl":  # its GGUFs serve only beside their projector: a llama-server block
        with_projector(serving, out_dir / "models" / "base-gguf" / "mmproj-f16.gguf")  # InputError now, not at serve
    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = str(flow_run.get_id() or "")
    log = StageLog(out_dir / "summary.json", run_id)
    store_url = default_store_url()
    upgrade_store(store_url)
    state_path = out_dir / "serving" / "state.json"
    result: dict[str, Any] = {}
    try:
        with run_registries(config.registries, out_dir / "registry", run_id, blocks) as (endpoints, registry_ids):
            result = _run_stages(_Run(config, out_dir, run_id, log, store_url, state_path, registry_ids, serving,
                                      endpoints))
        logger.info("lifecycle finished: %d stages, summary at %s", len(log.stages), log.summary_path)
        return result
    finally:
        if not config.serving.keep_running:
            stopped = serving_tasks.stop_serving(state_path)
            if stopped is not None and stopped.live:  # it was live: the ledger says so no more
                retired = serving_tasks.generation_row(stopped, "retired", run_id)
                record_rows(store_url, "serving_generations", [retired])
        log.finish(result)  # summary.json + the stage table artifact


@dataclass(frozen=True)
class _Run:
    """What every stage of one lifecycle run shares: its config, folders, ledger and servers."""

    config: LifecycleConfig
    out_dir: Path
    run_id: str
    log: StageLog
    store_url: str
    state_path: Path
    registry_ids: dict[str, str]
    serving: BackendConfig
    registries: dict[str, RegistryEndpoint]


@dataclass
class _Env:
    """One project's environment image: built, pushed to the source registry and, once migrated, its copy."""

    project: projects.Project
    local: str
    local_id: str
    checkout: Path
    source_ref: str
    source_digest: str
    target_ref: str = ""
    target_digest: str = ""


def _run_stages(run: _Run) -> dict[str, Any]:
    """Every stage as a subflow run (:func:`flows.stagekit.run_stage_flow`), in lifecycle order."""
    config = run.config
    envs = run_stage_flow("environments", _environments, run)
    envs = run_stage_flow("migrate", _migrate, run, envs)
    candidates = run_stage_flow("generate", _generate, run, envs)
    task_images = run_stage_flow("prewarm", _prewarm, run, envs, candidates)
    accepted = run_stage_flow("validate", _validate, run, task_images)
    manifest = run_stage_flow("freeze", _freeze, run, accepted)
    by_id = {t.instance_id: t for t in accepted}
    base_model, base_gguf = run_stage_flow("base_model", _base_model, run)
    served_base = base_gguf[config.serving.quantization]
    serving = run_stage_flow("serve_baseline", _serve_baseline, run, served_base, base_model.path,
                             _projector(base_gguf))
    baseline_job = run_stage_flow("canary_baseline", _canary, run, "canary_baseline", serving.base_url,
                                  served_base.sha256)
    adapter = run_stage_flow("burst", _burst, run, base_model, [by_id[i] for i in manifest.splits["train"]], envs)
    ggufs = run_stage_flow("package", _package, run, base_model, adapter)
    # serve_stage, canary_candidate, compare and serve_swap: one transaction, one subflow run
    comparison = run_stage_flow("promote", _stage_and_promote, run, ggufs[config.serving.quantization], baseline_job,
                                _projector(ggufs))
    paired, decision, files = comparison.paired, comparison.decision, comparison.files
    emit_event("forgeflow.lifecycle.completed",
               resource={"prefect.resource.id": f"forgeflow.freeze.{config.freeze.name}"},
               payload={"mcnemar_p": paired.mcnemar_p})
    return {
        "images": {"environments": len(envs), "task_images": len(task_images)},
        "tasks": {"generated": len(candidates), "validated": len(task_images), "accepted": len(accepted)},
        "freeze": {"name": config.freeze.name, "semantic_sha256": manifest.semantic_sha256,
                   "bundle_sha256": manifest.bundle_sha256,
                   "splits": {k: len(v) for k, v in manifest.splits.items()}},
        "canary": {"baseline": comparison.report_a.model_dump(mode="json"),
                   "candidate": comparison.report_b.model_dump(mode="json")},
        "costs": comparison.costs.model_dump(mode="json"),
        "comparison": paired.model_dump(mode="json"),
        "promotion": decision.model_dump(mode="json"),
        "artifacts": {name: {"path": str(a.path), "sha256": a.sha256} for name, a in
                      {**{f"base-{q}": a for q, a in base_gguf.items()},
                       **{f"candidate-{q}": a for q, a in ggufs.items()}}.items()}
        | {"adapter": {"path": str(adapter.path), "sha256": adapter.sha256},
           "freeze_manifest": {"path": str(manifest.path), "sha256": manifest.file_sha256},
           "freeze_bundle": {"path": str(manifest.bundle_path), "sha256": manifest.bundle_sha256},
           "compare_report": {"path": str(files.report_path), "sha256": files.report_sha256},
           "compare_plot": {"path": str(files.plot_path), "sha256": files.plot_sha256}},
    }


def _projector(artifacts: dict[str, Any]) -> Path | None:
    """The vision projector a package run wrote beside its GGUFs (its ``mmproj`` artifact), or None (text-only)."""
    return artifacts[MMPROJ_KEY].path if MMPROJ_KEY in artifacts else None


def _serve_baseline(run: _Run, served_base: Any, hf_dir: Path,
                    mmproj_path: Path | None = None) -> bluegreen.ServingState:
    """8. serve the baseline GGUF through the ``serve`` flow (a multimodal base with its projector)."""
    config = run.config
    with run.log.stage("serve_baseline") as st:
        outcome = serve_flow(ServeParams(gguf_path=served_base.path, state_path=run.state_path,
                                         ports=config.serving.ports, hf_dir=hf_dir, block=config.serving.block,
                                         mmproj_path=mmproj_path))
        assert outcome.current is not None  # the serve flow promotes or raises
        st["counts"] = {"generation": outcome.current.generation, "port": outcome.current.active_port}
    return outcome.current


def _environments(run: _Run) -> dict[str, _Env]:
    """1. environments: base image (debootstrap), one environment image per project -> source registry."""
    log, src = run.log, repository_prefix(run.registries["source"])
    with log.stage("environments") as st:
        base = log.call(registry_tasks.base_image)
        envs: dict[str, _Env] = {}
        for name in run.config.projects:
            project = projects.get_project(name)
            local_name, checkout = log.call(registry_tasks.environment_image, name, base.image_id, run.out_dir)
            local_id = registry_tasks.local_image_id(local_name)
            source_ref = f"{src}/env/{project.name}:{project.version}"
            digest = log.call(registry_tasks.push_local_image, local_name, local_id, source_ref,
                              run.registry_ids["source"])
            envs[name] = _Env(project=project, local=local_name, local_id=local_id, checkout=Path(checkout),
                              source_ref=source_ref, source_digest=digest)
        record_rows(run.store_url, "images", [
            records.ImageRecord(ref=e.source_ref, digest=e.source_digest, role="source", project=n, run_id=run.run_id)
            for n, e in envs.items()])
        st["counts"] = {"projects": len(envs)}
        st["digests"] = {"base_image_id": base.image_id, **{n: e.source_digest for n, e in envs.items()}}
    return envs


def _migrate(run: _Run, envs: dict[str, _Env]) -> dict[str, _Env]:
    """2. migrate: the migrate-images flow; returns the environments whose migration completed."""
    config, store_url = run.config, run.store_url
    with run.log.stage("migrate") as st:
        names = {f"env/{e.project.name}:{e.project.version}": n for n, e in envs.items()}
        try:
            summary = migrate_images_flow(MigrateParams(
                source=run.registries["source"], target=run.registries["target"], images=tuple(names),
                transfer=config.registries.transfer, store_url=store_url))
        except MigrationIncompleteError as err:  # the subflow run is Failed; go on with what was migrated
            summary = err.summary
        for name, rec in zip(names.values(), summary.records):
            if rec.status == "completed":
                envs[name].target_ref, envs[name].target_digest = migrate.store_ref(rec.target_ref), rec.target_digest
        # the flow wrote the rows (role target, state, digests); the lifecycle adds each one's project
        record_rows(store_url, "image_roles", [records.ImageRecord(ref=e.target_ref, role="target", project=n)
                                               for n, e in envs.items() if e.target_ref])
        envs = {n: e for n, e in envs.items() if e.target_ref}
        # StageLog's "cached": an image the store recorded as completed (and the target still serves) was not
        # copied again, i.e. answered from the ledger as a cached task would be
        st["tasks_run"] += len(summary.records)
        st["tasks_cached"] += sum(r.reason == migrate.ALREADY_COMPLETED for r in summary.records)
        st["counts"] = {"completed": len(envs), "skipped_or_failed": len(summary.records) - len(envs),
                        "copied": summary.copied}
        st["digests"] = {n: e.target_digest for n, e in envs.items()}
    return envs


def _generate(run: _Run, envs: dict[str, _Env]) -> list[tuple[Candidate, str]]:
    """3. generate: SWE-smith procedural candidates per project, statically checked; (candidate, repo)."""
    with run.log.stage("generate") as st:
        candidates = []
        for name, env in envs.items():
            found = run.log.call(curation.generate_candidates, name, env.checkout, env.project.source_path,
                                 run.config.candidates_per_project, run.config.seed)
            candidates.extend((c, name) for c in found)
        # a candidate the store already holds a verdict for keeps it (a later run does not validate it again)
        judged = set(curation.curation_state(run.store_url, [c.instance_id for c, _ in candidates]).processed)
        record_rows(run.store_url, "tasks", [records.TaskRecord(instance_id=c.instance_id, repo=name, patch=c.patch,
                                                                status="candidate", run_id=run.run_id)
                                             for c, name in candidates if c.instance_id not in judged])
        st["counts"] = {"candidates": len(candidates), "judged_before": len(judged)}
    return candidates


def _prewarm(run: _Run, envs: dict[str, _Env],
             candidates: list[tuple[Candidate, str]]) -> dict[str, generated.GeneratedTask]:
    """4. prewarm: the ``prewarm-plan`` flow, then basecache tags and task images into their planned shards.

    Raises:
        PlanRejectedError: a shard repository would hold more than ``prewarm.tag_cap`` tags (nothing copied).
    """
    config, log, target = run.config, run.log, run.registries["target"]
    dst, plot_path = target.address, run.out_dir / "prewarm" / "prewarm-plan.png"
    with log.stage("prewarm") as st:
        layout = config.prewarm.layout(target.namespace)  # the target's namespace leads the prefix
        rows = [(c.instance_id, envs[repo].target_digest) for c, repo in candidates]
        tasks_path = registry_tasks.write_plan_tasks(rows, plot_path.with_name("plan-tasks.jsonl"))
        plan = prewarm_plan_flow(PrewarmPlanParams(tasks_path=tasks_path, shards=layout.shards, lanes=layout.lanes,
                                                   prefix=layout.prefix, tag_cap=layout.tag_cap,
                                                   plot_path=plot_path))
        base_refs = {e.target_digest: f"docker://{e.target_ref}" for e in envs.values()}
        basecache = log.call(registry_tasks.prewarm, plan, dst, base_refs, run.registry_ids["target"],
                             config.prewarm.concurrency)
        placements = {p.task_id: p for p in plan.placements}
        task_images: dict[str, generated.GeneratedTask] = {}  # local image, and where it was pushed
        reused_layers = 0  # task images must start with their environment image's layers
        for c, repo in candidates:
            env = envs[repo]
            image = log.call(registry_tasks.task_image, env.local, env.local_id, c.instance_id, c.patch)
            place = placements[c.instance_id]
            ref = f"{dst}/{place.repository}:{place.tag}"
            digest = log.call(registry_tasks.push_local_image, image.name, image.image_id, ref,
                              run.registry_ids["target"])
            reused_layers += registry_tasks.layer_reuse(ref, env.target_ref)
            task_images[c.instance_id] = generated.GeneratedTask(
                **c.model_dump(), image_ref=image.name, image_id=image.image_id, registry_ref=ref,
                registry_digest=digest, test_command=env.project.test_command)
        record_rows(run.store_url, "images", [records.ImageRecord(
            ref=t.registry_ref, digest=t.registry_digest, role="task", project=t.repo, run_id=run.run_id)
            for t in task_images.values()])
        st["paths"] = {"candidates": str(curation.write_generated(run.out_dir / generated.GENERATED_FILE, list(
            task_images.values()))),  # what `curate` and the canary read; earlier runs' rows are kept
            "plan_tasks": str(tasks_path), "plan_plot": str(plot_path)}
        st["counts"] = {"repositories": len(plan.projected_tag_counts), "basecache_tags": len(basecache),
                        "task_images": len(task_images), "base_layers_reused": reused_layers}
    return task_images


def _validate(run: _Run, task_images: dict[str, generated.GeneratedTask]) -> list[generated.GeneratedTask]:
    """5. validate: the ``curate`` flow on this run's pushed candidates, longest validations first, with the run's
    ``validation`` as its ``params.settings`` (batch after batch until the freeze's quotas are met).

    Raises:
        PreflightError: the accepted tasks cannot fill the freeze's quotas (each unmet quota named).
    """
    config = run.config
    with run.log.stage("validate") as st:
        ids = tuple(task_images)
        result = curate_flow(CurateParams(
            source=TaskSource(generated_path=run.out_dir / generated.GENERATED_FILE, images="registry"),
            instance_ids=ids, quotas=config.freeze.quotas, freeze_name=config.freeze.name, emit_freeze_ready=False,
            settings=config.validation))
        verdicts = curation.task_verdicts(run.store_url, list(ids))
        accepted = []
        for iid, t in task_images.items():
            if verdicts[iid].status == "accepted":
                accepted.append(t.model_copy(update={"FAIL_TO_PASS": verdicts[iid].FAIL_TO_PASS,
                                                     "PASS_TO_PASS": verdicts[iid].PASS_TO_PASS}))
        statuses = [v.status for v in verdicts.values()]
        st["counts"] = {"candidates": len(ids), "validated": len(result.validated),
                        "trials": result.trials_recorded, "accepted": len(accepted),
                        "rejected": statuses.count("rejected"), "errors": statuses.count("error")}
        if result.status != "freeze-ready":
            raise PreflightError(f"validate: the accepted tasks cannot fill freeze {config.freeze.name!r}: "
                                 f"{'; '.join(result.unmet)}")
    return accepted


def _freeze(run: _Run, accepted: list[generated.GeneratedTask]) -> FreezeManifest:
    """6. freeze: the ``freeze`` flow on this run's accepted tasks."""
    config = run.config
    with run.log.stage("freeze") as st:
        manifest = freeze_flow(FreezeParams(name=config.freeze.name, quotas=config.freeze.quotas, seed=config.seed,
                                            instance_ids=tuple(t.instance_id for t in accepted),
                                            out_dir=run.out_dir / "freezes"))
        curation.keep_freeze_inputs(config.freeze.name, run.out_dir / "freezes", config.freeze_inputs())
        st["counts"] = {k: len(v) for k, v in manifest.splits.items()}
        st["digests"] = {"semantic_sha256": manifest.semantic_sha256, "file_sha256": manifest.file_sha256,
                         "bundle_sha256": manifest.bundle_sha256}
        st["paths"] = {"manifest": str(manifest.path), "bundle": str(manifest.bundle_path)}
    return manifest


def _base_model(run: _Run) -> tuple[Any, dict[str, Any]]:
    """7. base model: the team's checkpoint or the tiny Qwen2, packaged as GGUF by the ``package`` flow."""
    config, log, out_dir = run.config, run.log, run.out_dir
    with log.stage("base_model") as st:
        if config.base_model.kind == "tiny":
            base_model, tokenizer_check = log.call(packaging_tasks.base_model, out_dir / "models" / "base",
                                                   config.seed)
            st["counts"] = {"tokenizer_vectors_matched": tokenizer_check.matched,
                            "tokenizer_vectors_total": tokenizer_check.total}
            record_rows(run.store_url, "model_artifacts", [records.ModelArtifactRecord(
                sha256=base_model.sha256, kind="base", path=str(base_model.path), run_id=run.run_id,
                lineage=base_model.provenance)])
        else:  # the base-model flow checks the team's checkpoint and records it with where it came from
            base_model = base_model_flow(BaseModelParams(source=config.base_model, hub_dir=out_dir / "models" / "hub"))
            st["counts"] = {"source": base_model.source, **({"commit": base_model.commit} if base_model.commit else {})}
        base_gguf_dir = out_dir / "models" / "base-gguf"
        # the package flow: convert, quantize, check, load, record each GGUF with the checkpoint as parent
        base_gguf = package_flow(PackageParams(hf_dir=base_model.path, out_dir=base_gguf_dir,
                                               quantizations=(config.serving.quantization,))).artifacts
        st["counts"] = {"parameters": base_model.num_parameters, **st["counts"]}
        st["digests"] = {"hf": base_model.sha256, **{q: a.sha256 for q, a in base_gguf.items()}}
    return base_model, base_gguf


def _burst(run: _Run, base_model: Any, train: list[generated.GeneratedTask], envs: dict[str, _Env]) -> AdapterRecord:
    """10. burst: SFT samples from the train split's Oracle solutions, then the ``sft-burst`` flow on them."""
    config, out_dir = run.config, run.out_dir
    with run.log.stage("burst") as st:
        sft_samples = training_tasks.oracle_samples([(t, envs[t.repo].checkout, t.FAIL_TO_PASS) for t in train])
        samples_jsonl = training_tasks.write_sft_jsonl(sft_samples, out_dir / "samples" / "oracle-sft.jsonl")
        adapter = sft_burst_flow(SFTBurstParams(hf_dir=base_model.path, samples_jsonl=samples_jsonl,
                                                out_dir=out_dir / "models", training=config.burst))
        st["counts"] = {"samples": len(sft_samples), "steps": adapter.steps}
        st["digests"] = {"adapter": adapter.sha256, "dataset": adapter.lineage.dataset_sha256}
        st["paths"] = {"adapter": str(adapter.path), "samples": str(samples_jsonl)}
    return adapter


def _package(run: _Run, base_model: Any, adapter: AdapterRecord) -> dict[str, Any]:
    """11. package: the ``package`` flow; the GGUFs by quantization type."""
    config = run.config
    with run.log.stage("package") as st:
        package_dir = run.out_dir / "models" / "candidate-gguf" / adapter.sha256[:16]  # one folder per adapter
        ggufs = package_flow(PackageParams(**dict(config.package), hf_dir=base_model.path, out_dir=package_dir,
                                           adapter_dir=adapter.path)).artifacts
        st["digests"] = {q: a.sha256 for q, a in ggufs.items()}
        st["paths"] = {q: str(a.path) for q, a in ggufs.items()}
    return ggufs


def _stage_and_promote(run: _Run, served_new: Any, baseline_job: str,
                       mmproj_path: Path | None = None) -> StoredJobsComparison:
    """12.-15. stage the candidate on the idle port, canary it, compare + gate, then promote or discard.

    One Prefect transaction: any failure after staging rolls back (the staged server stops; the recorded
    endpoint never moved). Returns the ``compare`` flow's result.
    """
    log = run.log
    with transaction():
        with log.stage("serve_stage") as st:
            staged = log.call(serving_tasks.stage_server, run.state_path, served_new.path, served_new.sha256,
                              with_projector(run.serving, mmproj_path))
            st["counts"] = {"port": staged.new_port, "smoke_tokens": staged.gate.smoke_tokens}
            if staged.gate.image is not None:  # the gate's image smoke: the prompt tokens the image added
                st["counts"]["image_tokens"] = staged.gate.image.image_tokens
        candidate_job = _canary(run, "canary_candidate", staged.current.base_url, served_new.sha256)
        comparison = _compare(run, baseline_job, candidate_job)
        decision = comparison.decision
        with log.stage("serve_swap") as st:
            if decision.verdict == "promote":
                swap = log.call(serving_tasks.promote_server, run.state_path, staged)
                record_rows(run.store_url, "serving_generations",
                            serving_tasks.swap_rows(swap.previous, swap.current, run.run_id))
                st["counts"] = {"generation": swap.current.generation, "port": swap.current.active_port,
                                "promoted": 1}
            else:
                log.call(serving_tasks.discard_server, staged)
                st["counts"] = {"promoted": 0}
                st["decision"] = f"{decision.verdict}: {decision.reason}"
    return comparison


def _compare(run: _Run, baseline_job: str, candidate_job: str) -> StoredJobsComparison:
    """14. the ``compare`` flow on the two canary jobs, no recovery jobs merged (the gate decides on this run)."""
    config = run.config
    with run.log.stage("compare") as st:
        result = compare_flow(CompareParams(job_a=baseline_job, job_b=candidate_job,
                                            report_path=run.out_dir / "compare.md", merge_recovery=False,
                                            seed=config.seed, gate=config.promotion))
        paired, files = result.paired, result.files
        st["counts"] = {"pairs": paired.n_pairs, "wins": paired.wins, "ties": paired.ties, "losses": paired.losses}
        st["decision"] = result.decision.model_dump(mode="json")
        st["digests"] = {"report": files.report_sha256, "plot": files.plot_sha256}
        st["paths"] = {"report": str(files.report_path), "plot": str(files.plot_path)}
    return result


def _canary(run: _Run, stage: str, base_url: str, model_sha256: str) -> str:
    """9. / 13. canary: the ``canary`` flow on the frozen test split against ``model_sha256`` at ``base_url``.

    Returns the job id ``<stage>-<model sha256[:12]>``; raises as the ``canary`` flow.
    """
    config = run.config
    with run.log.stage(stage) as st:
        result = canary_flow(CanaryParams(
            freeze_name=config.freeze.name, split="test",
            endpoint=CanaryEndpoint(state_path=run.state_path, base_url=base_url, model_sha256=model_sha256,
                                    model_alias=MODEL_ALIAS),
            run=config.canary,
            source=TaskSource(generated_path=run.out_dir / generated.GENERATED_FILE, images="registry"),
            job_id=f"{stage}-{model_sha256[:12]}", out_dir=run.out_dir / "canary"))
        report = result.report
        st["counts"] = {"requested": report.requested, "scored": report.scored, "reward_1": report.reward_1,
                        "exceptions": sum(report.exceptions_by_type.values())}
        st["digests"] = {"model": model_sha256}
        st["paths"] = {"report": str(result.report_path)}
    return result.job_id
