"""The lifecycle flow end to end on a 2-project mini run on the team's own registries and checkpoint, under the
session's Prefect harness: one run (and its cached re-run) checked for stages, counts, artifacts, the store and the
UI's runs, and for the team's setting: ``registries.source_block`` / ``target_block`` name saved
``forgeflow-registry`` blocks (no embedded registry starts) and ``base_model.local_dir`` is a checkpoint folder of
the team's (a copy of the tiny Qwen2 checkpoint, outside the run's folder), which every model artifact descends from.

Real components throughout: two docker-registry instances with htpasswd (basic) auth on loopback ports 5717/5718
(listed insecure in infra/registries.conf, as podman's pulls need), the target with a namespace; skopeo, podman
containers, swesmith, TRL, llama.cpp's converter and quantizer, llama-cpp-python's server, mini-swe-agent. The
password is only in the blocks. One lifecycle run serves every check here: a run is the suite's most expensive
fixture.
"""

from __future__ import annotations

import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd
import json
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.core import RegistryEndpoint
from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.common.settings import tool_env
from forgeflow.config import LifecycleConfig
from forgeflow.curation.bundle import verify_bundle
from forgeflow.curation.freeze import verify_freeze
from forgeflow.ledger.store import Store
from forgeflow.registry.auth import authfile
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo
from tests.helpers import free_port, tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOURCE_PORT, TARGET_PORT = 5717, 5718
USER, PASSWORD = "team-ci", "team-Pa55-" + uuid.uuid4().hex[:10]
NAMESPACE = "team/agents"


def _anonymous_inspect(ref: str, scratch: Path) -> subprocess.CompletedProcess:
    empty = scratch / "no-credentials.json"
    empty.write_text("{}")
    env = {k: v for k, v in tool_env().items() if k != "REGISTRY_AUTH_FILE"}
    return subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", "--authfile", str(empty),
                           f"docker://{ref}"], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def mini_config(prefect_harness, tmp_path_factory):
    """The team's two authenticated registries (running for the module), their blocks, the checkpoint folder, this
    module's own store, and the mini run's config on them."""
    root = tmp_path_factory.mktemp("lifecycle")
    htpasswd = root / "htpasswd"
    htpasswd.write_text(f"{USER}:{crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    servers = [RegistryServer("team-source", SOURCE_PORT, root / "source", htpasswd_path=htpasswd),
               RegistryServer("team-target", TARGET_PORT, root / "target", htpasswd_path=htpasswd)]
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{root / 'store.db'}")  # this run's own ledger
    checkpoint = root / "team-checkpoint"  # the team's base model: a checkpoint folder, used in place
    shutil.copytree(tiny_ggufs()[0].parent / "hf", checkpoint)
    try:
        for server in servers:
            server.start()
        RegistryEndpoint(address=f"127.0.0.1:{SOURCE_PORT}", username=USER,
                         password=SecretStr(PASSWORD)).save("team-source", overwrite=True)
        RegistryEndpoint(address=f"127.0.0.1:{TARGET_PORT}", namespace=NAMESPACE, username=USER,
                         password=SecretStr(PASSWORD)).save("team-target", overwrite=True)
        yield LifecycleConfig(
            projects=("inflection", "cachetools"), candidates_per_project=3, seed=0, output_dir=root / "run",
            registries={"source_block": "team-source", "target_block": "team-target"},
            prewarm={"shards": 4, "lanes": 2}, validation={"concurrency": 2},
            freeze={"name": "mini-v1",
                    "quotas": {"train": 1, "validation": 0, "test": 1, "max_per_repo": 2, "min_repos": 2}},
            canary={"agent_config": {"step_limit": 2, "max_tokens": 48}}, burst={"max_steps": 2}, package={"quantizations": ("Q8_0",)},
            serving={"ports": (free_port(), free_port())}, base_model={"local_dir": checkpoint})
    finally:
        for server in servers:
            server.stop()
        mp.undo()


@pytest.fixture(scope="module")
def first_run(mini_config):
    from flows.lifecycle import lifecycle

    lifecycle(config=mini_config)
    return json.loads((mini_config.output_dir / "summary.json").read_text())



def test_every_stage_completes_with_real_counts(first_run, mini_config):
    stages = first_run["stages"]
    assert list(stages) == ["environments", "migrate", "generate", "prewarm", "validate", "freeze", "base_model",
                            "serve_baseline", "canary_baseline", "burst", "package", "serve_stage",
                            "canary_candidate", "compare", "serve_swap"]
    assert all(s["status"] in ("completed", "cached") for s in stages.values())
    assert stages["migrate"]["counts"]["completed"] == 2
    assert stages["validate"]["counts"]["accepted"] >= 2
    assert first_run["tasks"]["generated"] == 6
    # the canary scored every test task or recorded an exception: never silently dropped
    # the promotion gate holds for lack of evidence and the baseline keeps serving: the mini config's
    # test split is at most freeze.quotas.max_per_repo=2 tasks from the one repository the repository-disjoint
    # freeze leaves it (two projects, no validation split), far below promotion.min_pairs=30 /
    # promotion.min_repos=3, whatever the two tiny models score
    promotion = first_run["promotion"]
    assert promotion["verdict"] == "hold" and promotion["enough_evidence"] is False
    assert promotion["reason"].startswith("not enough evidence: ")
    assert promotion["n_pairs"] <= 2 and promotion["repos_needed"] == 3
    assert stages["compare"]["decision"]["verdict"] == "hold"
    assert stages["compare"]["decision"] == promotion
    # the compare flow clusters by the store's task rows: every paired task has its repository there
    report = (mini_config.output_dir / "compare.md").read_text()
    assert "clustered by instance" not in report and "canary_baseline-" in report and "canary_candidate-" in report
    assert stages["serve_swap"]["counts"]["promoted"] == 0
    assert stages["serve_swap"]["decision"].startswith("hold: not enough evidence")
    if promotion["n_pairs"]:  # a wide interval, never the bootstrap's zero width
        interval = first_run["comparison"]["delta_interval"]
        assert interval["high"] - interval["low"] > 0.5 and interval["method"].startswith("union(newcombe")
    # cost ratios come from the agent's recorded steps and tokens
    assert first_run["costs"]["agent_steps"]["n"] >= 1 and first_run["costs"]["input_tokens"]["mean_a"] > 0
    for stage in ("canary_baseline", "canary_candidate"):
        counts = stages[stage]["counts"]
        assert counts["scored"] + counts["exceptions"] == counts["requested"] >= 1


def test_the_run_shows_each_stage_as_a_subflow_run_with_its_own_task_runs(first_run):
    """What a person sees in the Prefect UI: the lifecycle run's stages as subflow runs, each holding its
    tasks (not every task run on the lifecycle's own timeline)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    from flows.stagekit import STAGE_FLOW_NAME

    lifecycle_id = UUID(first_run["prefect_flow_run_id"])
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[lifecycle_id])))
        stage_runs = {run.name: run for run in children if client.read_flow(run.flow_id).name == STAGE_FLOW_NAME}
        assert sorted(stage_runs) == sorted(["environments", "migrate", "generate", "prewarm", "validate", "freeze",
                                             "base_model", "serve_baseline", "canary_baseline", "burst", "package",
                                             "promote"])
        assert all(run.state.is_completed() for run in stage_runs.values())

        def task_runs(flow_run_id):
            return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

        # the validate stage is the curate flow one level down; its validations ran in its validate-batch task
        # runs (one per batch, every candidate of the run in one of them: a fresh store), none on the stage's run
        validate_counts = first_run["stages"]["validate"]["counts"]
        assert validate_counts["validated"] == validate_counts["candidates"] == first_run["tasks"]["generated"]
        (curate_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[stage_runs["validate"].id])))
        assert client.read_flow(curate_run.flow_id).name == "curate" and curate_run.state.is_completed()
        batches = [t for t in task_runs(curate_run.id) if t.name.startswith("validate-batch-")]
        assert batches and all(t.state.is_completed() for t in batches)
        batch_rows = {b.batch_id: b for b in Store().batches(kind="curate")}
        assert {t.name.removeprefix("validate-batch-") for t in batches} <= set(batch_rows)
        assert sum(len(batch_rows[t.name.removeprefix("validate-batch-")].instance_ids) for t in batches) \
            == validate_counts["validated"]
        assert not [t for t in task_runs(stage_runs["validate"].id) if t.name.startswith("validate-")]
        # the lifecycle's own run keeps only its registries and the stage runs (their parent task runs)
        own = task_runs(lifecycle_id)
        assert not [t for t in own if t.name.startswith(("validate-", "sft_burst-", "package-"))]
        # one code path: each of these stages runs the flow a user runs alone (the deployment's), one level down
        def child_flows(stage):
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[stage_runs[stage].id])))
            assert all(run.state.is_completed() for run in runs), stage
            return sorted(client.read_flow(run.flow_id).name for run in runs)

        assert child_flows("migrate") == ["migrate-images"]
        assert child_flows("prewarm") == ["prewarm-plan"]  # the plan (tag cap checked) the stage copies by
        assert child_flows("freeze") == ["freeze"]
        assert child_flows("base_model") == ["base-model", "package"]  # the team's folder checked, then packaged
        assert child_flows("serve_baseline") == ["serve"]
        assert child_flows("canary_baseline") == ["canary"]  # the canary flow on the frozen test split
        assert child_flows("burst") == ["sft-burst"]  # the flow records the adapter (parent: the base model)
        assert child_flows("package") == ["package"]
        # the candidate's canary and the compare stage run inside the promote stage's run (one transaction with
        # serve_stage and serve_swap): the canary flow on the staged model, the compare flow on the two jobs as stored
        assert child_flows("promote") == ["canary", "compare"]
        # the package flow's own task ran inside it: the stage's counts include it (cached on the second run)
        assert first_run["stages"]["package"]["tasks_run"] >= 1


def test_artifacts_on_disk_match_their_recorded_sha256(first_run):
    from forgeflow.training.adapters import adapter_sha256

    for name, art in first_run["artifacts"].items():
        digest = adapter_sha256 if name == "adapter" else sha256_file  # an adapter is a folder
        assert digest(art["path"]) == art["sha256"], name
    manifest = verify_freeze(first_run["artifacts"]["freeze_manifest"]["path"])
    assert manifest.semantic_sha256 == first_run["freeze"]["semantic_sha256"]
    # the export bundle: its tarball's sha256 is the freeze stage's third digest and the store's
    bundle = verify_bundle(manifest, first_run["artifacts"]["freeze_bundle"]["sha256"])
    assert bundle is not None and str(bundle.tarball) == first_run["artifacts"]["freeze_bundle"]["path"]
    freeze_stage = first_run["stages"]["freeze"]
    assert freeze_stage["digests"]["bundle_sha256"] == bundle.sha256 == first_run["freeze"]["bundle_sha256"]
    assert freeze_stage["paths"]["bundle"] == str(bundle.tarball)
    assert Store().get_freeze("mini-v1").bundle_sha256 == bundle.sha256
    assert bundle.counts == manifest.counts


def test_store_holds_one_row_per_natural_key(first_run):
    store = Store()
    counts = store.counts()
    assert counts["freezes"] == 1
    accepted = store.accepted_tasks()
    assert len(accepted) == first_run["tasks"]["accepted"]
    assert all(t.FAIL_TO_PASS for t in accepted)
    # serving.keep_running is off: the flow stopped its server, and the ledger does not claim one is live. The gate
    # held, so the staged candidate was discarded without becoming a generation: only the baseline's is recorded
    generations = store.serving_generations()
    assert [(g.generation, g.status) for g in generations] == [(1, "retired")]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", generations[-1].port), timeout=1)

    # the sft-burst flow recorded the adapter with the base model as its parent (one base row, not a second one):
    # the candidate GGUF traces back through the adapter to the base model
    from forgeflow.packaging.lineage import lineage_of

    base_sha, adapter_sha = first_run["stages"]["base_model"]["digests"]["hf"], first_run["artifacts"]["adapter"]["sha256"]
    assert [a.sha256 for a in store.model_artifacts() if a.kind == "base"] == [base_sha]
    assert [p.parent_sha256 for p in store.producers(adapter_sha)] == [base_sha]
    chain = [(step.sha256, step.kind) for step in lineage_of(store, first_run["artifacts"]["candidate-Q8_0"]["sha256"]).chain]
    assert chain[0] == (base_sha, "base") and (adapter_sha, "adapter") in chain
    assert chain[-1][0] == first_run["artifacts"]["candidate-Q8_0"]["sha256"]


def test_every_stage_runs_on_the_teams_registries_and_no_embedded_one_starts(mini_config, first_run) -> None:
    config, summary = mini_config, first_run
    stages = summary["stages"]
    assert all(s["status"] in ("completed", "cached") for s in stages.values()), stages
    assert stages["migrate"]["counts"]["completed"] == 2 and stages["validate"]["counts"]["accepted"] >= 2
    assert not (config.output_dir / "registry").exists()  # no embedded registry's storage
    store = Store()
    refs = {image.role: [] for image in store.images()}
    for image in store.images():
        refs[image.role].append(image.ref)
    assert refs["source"] and all(r.startswith(f"127.0.0.1:{SOURCE_PORT}/env/") for r in refs["source"])
    assert refs["target"] and all(r.startswith(f"127.0.0.1:{TARGET_PORT}/{NAMESPACE}/env/") for r in refs["target"])
    # the shard repositories live under the target's namespace, and validation pulled from there
    assert refs["task"] and all(r.startswith(f"127.0.0.1:{TARGET_PORT}/{NAMESPACE}/task-") for r in refs["task"])
    accepted = store.accepted_tasks()
    assert accepted and all(t.image_ref.startswith(f"127.0.0.1:{TARGET_PORT}/{NAMESPACE}/task-") for t in accepted)


def test_every_model_descends_from_the_teams_checkpoint_folder(mini_config, first_run) -> None:
    """The base-model stage used the folder in place (nothing copied into the run), and the served baseline
    GGUF, the adapter and the candidate GGUF all trace back to it in the ledger."""
    from forgeflow.packaging.lineage import lineage_of

    config, summary = mini_config, first_run
    folder = config.base_model.local_dir
    assert summary["stages"]["base_model"]["counts"]["source"] == "local"
    assert summary["stages"]["base_model"]["digests"]["hf"] == sha256_tree(folder)
    assert not (config.output_dir / "models" / "base").exists()  # the tiny model was not built
    store = Store()
    base = [a for a in store.model_artifacts() if a.kind == "base"]
    assert [(a.path, a.sha256) for a in base] == [(str(folder), sha256_tree(folder))]
    for name in ("base-Q8_0", "candidate-Q8_0"):
        chain = lineage_of(store, summary["artifacts"][name]["sha256"]).chain
        assert chain[0].kind == "base" and chain[0].sha256 == sha256_tree(folder), name
    candidate = lineage_of(store, summary["artifacts"]["candidate-Q8_0"]["sha256"]).chain
    assert "adapter" in [step.kind for step in candidate]


def test_the_images_need_the_blocks_credentials_and_the_password_is_nowhere_else(mini_config, first_run,
                                                                                 tmp_path: Path) -> None:
    config = mini_config  # first_run: after the run
    task_ref = next(image.ref for image in Store().images() if image.role == "task")
    refused = _anonymous_inspect(task_ref, tmp_path)
    assert refused.returncode != 0 and ("unauthorized" in refused.stderr.lower() or "401" in refused.stderr)
    with authfile({f"127.0.0.1:{TARGET_PORT}": (USER, PASSWORD)}) as path:
        assert Skopeo(authfile=path).inspect_digest(f"docker://{task_ref}").startswith("sha256:")
    assert "REGISTRY_AUTH_FILE" not in os.environ  # the run's auth file is gone with the run
    for path in config.output_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert PASSWORD.encode() not in path.read_bytes(), path
    store_db = Path(os.environ["FORGEFLOW_STORE_URL"].removeprefix("sqlite:///"))
    assert store_db.is_file() and PASSWORD.encode() not in store_db.read_bytes()
    # the migrate stage hands the blocks to its migrate-images subflow: its recorded parameters hide the password
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["migrate-images"])))
    recorded = [run for run in runs if f"127.0.0.1:{TARGET_PORT}" in json.dumps(run.parameters, default=str)]
    assert recorded and all(PASSWORD not in json.dumps(run.parameters, default=str) for run in recorded)


def test_a_missing_registry_block_is_refused_before_any_stage(prefect_harness, tmp_path: Path) -> None:
    from flows.lifecycle import lifecycle

    out = tmp_path / "run"
    with pytest.raises(InputError, match="target registry block 'no-such-registry' is not saved"):
        lifecycle(LifecycleConfig(output_dir=out, candidates_per_project=3,
                                  registries={"target_block": "no-such-registry"}))
    assert not (out / "summary.json").exists()


def test_second_run_is_answered_from_cache(first_run, mini_config):
    from flows.lifecycle import lifecycle

    lifecycle(config=mini_config)
    second = json.loads((mini_config.output_dir / "summary.json").read_text())
    live = {"serve_baseline", "serve_stage", "serve_swap"}  # servers are processes, started anew each run
    # a block's registry id names the run (flows/registry.py run_registries): each run pushes to the team's
    # registries again (skopeo skips the blobs already there), so the freeze, whose inputs carry the task images'
    # references, is written again as the same manifest (a no-op, digests below); the team's checkpoint folder is
    # hashed again
    repushed = {"environments", "prewarm", "freeze", "base_model"}
    for name, stage in second["stages"].items():
        if name == "validate":  # answered from the store: every candidate has its verdict, none validated again
            assert (stage["counts"]["validated"], stage["counts"]["trials"]) == (0, 0), (name, stage)
            assert stage["counts"]["accepted"] == first_run["stages"]["validate"]["counts"]["accepted"]
        elif name not in live | repushed:
            assert stage["status"] == "cached", (name, stage)
    assert second["freeze"]["semantic_sha256"] == first_run["freeze"]["semantic_sha256"]
    assert second["freeze"]["bundle_sha256"] == first_run["freeze"]["bundle_sha256"]
    assert second["total_wall_s"] < 0.5 * first_run["total_wall_s"]
    assert Store().counts()["freezes"] == 1
