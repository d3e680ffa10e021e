"""The lifecycle on the team's own registries and checkpoint: ``registries.source_block`` / ``target_block`` name
saved ``forgeflow-registry`` blocks, and no embedded registry starts; ``base_model.local_dir`` is a checkpoint
folder of the team's (a copy of the tiny Qwen2 checkpoint, outside the run's folder), which the base-model flow
checks and every model artifact descends from.

Real components: two docker-registry instances with htpasswd (basic) auth on loopback ports 5717/5718 (listed
insecure in infra/registries.conf, as podman's pulls need), the target with a namespace; skopeo, podman, the
whole lifecycle (a 2-project mini run) under the session's Prefect harness. The password is only in the blocks.
"""

from __future__ import annotations

import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.core import RegistryEndpoint
from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_tree
from forgeflow.common.settings import tool_env
from forgeflow.config import LifecycleConfig
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
def team_run(prefect_harness, tmp_path_factory):
    from flows.lifecycle import lifecycle

    root = tmp_path_factory.mktemp("team-registries")
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
        config = LifecycleConfig(
            projects=("inflection", "cachetools"), candidates_per_project=2, seed=0, output_dir=root / "run",
            registries={"source_block": "team-source", "target_block": "team-target"},
            prewarm={"shards": 2, "lanes": 1}, validation={"concurrency": 2},
            freeze={"name": "team-v1",
                    "quotas": {"train": 1, "validation": 0, "test": 1, "max_per_repo": 2, "min_repos": 2}},
            canary={"step_limit": 2, "max_tokens": 32}, burst={"max_steps": 1}, package={"quantizations": ("Q8_0",)},
            serving={"ports": (free_port(), free_port())}, base_model={"local_dir": checkpoint})
        lifecycle(config=config)
        yield config, json.loads((config.output_dir / "summary.json").read_text())
    finally:
        for server in servers:
            server.stop()
        mp.undo()


def test_every_stage_runs_on_the_teams_registries_and_no_embedded_one_starts(team_run) -> None:
    config, summary = team_run
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


def test_every_model_descends_from_the_teams_checkpoint_folder(team_run) -> None:
    """The base-model stage used the folder in place (nothing copied into the run), and the served baseline
    GGUF, the adapter and the candidate GGUF all trace back to it in the ledger."""
    from forgeflow.packaging.lineage import lineage_of

    config, summary = team_run
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


def test_the_images_need_the_blocks_credentials_and_the_password_is_nowhere_else(team_run, tmp_path: Path) -> None:
    config, summary = team_run
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
