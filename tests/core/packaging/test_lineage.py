"""Lineage of a served GGUF from the store (``forgeflow.packaging.lineage``), adapter digests and
content-addressed adapter folders (``forgeflow.training.adapters.adapter_sha256`` / ``pin_adapter``).

No training: adapter folders are written as peft's ``save_pretrained`` lays them out (weights,
config, README) plus ``lineage.json``; the digests are real. Store tests run on SQLite and
PostgreSQL (tests/pgfixtures.py)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.ledger.records import ModelArtifactRecord, ServingGenerationRecord
from forgeflow.ledger.store import Store
from forgeflow.packaging.lineage import lineage_of
from forgeflow.training.adapters import (
    LINEAGE_FILE,
    AdapterRecord,
    Lineage,
    adapter_sha256,
    pin_adapter,
)


def _adapter(folder: Path, weights: bytes, readme: str = "# adapter\n", run_id: str = "run-1") -> AdapterRecord:
    """An adapter folder as peft writes it, plus the lineage.json a burst adds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (folder / "README.md").write_text(readme)
    lineage = Lineage(base_model_sha256="a" * 64, parent_adapter_sha256=None, dataset_sha256="d" * 64,
                      hyperparameters={"lora_r": 8}, run_id=run_id, created_at=datetime.now(timezone.utc))
    digest = adapter_sha256(folder)
    (folder / LINEAGE_FILE).write_text(json.dumps({"schema_version": 3, "sha256": digest, "final_loss": 1.0,
                                                   "steps": 1, "lineage": lineage.model_dump(mode="json")}))
    return AdapterRecord(path=folder, sha256=digest, lineage=lineage, final_loss=1.0, steps=1)


def test_adapter_digest_names_the_weights_and_config_not_the_metadata(tmp_path: Path) -> None:
    """Regression (new-user trial): the digest covered README and every other file, so lineage
    metadata changed it; re-running identical training must give the same digest."""
    first = _adapter(tmp_path / "one", b"weights-1", readme="base_model: /home/a/base\n", run_id="run-1")
    again = _adapter(tmp_path / "two", b"weights-1", readme="base_model: /home/b/base\n", run_id="run-2")
    (again.path / "training_args.bin").write_bytes(b"\x00\x01")
    assert first.sha256 == again.sha256 == adapter_sha256(again.path)
    other = _adapter(tmp_path / "three", b"weights-2")
    assert other.sha256 != first.sha256
    (other.path / "adapter_config.json").write_text(json.dumps({"r": 16, "peft_type": "LORA"}))
    assert adapter_sha256(other.path) != other.sha256


def test_adapter_digest_of_a_folder_without_weights_names_the_missing_file(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(InputError, match=r"adapter_model\.safetensors"):
        adapter_sha256(tmp_path)


def test_pinned_adapter_folders_are_never_reused_for_other_content(tmp_path: Path) -> None:
    """Regression (new-user trial): the demo trained every burst into models/adapter, so an old
    adapter's row pointed at a folder that later held another adapter."""
    work, pinned = tmp_path / "models" / "adapter", tmp_path / "models" / "adapters"
    first = pin_adapter(_adapter(work, b"weights-1"), pinned)
    first_working = AdapterRecord(**{**first.model_dump(), "path": work})
    second = pin_adapter(_adapter(work, b"weights-2"), pinned)  # the next burst overwrote the working folder
    assert first.path == (pinned / first.sha256).resolve() and second.path == (pinned / second.sha256).resolve()
    assert adapter_sha256(first.path) == first.sha256 and adapter_sha256(second.path) == second.sha256
    assert (first.path / LINEAGE_FILE).is_file() and not list(pinned.glob(".*"))  # no staging left
    # a stale record of the first adapter (e.g. a cached result) still finds its own folder
    assert pin_adapter(first_working, pinned).path == first.path
    gone = AdapterRecord(**{**first_working.model_dump(), "sha256": "f" * 64})
    with pytest.raises(InputError, match="now holds"):
        pin_adapter(gone, pinned)


def _chain(store: Store, tmp_path: Path, adapter: AdapterRecord, gguf_bytes: bytes, run_id: str) -> tuple[str, str]:
    """Record base -> adapter -> merged -> GGUF f16 -> Q8_0 as the lifecycle does; returns (merged, q8) digests."""
    base = tmp_path / "base"
    if not base.is_dir():
        base.mkdir()
        (base / "config.json").write_text("{}")
    merged = tmp_path / f"merged-{adapter.sha256[:8]}"
    merged.mkdir(exist_ok=True)
    (merged / "model.safetensors").write_bytes(b"merged-" + adapter.sha256.encode())
    f16, q8 = tmp_path / f"{run_id}-f16.gguf", tmp_path / f"{run_id}-q8.gguf"
    f16.write_bytes(b"f16" + gguf_bytes)
    q8.write_bytes(b"q8" + gguf_bytes)
    rows = [("base", base, sha256_tree(base), None, None, None),
            ("adapter", adapter.path, adapter.sha256, sha256_tree(base), None, adapter.lineage.model_dump(mode="json")),
            ("merged", merged, sha256_tree(merged), adapter.sha256, None, None),
            ("gguf", f16, sha256_file(f16), sha256_tree(merged), "f16", None),
            ("gguf", q8, sha256_file(q8), sha256_file(f16), "Q8_0", None)]
    for kind, path, sha, parent, quant, lineage in rows:
        store.record_model_artifact(ModelArtifactRecord(sha256=sha, kind=kind, path=str(path), parent_sha256=parent,
                                                        quantization=quant, lineage=lineage or {}, run_id=run_id))
    return sha256_tree(merged), sha256_file(q8)


def test_lineage_walks_base_adapter_merged_gguf_to_the_serving_generation(store: Store, tmp_path: Path) -> None:
    adapter = pin_adapter(_adapter(tmp_path / "work", b"weights-1"), tmp_path / "adapters")
    _, q8 = _chain(store, tmp_path, adapter, b"model-1", "run-1")
    store.record_serving_generation(ServingGenerationRecord(generation=3, port=8802, gguf_sha256=q8, status="active"))
    report = lineage_of(store, q8[:12])
    assert report.artifact_sha256 == q8 and len(report.chains) == 1 and report.warnings == []
    steps = report.chain
    assert [(s.kind, s.quantization) for s in steps] == [("base", None), ("adapter", None), ("merged", None),
                                                         ("gguf", "f16"), ("gguf", "Q8_0")]
    assert all(s.path_status == "ok" for s in steps)
    assert steps[1].lineage["dataset_sha256"] == "d" * 64 and steps[1].run_ids == ["run-1"]
    assert [g.generation for g in report.serving_generations] == [3]


def test_the_same_gguf_from_two_adapters_shows_both_chains(store: Store, tmp_path: Path) -> None:
    one = pin_adapter(_adapter(tmp_path / "work", b"weights-1"), tmp_path / "adapters")
    two = pin_adapter(_adapter(tmp_path / "work", b"weights-2"), tmp_path / "adapters")
    _, q8_one = _chain(store, tmp_path, one, b"same-bytes", "run-1")
    _, q8_two = _chain(store, tmp_path, two, b"same-bytes", "run-2")
    _chain(store, tmp_path, two, b"same-bytes", "run-3")  # a repeated run of the same chain
    assert q8_one == q8_two
    report = lineage_of(store, q8_one)
    assert len(report.chains) == 2
    adapters = [next(s for s in chain if s.kind == "adapter") for chain in report.chains]
    assert [a.sha256 for a in adapters] == [two.sha256, one.sha256]  # the newest producer first
    assert adapters[0].run_ids == ["run-2", "run-3"] and report.chain[1].sha256 == two.sha256
    assert any("2 producers" in w for w in report.warnings)


def test_lineage_says_when_a_recorded_folder_now_holds_other_content(store: Store, tmp_path: Path) -> None:
    work = tmp_path / "models" / "adapter"
    first = _adapter(work, b"weights-1")
    _, q8 = _chain(store, tmp_path, first, b"model-1", "run-1")
    _adapter(work, b"weights-2")  # an old-style run reused the folder for another adapter
    report = lineage_of(store, q8)
    step = next(s for s in report.chain if s.kind == "adapter")
    assert step.path_status == "changed"
    assert any(str(work) in w and first.sha256 in w for w in report.warnings)
    for p in (tmp_path / "run-1-f16.gguf",):
        p.unlink()
    assert next(s for s in lineage_of(store, q8).chain if s.quantization == "f16").path_status == "missing"
    assert lineage_of(store, q8, verify_paths=False).chain[1].path_status == "unchecked"


def test_lineage_of_an_unknown_or_ambiguous_prefix_is_an_input_error(store: Store) -> None:
    for sha in ("ab" + "0" * 62, "ab000000" + "1" * 56):
        store.record_model_artifact(ModelArtifactRecord(sha256=sha, kind="gguf", path="/m/x.gguf"))
    with pytest.raises(InputError, match="'ab000000' is ambiguous"):
        lineage_of(store, "ab000000")
    with pytest.raises(InputError, match="not in the store"):
        lineage_of(store, "deadbeefdeadbeef")
    assert lineage_of(store, "ab0000000").artifact_sha256 == "ab" + "0" * 62


def test_a_short_or_empty_prefix_says_so_not_ambiguous(store: Store) -> None:
    """A user who pastes 7 hex characters of a digest that one artifact matches, or nothing at all,
    is told how many characters to give, not that the prefix "is ambiguous"."""
    store.record_model_artifact(ModelArtifactRecord(sha256="2a2cd76" + "0" * 57, kind="gguf", path="/m/x.gguf"))
    with pytest.raises(InputError, match="'2a2cd76' is too short: give at least 8 hex characters") as short:
        lineage_of(store, "2a2cd76")
    assert "ambiguous" not in str(short.value)
    for empty in ("", "  "):
        with pytest.raises(InputError, match="is empty: give at least 8 hex characters") as none:
            lineage_of(store, empty)
        assert "ambiguous" not in str(none.value)
    for typo in ("zzzzzzzzzz", "2a2cd76-0000", "/m/x.gguf"):  # not "not in the store": it could never be
        with pytest.raises(InputError, match=rf"artifact '{typo}' is not a sha256 prefix: a sha256 is hex characters"):
            lineage_of(store, typo)
