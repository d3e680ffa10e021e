"""Registry flows against two real docker-registry processes (target with htpasswd auth) and real
skopeo: migrate-images (oversize skip, missing image failed by name, re-run copies nothing,
coverage), rewrite-image-refs, prewarm-plan (histogram, rejection at the cap).

Ports 5750 (source) and 5751 (target, auth): outside infra/registries.conf, so skopeo only.
"""

from __future__ import annotations

import crypt  # noqa: deprecated in 3.11, still present; bcrypt for htpasswd
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.core import RegistryEndpoint
from forgeflow.errors import PlanRejectedError
from forgeflow.registry import RegistryServer
from forgeflow.skopeo import Skopeo
from forgeflow.store import ImageRecord, Store, TaskRecord

pytestmark = pytest.mark.integration

SOURCE_PORT, TARGET_PORT = 5750, 5751
USER, PASSWORD = "mover", "s3cret-pw-5751"
MAX_SIZE_BYTES = 100_000


def _artifact(key: str):
    """The latest artifact published under ``key``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import Artifact

    # the filter body spelled out: the 3.9.1 client sends nulls this server version rejects
    body = {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1}
    with get_client(sync_client=True) as client:
        found = client.request("POST", "/artifacts/filter", json=body).json()
    assert found, f"no artifact {key}"
    return Artifact.model_validate(found[0])


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _oci_image(root: Path, tag: str, payload: bytes) -> str:
    """An OCI layout with one uncompressed layer holding ``payload``; returns its oci: reference."""
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("payload.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer_desc = _blob(root, layer.getvalue())
    config = {"architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}
    config_desc = _blob(root, json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_desc}]}
    manifest_desc = _blob(root, json.dumps(manifest).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest_desc,
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return f"oci:{root}:{tag}"


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RegistryServer]]:
    root = tmp_path_factory.mktemp("flow-registries")
    htpasswd = root / "htpasswd"
    htpasswd.write_text(f"{USER}:{crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    servers = {"source": RegistryServer("flow-source", SOURCE_PORT, root / "source" / "storage"),
               "target": RegistryServer("flow-target", TARGET_PORT, root / "target" / "storage",
                                        htpasswd_path=htpasswd)}
    try:
        for server in servers.values():
            server.start()
        small = _oci_image(root / "oci-small", "1", os.urandom(2_000))
        big = _oci_image(root / "oci-big", "1", os.urandom(3 * MAX_SIZE_BYTES))
        skopeo = Skopeo(retry_times=0, command_timeout_s=60)
        skopeo.copy(small, f"docker://{servers['source'].address}/env/small:1")
        skopeo.copy(big, f"docker://{servers['source'].address}/env/big:1")
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def endpoints(registries) -> dict[str, RegistryEndpoint]:
    return {"source": RegistryEndpoint(address=registries["source"].address),
            "target": RegistryEndpoint(address=registries["target"].address, username=USER,
                                       password=SecretStr(PASSWORD))}


def test_migrate_images_skips_oversize_fails_missing_and_reruns_without_copying(
        prefect_harness, endpoints, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    from flows.registry import migrate_images

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    kwargs = dict(source=endpoints["source"], target=endpoints["target"],
                  images=["env/small:1", "env/big:1", "env/ghost:1"], max_size_bytes=MAX_SIZE_BYTES,
                  state_path=tmp_path / "state.json", store_url=store_url)
    first = migrate_images(**kwargs)
    by_name = {r.target_ref.rsplit("/", 2)[-2] + "/" + r.target_ref.rsplit("/", 1)[-1]: r for r in first.records}
    small, big, ghost = by_name["env/small:1"], by_name["env/big:1"], by_name["env/ghost:1"]
    assert small.status == "completed" and small.reason == ""
    assert small.target_digest == small.source_digest is not None
    assert big.status == "skipped" and big.reason.startswith("oversize")
    assert ghost.status == "failed" and ghost.error_type == "ImageNotFoundError"
    assert "env/ghost:1" in ghost.reason
    assert (first.coverage.available, first.coverage.missing, first.coverage.errored) == (1, 2, 0)

    store = Store(store_url)
    target = endpoints["target"].address
    assert store.get_image(f"{target}/env/small:1").digest == small.target_digest
    assert store.get_image(f"{target}/env/big:1").digest is None
    assert store.get_image(f"{target}/env/ghost:1").digest is None
    states = json.loads((tmp_path / "state.json").read_text())["records"]
    assert states[ghost.target_ref]["error_type"] == "ImageNotFoundError"
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(f"registry-127.0.0.1-{TARGET_PORT}").limit == 4

    table = _artifact("migrate-images").data
    rows = json.loads(table) if isinstance(table, str) else table
    assert {row["image"]: row["status"] for row in rows} == {
        "env/small:1": "completed", "env/big:1": "skipped", "env/ghost:1": "failed"}
    coverage = str(_artifact("migrate-coverage").data)
    assert "available 1 / missing 2 / errored 0 of 3" in coverage

    second = migrate_images(**kwargs, rate_limit_per_s=10.0)
    with get_client(sync_client=True) as client:
        rate = client.read_global_concurrency_limit_by_name(f"registry-127.0.0.1-{TARGET_PORT}-rate")
        assert rate.slot_decay_per_second == 10.0
    statuses = {r.target_ref: (r.status, r.reason) for r in second.records}
    assert statuses[small.target_ref] == ("completed", "already present")  # nothing copied
    assert statuses[big.target_ref][0] == "skipped" and statuses[ghost.target_ref][0] == "failed"
    assert store.get_image(f"{target}/env/small:1").digest == small.target_digest
    store.dispose()


def test_registry_audit_counts_a_dataset(prefect_harness, endpoints, tmp_path: Path) -> None:
    from flows.registry import registry_audit

    dataset = tmp_path / "ds.jsonl"
    dataset.write_text("".join(json.dumps({"image": n}) + "\n" for n in ["env/small:1", "env/nope:2"]))
    report = registry_audit(target=endpoints["source"], dataset_path=dataset)
    assert (report.total, report.available, report.missing) == (2, 1, 1)
    assert [r.availability for r in report.rows] == ["available", "missing"]


def test_rewrite_image_refs_flow_and_revert(prefect_harness, tmp_path: Path) -> None:
    from flows.registry import rewrite_image_refs

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Store(store_url)
    store.upgrade()
    store.record_image(ImageRecord(ref="127.0.0.1:5750/task-00:t1", digest="sha256:" + "c" * 64, role="task"))
    store.record_task(TaskRecord(instance_id="t1", repo="r", image_ref="127.0.0.1:5750/task-00:t1", status="candidate"))
    dry = rewrite_image_refs("127.0.0.1:5750", "127.0.0.1:5751", store_url=store_url)
    assert len(dry.rows) == 2 and store.get_task("t1").image_ref == "127.0.0.1:5750/task-00:t1"
    rewrite_image_refs("127.0.0.1:5750", "127.0.0.1:5751", dry_run=False, store_url=store_url)
    assert store.get_task("t1").image_ref == "127.0.0.1:5751/task-00:t1"
    rewrite_image_refs("127.0.0.1:5751", "127.0.0.1:5750", dry_run=False, store_url=store_url)
    assert store.get_task("t1").image_ref == "127.0.0.1:5750/task-00:t1"
    assert store.get_image("127.0.0.1:5750/task-00:t1") is not None
    store.dispose()


def test_prewarm_plan_histogram_and_rejection_at_the_cap(prefect_harness, tmp_path: Path) -> None:
    from flows.registry import prewarm_plan

    tasks = tmp_path / "tasks.jsonl"
    base = "sha256:" + hashlib.sha256(b"base").hexdigest()
    tasks.write_text("".join(json.dumps({"task_id": f"t-{i}", "base_digest": base}) + "\n" for i in range(20)))
    plot = tmp_path / "plan.png"
    plan = prewarm_plan(tasks_path=tasks, shards=4, lanes=2, tag_cap=100, plot_path=plot)
    assert sum(plan.projected_tag_counts.values()) == 20 + len(plan.projected_tag_counts)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = _artifact("prewarm-plan-histogram")
    assert image.type == "image" and image.data == plot.resolve().as_uri()
    plot.unlink()
    with pytest.raises(PlanRejectedError, match=r"task-\d\d \(2[01] tags\)"):
        prewarm_plan(tasks_path=tasks, shards=4, lanes=1, tag_cap=20, plot_path=plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot shows what was rejected
