"""The forgeflow CLI on a store the test fills itself (no Prefect server needed)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store

runner = CliRunner()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("FORGEFLOW_STORE_URL", raising=False)
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    outcomes = {"a": [1.0, 0.0, 0.0, None], "b": [1.0, 1.0, 0.0, 1.0]}
    for job, rewards in outcomes.items():
        for i, reward in enumerate(rewards):
            store.record_trial(TrialRecord(
                trial_id=f"{job}-{i}", instance_id=f"repo.task__{i}", kind="agent", job_id=job, reward=reward,
                exception_type=None if reward is not None else "ModelEndpointError",
                exception_message=None if reward is not None else "connection refused"))
    return tmp_path


def test_trials_json_shows_reward_or_exception_per_trial(home):
    result = runner.invoke(app, ["trials", "--job", "a", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["instance_id"]: r for r in json.loads(result.output)}
    assert rows["repo.task__3"]["reward"] is None and rows["repo.task__3"]["exception_type"] == "ModelEndpointError"
    assert rows["repo.task__0"]["reward"] == 1.0


def test_compare_json_excludes_exception_pairs(home):
    result = runner.invoke(app, ["compare", "a", "b", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert (out["n_pairs"], out["wins"], out["ties"], out["losses"]) == (3, 1, 2, 0)
    assert out["excluded_exception"] == ["repo.task__3"]


def test_unknown_job_names_the_job_and_lists_known_ones(home):
    result = runner.invoke(app, ["trials", "--job", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output and "a, b" in result.output


def test_demo_with_unknown_project_fails_before_any_work(home):
    result = runner.invoke(app, ["demo", "--projects", "six,nosuch"])
    assert result.exit_code == 2
    assert "nosuch" in result.output and "boltons" in result.output
    assert not (home / "demo" / "summary.json").exists()


@pytest.fixture
def frozen(home):
    from forgeflow.curation import freeze
    from forgeflow.ledger.records import FreezeRecord

    accepted = [freeze.TaskRef(instance_id=f"r{r}.t{i}", repo=f"r{r}") for r in range(3) for i in range(2)]
    quotas = freeze.SplitQuotas(train=1, validation=1, test=1, max_per_repo=2, min_repos=3)
    manifest = freeze.write_freeze("v1", freeze.select_splits(accepted, quotas, 0), quotas, 0,
                                   home / "demo" / "freezes")
    Store().record_freeze(FreezeRecord(name="v1", semantic_sha256=manifest.semantic_sha256,
                                       file_sha256=manifest.file_sha256, manifest_path=str(manifest.path)))
    return manifest


def test_freeze_verify_ok_matches_the_store(frozen):
    result = runner.invoke(app, ["freeze", "verify", "v1"])
    assert result.exit_code == 0, result.output
    assert "matches the store" in result.output


def test_freeze_verify_catches_a_consistently_retouched_manifest(frozen, tmp_path):
    from forgeflow.common.fsutil import with_semantic_digest

    doc = json.loads(frozen.path.read_text())
    moved = doc["splits"]["test"].pop()
    doc["splits"]["train"].append(moved)  # breaks repository-disjointness; counts and digest made to match
    doc["counts"] = {k: len(v) for k, v in doc["splits"].items()}
    doc = with_semantic_digest(doc)
    out = tmp_path / "copy"
    out.mkdir()
    (out / "v1.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    result = runner.invoke(app, ["freeze", "verify", "v1", "--freezes-dir", str(out)])
    assert result.exit_code == 2
    assert frozen.file_sha256 in result.output or frozen.semantic_sha256 in result.output
    assert "Traceback" not in result.output


def test_freeze_verify_refuses_a_manifest_of_another_name(frozen, tmp_path):
    out = tmp_path / "renamed"
    out.mkdir()
    (out / "v2.json").write_bytes(frozen.path.read_bytes())
    result = runner.invoke(app, ["freeze", "verify", "v2", "--freezes-dir", str(out)])
    assert result.exit_code == 2
    assert "is freeze 'v1', not 'v2'" in result.output


def test_freeze_verify_of_a_missing_freeze_is_one_line(home):
    result = runner.invoke(app, ["freeze", "verify", "nosuch"])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_freeze_verify_of_a_freeze_made_before_bundles_says_the_bundle_is_absent(frozen):
    result = runner.invoke(app, ["freeze", "verify", "v1"])
    assert result.exit_code == 0, result.output
    assert "bundle absent" in result.output and "made before export bundles" in result.output


@pytest.fixture
def bundled(home):
    """A freeze as the freeze flow writes it now: manifest, export bundle, and the store's three digests."""
    from forgeflow.curation import bundle, freeze
    from forgeflow.ledger.records import FreezeRecord

    accepted = [freeze.TaskRef(instance_id=f"r{r}.t{i}", repo=f"r{r}") for r in range(3) for i in range(2)]
    quotas = freeze.SplitQuotas(train=1, validation=1, test=1, max_per_repo=2, min_repos=3)
    manifest = freeze.write_freeze("v2", freeze.select_splits(accepted, quotas, 0), quotas, 0,
                                   home / "demo" / "freezes")
    written = bundle.write_bundle(manifest, [bundle.BundleTask(instance_id=t.instance_id, repo=t.repo,
                                                               FAIL_TO_PASS=["t.py::f"]) for t in accepted])
    Store().record_freeze(FreezeRecord(name="v2", semantic_sha256=manifest.semantic_sha256,
                                       file_sha256=manifest.file_sha256, manifest_path=str(manifest.path),
                                       bundle_sha256=written.sha256, bundle_path=str(written.tarball)))
    return manifest, written


def test_freeze_verify_checks_all_three_digests(bundled):
    manifest, written = bundled
    result = runner.invoke(app, ["freeze", "verify", "v2"])
    assert result.exit_code == 0, result.output
    assert "matches the store" in result.output
    for digest in (manifest.semantic_sha256, manifest.file_sha256, written.sha256):
        assert digest in result.output
    assert str(written.tarball) in result.output


def test_freeze_verify_names_the_bundle_digest_of_a_tampered_tarball(bundled):
    _, written = bundled
    with tarfile.open(written.tarball) as tar:  # a plausible edit: same members, one row changed
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    with tarfile.open(written.tarball, "w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members:
            if member.name.endswith("train/dataset_info.json"):
                data = data.replace(b"{", b"{ ", 1)
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    result = runner.invoke(app, ["freeze", "verify", "v2"])
    assert result.exit_code == 2
    assert "bundle sha256" in result.output and str(written.tarball) in result.output
    assert written.sha256 in result.output and "Traceback" not in result.output


def test_freeze_verify_names_the_file_digest_of_a_reformatted_manifest(bundled):
    manifest, _ = bundled
    doc = json.loads(manifest.path.read_text())
    manifest.path.write_text(json.dumps(doc, indent=4, sort_keys=True) + "\n")  # same content, other bytes
    result = runner.invoke(app, ["freeze", "verify", "v2"])
    assert result.exit_code == 2
    assert "file sha256" in result.output and str(manifest.path) in result.output
    assert manifest.file_sha256 in result.output


def test_freeze_verify_names_the_semantic_digest_of_an_edited_manifest(bundled):
    manifest, _ = bundled
    doc = json.loads(manifest.path.read_text())
    doc["seed"] = 1
    manifest.path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    result = runner.invoke(app, ["freeze", "verify", "v2"])
    assert result.exit_code == 2
    assert "semantic_sha256" in result.output and str(manifest.path) in result.output
    assert manifest.semantic_sha256 in result.output


def test_lineage_walks_from_the_served_gguf_to_the_base_model(home):
    from forgeflow.ledger.records import ModelArtifactRecord, ServingGenerationRecord

    store = Store()
    base, adapter, gguf = "a" * 64, "b" * 64, "c" * 64
    store.record_model_artifact(ModelArtifactRecord(sha256=base, kind="base", path="/m/base"))
    store.record_model_artifact(ModelArtifactRecord(sha256=adapter, kind="adapter", path="/m/adapter",
                                                    parent_sha256=base, lineage={"dataset_sha256": "d" * 64,
                                                                                 "algorithm": "sft", "device": "cpu",
                                                                                 "dtype": "float32"}))
    store.record_model_artifact(ModelArtifactRecord(sha256=gguf, kind="gguf", path="/m/q8.gguf",
                                                    quantization="Q8_0", parent_sha256=adapter))
    store.record_serving_generation(ServingGenerationRecord(generation=2, port=8802, gguf_sha256=gguf,
                                                            status="active"))
    result = runner.invoke(app, ["lineage", gguf[:12], "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [step["kind"] for step in out["chain"]] == ["base", "adapter", "gguf"]
    assert out["chain"][1]["lineage"]["dataset_sha256"] == "d" * 64
    assert [g["generation"] for g in out["serving_generations"]] == [2]
    text = runner.invoke(app, ["lineage", gguf[:12], "--no-verify"]).output
    lines = text.splitlines()  # the adapter's line, then what it was trained on
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("adapter"))
    assert f"dataset {'d' * 16}  (sft/cpu/float32)" in lines[at + 1], text


def test_lineage_json_keeps_both_adapters_that_made_the_same_gguf(home, tmp_path):
    """Regression (new-user trial): the served Q8_0 GGUF was byte-identical for two adapters and the
    second record replaced the first's parent; both chains are shown, the newest first."""
    from forgeflow.ledger.records import ModelArtifactRecord, ServingGenerationRecord

    store = Store()
    base, gguf = "a" * 64, "c" * 64
    store.record_model_artifact(ModelArtifactRecord(sha256=base, kind="base", path="/m/base", run_id="r1"))
    for adapter, run in (("b" * 64, "r1"), ("e" * 64, "r2")):
        store.record_model_artifact(ModelArtifactRecord(sha256=adapter, kind="adapter", path=f"/m/adapters/{adapter}",
                                                        parent_sha256=base, run_id=run))
        store.record_model_artifact(ModelArtifactRecord(sha256=gguf, kind="gguf", path="/m/q8.gguf",
                                                        quantization="Q8_0", parent_sha256=adapter, run_id=run))
    store.record_serving_generation(ServingGenerationRecord(generation=4, port=8802, gguf_sha256=gguf, status="active"))
    for _ in range(2):  # repeated queries answer the same
        result = runner.invoke(app, ["lineage", gguf, "--json"])
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert [[s["sha256"][0] for s in chain] for chain in out["chains"]] == [["a", "e", "c"], ["a", "b", "c"]]
        assert out["chain"] == out["chains"][0] and out["chain"][2]["run_ids"] == ["r2"]
        assert [g["generation"] for g in out["serving_generations"]] == [4]
        assert any("2 producers" in w for w in out["warnings"])
        assert out["chain"][0]["path_status"] == "missing"  # /m/base does not exist here
    text = runner.invoke(app, ["lineage", gguf[:10], "--no-verify"])
    assert text.exit_code == 0 and "chain 1 of 2 (newest)" in text.output and "missing" not in text.output


def test_lineage_of_an_unknown_artifact_says_so(home):
    result = runner.invoke(app, ["lineage", "deadbeefdeadbeef"])
    assert result.exit_code == 2 and "is not in the store" in result.output


def test_status_json_reports_store_counts_without_a_run(home):
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["counts"]["trials"] == 8 and out["last_lifecycle"] is None and out["serving"] is None


def test_status_prints_text_and_status_json_a_stable_object(frozen, home):
    from forgeflow.common.fsutil import atomic_write_json

    atomic_write_json(home / "demo" / "summary.json", {
        "prefect_flow_run_id": "run-1", "total_wall_s": 12.5, "freeze": {"name": "v1"},
        "stages": {"environments": {"status": "completed"}, "freeze": {"status": "cached"}}})
    as_json = runner.invoke(app, ["status", "--json"])
    assert as_json.exit_code == 0, as_json.output
    out = json.loads(as_json.output)
    assert list(out) == ["schema_version", "home", "store", "counts", "last_lifecycle", "last_freeze", "serving",
                         "service"]
    assert out["schema_version"] == 1 and out["home"] == str(home)
    assert out["last_lifecycle"] == {"prefect_flow_run_id": "run-1", "total_wall_s": 12.5,
                                     "stages": {"environments": "completed", "freeze": "cached"}}
    assert out["last_freeze"]["semantic_sha256"] == frozen.semantic_sha256

    text = runner.invoke(app, ["status"])
    assert text.exit_code == 0, text.output
    assert text.output != as_json.output and not text.output.lstrip().startswith("{")
    assert "trials 8" in text.output
    assert "lifecycle: flow run run-1, 12.5 s: environments completed, freeze cached" in text.output
    assert f"freeze:    v1, semantic sha256 {frozen.semantic_sha256}" in text.output
    assert "serving:   none" in text.output and "service:   not started" in text.output


def test_status_takes_the_latest_freeze_from_the_store_without_a_summary(frozen, home):
    """The store holds a freeze (its counts say freezes 1) but no summary.json names it: status
    must still show it, in text and JSON."""
    assert not (home / "demo" / "summary.json").exists()
    out = json.loads(runner.invoke(app, ["status", "--json"]).output)
    assert out["counts"]["freezes"] == 1
    assert out["last_freeze"]["name"] == "v1" and out["last_freeze"]["semantic_sha256"] == frozen.semantic_sha256
    text = runner.invoke(app, ["status"])
    assert f"freeze:    v1, semantic sha256 {frozen.semantic_sha256}" in text.output
    assert "freeze:    none" not in text.output


def test_status_falls_back_to_the_summary_freeze_only_when_the_store_has_none(home):
    from forgeflow.common.fsutil import atomic_write_json

    atomic_write_json(home / "demo" / "summary.json", {
        "freeze": {"name": "v9", "semantic_sha256": "c" * 64}, "stages": {"freeze": {"status": "completed"}}})
    out = json.loads(runner.invoke(app, ["status", "--json"]).output)
    assert out["last_freeze"]["name"] == "v9" and out["last_freeze"]["semantic_sha256"] == "c" * 64
    assert f"freeze:    v9, semantic sha256 {'c' * 64}" in runner.invoke(app, ["status"]).output


@pytest.mark.parametrize(("args", "flag"), [(["trials", "--merged"], "--merged needs --job"),
                                            (["trials", "--job", ""], "--job is empty"),
                                            (["trials", "--job", " ", "--merged"], "--job is empty")])
def test_trials_flags_that_would_be_ignored_are_errors(home, args, flag):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert flag in " ".join(result.output.split())


@pytest.mark.parametrize("name", ["../demo/summary", "../demo/freezes/v1", "a/b", "..", "", "x.y"])
def test_derived_verify_and_build_refuse_a_name_that_is_a_path(frozen, home, name):
    for args in (["derived", "verify", name], ["derived", "build", name, "--define", "x = accepted"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert f"derived set name {name!r} is invalid" in text and "no path separators or '..'" in text
        assert "altered" not in text and "validation error" not in text
    assert not (home / "derived").exists()


def test_lineage_of_a_short_or_empty_prefix_says_what_to_give(home):
    from forgeflow.ledger.records import ModelArtifactRecord

    Store().record_model_artifact(ModelArtifactRecord(sha256="2a2cd76" + "0" * 57, kind="gguf", path="/m/x.gguf"))
    short = runner.invoke(app, ["lineage", "2a2cd76"])
    assert short.exit_code == 2 and "too short: give at least 8 hex characters" in " ".join(short.output.split())
    empty = runner.invoke(app, ["lineage", ""])
    assert empty.exit_code == 2 and "is empty" in empty.output and "ambiguous" not in empty.output


def test_demo_with_a_used_freeze_name_and_other_inputs_exits_2_before_any_stage(home):
    """A freeze name already made from other inputs is the user's input: refused before the flow runs
    (nothing written besides what was there; the flow itself refuses it too:
    tests/flows/test_lifecycle_freeze_guard.py), one `error:` line, exit 2."""
    from forgeflow.config import LifecycleConfig
    from forgeflow.curation.freeze import manifest_path, record_freeze_inputs

    freezes = home / "demo" / "freezes"
    freezes.mkdir(parents=True)
    manifest_path("demo-v1", freezes).write_text("{}")
    record_freeze_inputs("demo-v1", freezes, LifecycleConfig().freeze_inputs())
    result = runner.invoke(app, ["demo", "--candidates", "3"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error: FreezeConflictError: freeze 'demo-v1' already exists"), text
    assert "candidates_per_project: 5 then, 3 now" in text and "choose a new freeze name" in text
    assert sorted(p.name for p in (home / "demo").iterdir()) == ["freezes"]


def test_demo_with_an_output_dir_it_cannot_make_is_refused_naming_it_before_any_stage(home, tmp_path):
    """Regression (new-user trial): `--output-dir /proc/forbidden` started the flow, then failed with a
    bare FileNotFoundError. Now one `error:` line naming --output-dir, exit 2, before anything starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    result = runner.invoke(app, ["demo", "--output-dir", str(blocker / "results")])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"--output-dir {blocker / 'results'}: cannot hold the demo's results (Not a directory)" in said, said
    assert blocker.read_text() == "not a folder\n" and not (home / "demo").exists()


def test_demo_exits_1_on_infrastructure_failure(home, monkeypatch):
    """An infrastructure failure stays exit 1. (The lifecycle is replaced by one that raises
    SandboxError: a real one would need podman broken on purpose for the whole machine.)"""
    import flows.lifecycle
    from forgeflow.common.errors import SandboxError

    def broken(config):
        raise SandboxError("podman is not answering")

    monkeypatch.setattr(flows.lifecycle, "lifecycle", broken)
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 1 and "SandboxError" in result.output


def test_demo_with_an_empty_projects_list_is_refused_not_read_as_all(home):
    result = runner.invoke(app, ["demo", "--projects", ""])
    assert result.exit_code == 2 and "unknown project" in " ".join(result.output.split()), result.output
    assert not (home / "demo").exists()


def test_demo_options_set_the_nested_config_fields(home, monkeypatch):
    """--freeze-name and --keep-serving land in the config's groups (freeze.name,
    serving.keep_running); everything else keeps the demo's defaults. (The lifecycle is replaced by
    one that records its config and stops.)"""
    import flows.lifecycle
    from forgeflow.common.errors import SandboxError
    from forgeflow.config import LifecycleConfig

    seen = []

    def recording(config):
        seen.append(config)
        raise SandboxError("stopped after the config was seen")

    monkeypatch.setattr(flows.lifecycle, "lifecycle", recording)
    result = runner.invoke(app, ["demo", "--projects", "six,toolz,boltons", "--candidates", "4",
                                 "--freeze-name", "demo-v9", "--keep-serving"])
    assert result.exit_code == 1 and "stopped after the config was seen" in result.output, result.output
    (config,) = seen
    assert config.projects == ("six", "toolz", "boltons") and config.candidates_per_project == 4
    assert config.freeze.name == "demo-v9" and config.serving.keep_running is True
    assert config.output_dir == home / "demo"
    defaults = LifecycleConfig()
    assert config.freeze.quotas == defaults.freeze.quotas
    assert config.model_dump(exclude={"projects", "candidates_per_project", "output_dir", "freeze", "serving"}) \
        == defaults.model_dump(exclude={"projects", "candidates_per_project", "output_dir", "freeze", "serving"})
    assert config.serving.model_dump(exclude={"keep_running"}) \
        == defaults.serving.model_dump(exclude={"keep_running"})


def test_demo_with_a_bad_freeze_name_is_refused_naming_the_nested_field(home):
    result = runner.invoke(app, ["demo", "--freeze-name", "Demo V1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "freeze.name" in text, result.output
    assert not (home / "demo").exists()
