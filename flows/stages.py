"""Stage flows that run on their own (from the UI, a schedule or the API), reading their inputs
from the store where the lifecycle left them. Each is a deployment in ``prefect.yaml``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from forgeflow import compare as comparison
from forgeflow import store as ledger
from forgeflow.freeze import AcceptedTask, FreezeManifest, SplitQuotas
from forgeflow.fsutil import atomic_write_text
from forgeflow.settings import home_dir
from tasks import curation, model as model_tasks, serving as serving_tasks
from tasks.common import markdown_artifact


@flow(name="freeze", log_prints=True)
def freeze(name: str, train_min: int = 2, validation_min: int = 1, test_min: int = 2, max_per_repo: int = 4,
           min_repos: int = 2, seed: int = 0, out_dir: Path | None = None) -> FreezeManifest:
    """Freeze the accepted tasks recorded in the store under ``name`` (immutable).

    Raises:
        PreflightError: the quotas are not met (each unmet quota is named).
        FreezeConflictError: ``name`` exists with different content.
    """
    store = ledger.Store()
    store.upgrade()
    accepted = [AcceptedTask(instance_id=t.instance_id, repo=t.repo) for t in store.accepted_tasks()]
    quotas = SplitQuotas(train=train_min, validation=validation_min, test=test_min, max_per_repo=max_per_repo,
                         min_repos=min_repos)
    manifest = curation.freeze_dataset(name, accepted, quotas, seed, out_dir or home_dir() / "freezes", {})
    store.record_freeze(ledger.FreezeRecord(name=manifest.name, semantic_sha256=manifest.semantic_sha256,
                                            file_sha256=manifest.file_sha256, manifest_path=str(manifest.path),
                                            counts=manifest.counts))
    return manifest


@flow(name="compare", log_prints=True)
def compare(job_a: str, job_b: str, report_path: Path | None = None) -> comparison.PairedComparison:
    """Paired comparison of two canary jobs recorded in the store (wins/ties/losses, exact McNemar).

    Raises:
        InputError: a job has no trials in the store.
    """
    store = ledger.Store()
    store.upgrade()
    result = comparison.compare_stored_jobs(store, job_a, job_b)
    paired, md = result.paired, result.markdown
    atomic_write_text(report_path or home_dir() / f"compare-{job_a}-vs-{job_b}.md", md)
    markdown_artifact("compare-standalone", md, f"{job_a} vs {job_b}")
    get_run_logger().info("wins %d ties %d losses %d, McNemar p %.3g", paired.wins, paired.ties, paired.losses,
                          paired.mcnemar_p)
    return paired


@flow(name="package", log_prints=True)
def package(hf_dir: Path, out_dir: Path, quantizations: tuple[str, ...] = ("Q8_0", "Q4_K_M"),
            adapter_dir: Path | None = None) -> dict:
    """Merge (optional adapter) -> GGUF f16 -> quantize -> metadata check -> load."""
    from forgeflow.fsutil import sha256_tree

    return model_tasks.package(hf_dir, sha256_tree(hf_dir), out_dir, tuple(quantizations), adapter_dir,
                               sha256_tree(adapter_dir) if adapter_dir else None)


@flow(name="serve", log_prints=True)
def serve(gguf_path: Path, state_path: Path | None = None, ports: tuple[int, int] = (8801, 8802)) -> dict:
    """Blue/green swap of the serving endpoint to ``gguf_path`` (gate, switch, stop the old one)."""
    from forgeflow.fsutil import sha256_file

    result = serving_tasks.serve_swap(state_path or home_dir() / "serving" / "state.json", gguf_path,
                                      sha256_file(gguf_path), tuple(ports))
    return result.model_dump(mode="json")
