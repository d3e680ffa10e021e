"""Prefect tasks of the model chain: tiny base model, SFT burst, package (merge/convert/quantize)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from forgeflow import burst, gguf, model
from forgeflow import store as ledger
from forgeflow.errors import PreflightError
from forgeflow.fsutil import sha256_tree
from tasks.common import RESUMABLE


@task(cache_policy=RESUMABLE)
def base_model(out_dir: Path, seed: int) -> tuple[model.ModelRecord, model.TokenizerCheck]:
    """Build the tiny Qwen2-shaped model with the real Qwen2 tokenizer.

    The saved tokenizer (the one the model ships with) is checked against llama.cpp's tokenizer
    test vectors first; any mismatch stops the stage before a model is built.
    """
    check = model.verify_tokenizer(model.ensure_tokenizer())
    if check.matched != check.total:
        raise PreflightError(f"tokenizer matches {check.matched}/{check.total} llama.cpp vectors: {check.failures[:3]}")
    return model.build_tiny_model(out_dir, seed=seed), check


@task(cache_policy=NO_CACHE)
def burst_preflight(base_model_dir: Path, out_dir: Path, lora_r: int, lora_target_modules: tuple[str, ...],
                    template_files: tuple[Path, ...] = ()) -> burst.PreflightReport:
    """The burst's preflight before any model is loaded (:func:`forgeflow.burst.burst_preflight`):
    the chat template and ``template_files`` exist and are non-empty, and ``out_dir``'s file system
    has the free space the adapter needs. Never cached (disk space and files change between runs).

    Raises:
        PreflightError: every problem found, in one message (``burst preflight failed: ...``).
    """
    return burst.burst_preflight(base_model_dir, out_dir, lora_r, lora_target_modules, template_files)


# log_prints off: HF datasets fingerprints functions with dill, which disassembles them with
# dis.dis into a captured stdout; Prefect's print capture would log those ~500 lines instead.
@task(cache_policy=(INPUTS - "run_id") + TASK_SOURCE, log_prints=False)
def sft_burst(base_model_dir: Path, base_sha256: str, samples: list[dict], out_dir: Path,
              config: burst.BurstConfig, parent_adapter_dir: Path | None, run_id: str | None) -> burst.AdapterRecord:
    """One LoRA SFT burst (TRL SFTTrainer + peft). ``base_sha256`` keys the cache; ``run_id`` (the
    Prefect run recorded in the lineage) does not, so a later run reuses the adapter."""
    data = burst.build_sft_dataset(samples)
    return burst.run_sft_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=parent_adapter_dir, run_id=run_id)


@task(cache_policy=RESUMABLE)
def package(hf_dir: Path, hf_sha256: str, out_dir: Path, quantizations: tuple[str, ...],
            adapter_dir: Path | None = None, adapter_sha256: str | None = None) -> dict[str, gguf.GGUFArtifact]:
    """Merge (if an adapter is given) -> convert to GGUF f16 -> quantize -> check -> load.

    Returns:
        {"f16": artifact, "<QTYPE>": artifact, ...}; every artifact checked against the HF config
        and loaded with llama-cpp-python.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    source = hf_dir
    if adapter_dir is not None:
        source = gguf.merge_adapter(hf_dir, adapter_dir, out_dir / "merged")
    artifacts = {"f16": gguf.convert_to_gguf(source, out_dir / "model-f16.gguf", outtype="f16")}
    for qtype in quantizations:
        artifacts[qtype] = gguf.quantize(artifacts["f16"].path, out_dir / f"model-{qtype}.gguf", qtype)
    for artifact in artifacts.values():
        gguf.check_gguf(artifact.path, source)
        gguf.load_gguf(artifact.path)
    return artifacts


def record_package(store: ledger.Store, artifacts: dict[str, gguf.GGUFArtifact], hf_sha256: str, out_dir: Path,
                   adapter_sha256: str | None, run_id: str | None) -> str:
    """Record what :func:`package` made in the store, one production each with ``run_id``: the merged
    checkpoint ``out_dir/merged`` (made from the adapter) when an adapter was merged, the f16 GGUF
    as made from the checkpoint it was converted from, and each quantized GGUF as made from the f16
    one. The lifecycle's package stages and the standalone ``package`` flow both record this way.

    Args:
        store: the ledger.
        artifacts: :func:`package`'s result (``{"f16": ..., "<QTYPE>": ...}``).
        hf_sha256: ``sha256_tree`` of the HF checkpoint given to :func:`package` (the base).
        out_dir: :func:`package`'s ``out_dir``.
        adapter_sha256: the merged adapter's digest, or None when nothing was merged.
        run_id: the Prefect flow run id.

    Returns:
        The digest the f16 GGUF is recorded as made from: ``hf_sha256`` without an adapter, else the
        merged checkpoint's ``sha256_tree`` (the adapter's digest if no merged folder is there).

    Raises:
        InputError: a digest is already recorded with another kind or quantization.
    """
    source_sha = hf_sha256
    if adapter_sha256 is not None:
        merged = Path(out_dir) / "merged"
        source_sha = adapter_sha256
        if (merged / "config.json").is_file():  # the merged checkpoint the GGUFs came from
            source_sha = sha256_tree(merged)
            store.record_model_artifact(ledger.ModelArtifactRecord(
                sha256=source_sha, kind="merged", path=str(merged), parent_sha256=adapter_sha256, run_id=run_id))
    for qtype, art in artifacts.items():
        parent = source_sha if qtype == "f16" or "f16" not in artifacts else artifacts["f16"].sha256
        store.record_model_artifact(ledger.ModelArtifactRecord(sha256=art.sha256, kind="gguf", path=str(art.path),
                                    quantization=qtype, parent_sha256=parent, run_id=run_id))
    return source_sha
