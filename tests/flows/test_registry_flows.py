"""Registry flows against two real docker-registry processes (target with htpasswd auth) and real
skopeo: migrate-images (state per image in the store, oversize skip, missing image failed by name,
re-run copies nothing, coverage; 503/429 retried with backoff through a fault-injecting proxy;
auth failure not retried; per-registry concurrency and rate limits), rewrite-image-refs,
prewarm-plan (histogram, rejection at the cap).

Ports 5750 (source), 5751 (target, auth) and 5752 (tests/faultproxy.py in front of the source):
outside infra/registries.conf, so skopeo only. The proxy is a loopback reverse proxy written for
the tests (it forwards to the real registry; only the injected 503/429 answers are its own).
"""

from __future__ import annotations

import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.core import RegistryEndpoint
from forgeflow.common.errors import (
    InputError,
    MigrationIncompleteError,
    PlanRejectedError,
    RegistryUnavailableError,
)
from forgeflow.ledger.records import ImageRecord, TaskRecord
from forgeflow.ledger.store import Store
from forgeflow.registry.migration import TransferLimits
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo
from tests.faultproxy import FaultProxy
from tests.helpers import oci_image

pytestmark = pytest.mark.integration

SOURCE_PORT, TARGET_PORT, PROXY_PORT = 5750, 5751, 5752
CONCURRENCY_IMAGES = [f"conc/c-{i}:1" for i in range(3)]
RATE_IMAGES = [f"rate/r-{i}:1" for i in range(3)]
EXTRA_IMAGES = CONCURRENCY_IMAGES + RATE_IMAGES + ["faults/retry-a:1", "faults/retry-b:1"]
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
        small = oci_image(root / "oci-small", "1", os.urandom(2_000))
        big = oci_image(root / "oci-big", "1", os.urandom(3 * MAX_SIZE_BYTES))
        skopeo = Skopeo(retry_times=0, command_timeout_s=60)
        skopeo.copy(small, f"docker://{servers['source'].address}/env/small:1")
        skopeo.copy(big, f"docker://{servers['source'].address}/env/big:1")
        for name in EXTRA_IMAGES:
            skopeo.copy(small, f"docker://{servers['source'].address}/{name}")
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def endpoints(registries) -> dict[str, RegistryEndpoint]:
    return {"source": RegistryEndpoint(address=registries["source"].address),
            "target": RegistryEndpoint(address=registries["target"].address, username=USER,
                                       password=SecretStr(PASSWORD)),
            "proxy": RegistryEndpoint(address=f"127.0.0.1:{PROXY_PORT}")}


@pytest.fixture
def proxy(registries) -> Iterator[FaultProxy]:
    """The fault-injecting proxy in front of the source registry (no faults until armed)."""
    with FaultProxy(PROXY_PORT, registries["source"].address) as running:
        yield running


def test_migrate_images_skips_oversize_fails_missing_and_reruns_without_copying(
        prefect_harness, endpoints, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    from flows.registry import MigrateParams, migrate_images
    from forgeflow.registry.migration import ALREADY_COMPLETED, load_states

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    params = MigrateParams(source=endpoints["source"], target=endpoints["target"],
                           images=["env/small:1", "env/big:1", "env/ghost:1"],
                           transfer=TransferLimits(max_size_bytes=MAX_SIZE_BYTES), store_url=store_url)
    state = migrate_images(params, return_state=True)
    # a failed image fails the flow run (red in the UI), after every state and the table were written
    assert state.is_failed()
    assert "1 of 3 images failed (ImageNotFoundError 1): env/ghost:1 (ImageNotFoundError)" in state.message
    first = state.result(raise_on_failure=False).summary
    small, big, ghost = first.records
    assert small.status == "completed" and small.reason == "" and small.attempts == 1
    assert small.target_digest == small.source_digest is not None
    assert big.status == "skipped" and big.reason.startswith("oversize")
    assert ghost.status == "failed" and ghost.error_type == "ImageNotFoundError"
    assert ghost.attempts == 1  # a missing image is not retried
    assert "env/ghost:1" in ghost.reason
    assert first.copied == 1 and len(first.failed) == 1 and first.failed[0].startswith("env/ghost:1: ImageNotFoundError")
    assert (first.coverage.available, first.coverage.missing, first.coverage.errored) == (1, 2, 0)
    assert [r.recorded_status for r in first.coverage.rows] == ["completed", "skipped", "failed"]

    # the state lives in the store's images rows (no state file)
    store = Store(store_url)
    target = endpoints["target"].address
    row = store.get_image(f"{target}/env/small:1")
    assert (row.status, row.digest, row.source_digest) == ("completed", small.target_digest, small.source_digest)
    assert row.source_ref == f"{endpoints['source'].address}/env/small:1"
    big_row, ghost_row = store.get_image(f"{target}/env/big:1"), store.get_image(f"{target}/env/ghost:1")
    assert (big_row.status, big_row.digest) == ("skipped", None) and big_row.status_reason.startswith("oversize")
    assert (ghost_row.status, ghost_row.digest) == ("failed", None)
    assert ghost_row.status_reason.startswith("ImageNotFoundError: ") and "env/ghost:1" in ghost_row.status_reason
    assert load_states(store)[ghost.target_ref].error_type == "ImageNotFoundError"
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(f"registry-127.0.0.1-{TARGET_PORT}").limit == 4

    table = _artifact("migrate-images").data
    rows = json.loads(table) if isinstance(table, str) else table
    assert {row["image"]: row["status"] for row in rows} == {
        "env/small:1": "completed", "env/big:1": "skipped", "env/ghost:1": "failed"}
    coverage = str(_artifact("migrate-coverage").data)
    assert "available 1 / missing 2 / errored 0 of 3" in coverage

    with pytest.raises(MigrationIncompleteError, match=r"1 of 3 images failed") as caught:
        migrate_images(params.model_copy(update={"transfer": TransferLimits(max_size_bytes=MAX_SIZE_BYTES,
                                                                          rate_limit_per_s=10.0)}))
    second = caught.value.summary
    with get_client(sync_client=True) as client:
        rate = client.read_global_concurrency_limit_by_name(f"registry-127.0.0.1-{TARGET_PORT}-rate")
        assert rate.slot_decay_per_second == 10.0
    statuses = {r.target_ref: (r.status, r.reason, r.attempts) for r in second.records}
    assert statuses[small.target_ref] == ("completed", ALREADY_COMPLETED, 0)  # read from the store, not copied
    assert statuses[big.target_ref][0] == "skipped" and statuses[ghost.target_ref][0] == "failed"
    assert second.copied == 0
    assert store.get_image(f"{target}/env/small:1").digest == small.target_digest

    # the registry is the truth: a completed image deleted from the target is seen by the audit,
    # put back to pending, and copied again by the next run
    _delete_manifest(target, "env/small", small.target_digest)
    from flows.registry import RegistryAuditParams, registry_audit
    audit = registry_audit(RegistryAuditParams(target=endpoints["target"], images=["env/small:1"], store_url=store_url))
    assert audit.drifted == 1 and "missing from the registry" in audit.rows[0].drift
    assert store.get_image(f"{target}/env/small:1").status == "pending"
    with pytest.raises(MigrationIncompleteError) as caught:
        migrate_images(params)
    third = caught.value.summary
    assert (third.records[0].status, third.records[0].reason, third.copied) == ("completed", "", 1)
    store.dispose()


def _delete_manifest(address: str, repository: str, digest: str) -> None:
    """DELETE a manifest through the registry API (the registry runs with deletes enabled)."""
    import base64
    import urllib.request

    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(f"http://{address}/v2/{repository}/manifests/{digest}", method="DELETE",
                                     headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 202


def test_503_and_429_are_retried_with_backoff_until_the_migration_completes(
        prefect_harness, endpoints, proxy: FaultProxy, tmp_path: Path) -> None:
    from flows.registry import MigrateParams, migrate_images

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    # 503 on the first two manifest/blob requests: skopeo does not retry a 503 itself (skopeo
    # 1.9.3), so the flow's task retries do, after 1 s and then 2 s
    proxy.arm(2, status=503)
    summary = migrate_images(MigrateParams(source=endpoints["proxy"], target=endpoints["target"],
                                           images=["faults/retry-a:1"],
                                           transfer=TransferLimits(retry_delays_s=[1.0, 2.0, 4.0]),
                                           store_url=store_url))
    record = summary.records[0]
    assert (record.status, record.attempts, proxy.injected) == ("completed", 3, 2)
    assert record.target_digest == record.source_digest
    faults = [entry for entry in proxy.log if entry.injected]
    after = next(e for e in proxy.log if not e.injected and e.at_s > faults[1].at_s and "/manifests/" in e.path)
    assert faults[1].at_s - faults[0].at_s >= 1.0  # the backoff grows: 1 s, then 2 s
    assert after.at_s - faults[1].at_s >= 2.0
    assert Store(store_url).get_image(record.target_ref.removeprefix("docker://")).status == "completed"

    # 429 with Retry-After: skopeo honours the header itself; the image completes in one attempt
    proxy.arm(2, status=429, retry_after_s=1)
    summary = migrate_images(MigrateParams(source=endpoints["proxy"], target=endpoints["target"],
                                           images=["faults/retry-b:1"], transfer=TransferLimits(retry_delays_s=[1.0]),
                                           store_url=store_url))
    record = summary.records[0]
    assert (record.status, proxy.injected) == ("completed", 2)
    faults = [entry for entry in proxy.log if entry.injected]
    assert faults[-1].at_s - faults[-2].at_s >= 0.9  # waited as Retry-After asked


def test_auth_failure_is_not_retried_and_is_reported_by_name(prefect_harness, endpoints, tmp_path: Path) -> None:
    from flows.registry import MigrateParams, migrate_images

    wrong = endpoints["target"].model_copy(update={"password": SecretStr(PASSWORD + "-wrong")})
    with pytest.raises(MigrationIncompleteError, match=r"1 of 1 images failed \(RegistryError 1\)") as caught:
        migrate_images(MigrateParams(source=endpoints["source"], target=wrong, images=["env/small:1"],
                                     transfer=TransferLimits(retry_delays_s=[1.0, 1.0]),
                                     store_url=f"sqlite:///{tmp_path / 'store.db'}"))
    summary = caught.value.summary
    assert PASSWORD not in str(caught.value)
    record = summary.records[0]
    assert (record.status, record.error_type, record.attempts) == ("failed", "RegistryError", 1)
    assert summary.failed == [f"env/small:1: RegistryError: {record.reason}"]
    assert "unauthorized" in record.reason.lower() or "401" in record.reason
    assert PASSWORD not in " ".join(summary.failed)


def _windows(proxy: FaultProxy, names: list[str]) -> list[tuple[float, float]]:
    """(first, last) request time through the proxy of each image's repository, by start."""
    spans = []
    for name in names:
        times = [e.at_s for e in proxy.log if e.path.startswith(f"/v2/{name.split(':')[0]}/")]
        assert times, f"no request for {name}"
        spans.append((min(times), max(times)))
    return sorted(spans)


def test_per_registry_concurrency_and_rate_limits_hold(prefect_harness, endpoints, proxy: FaultProxy,
                                                       tmp_path: Path) -> None:
    from flows.registry import MigrateParams, migrate_images

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    one_at_a_time = migrate_images(MigrateParams(source=endpoints["proxy"], target=endpoints["target"],
                                                 images=CONCURRENCY_IMAGES,
                                                 transfer=TransferLimits(concurrency_limit=1), store_url=store_url))
    assert [r.status for r in one_at_a_time.records] == ["completed"] * 3
    windows = _windows(proxy, CONCURRENCY_IMAGES)
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start >= end, f"images overlapped under a limit of 1: {windows}"

    rated = migrate_images(MigrateParams(source=endpoints["proxy"], target=endpoints["target"], images=RATE_IMAGES,
                                         transfer=TransferLimits(concurrency_limit=4, rate_limit_per_s=1.0),
                                         store_url=store_url))
    assert [r.status for r in rated.records] == ["completed"] * 3
    starts = [start for start, _ in _windows(proxy, RATE_IMAGES)]
    assert starts[2] - starts[0] >= 1.5, f"3 images at 1/s started within {starts[2] - starts[0]:.2f} s"


def test_registry_audit_counts_a_dataset(prefect_harness, endpoints, tmp_path: Path) -> None:
    from flows.registry import RegistryAuditParams, registry_audit

    dataset = tmp_path / "ds.jsonl"
    dataset.write_text("".join(json.dumps({"image": n}) + "\n" for n in ["env/small:1", "env/nope:2"]))
    report = registry_audit(RegistryAuditParams(target=endpoints["source"], dataset_path=dataset))
    assert (report.total, report.available, report.missing) == (2, 1, 1)
    assert [r.availability for r in report.rows] == ["available", "missing"]


def _store_with_task_image(tmp_path: Path, ref: str) -> tuple[str, Store]:
    """A fresh SQLite store holding one task image ``ref`` and task ``t1`` that uses it."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Store(store_url)
    store.upgrade()
    store.record_image(ImageRecord(ref=ref, digest="sha256:" + "c" * 64, role="task"))
    store.record_task(TaskRecord(instance_id="t1", repo="r", image_ref=ref, status="candidate"))
    return store_url, store


def test_rewrite_image_refs_flow_and_revert(prefect_harness, tmp_path: Path) -> None:
    from flows.registry import RewriteImageRefsParams, rewrite_image_refs

    store_url, store = _store_with_task_image(tmp_path, "127.0.0.1:5750/task-00:t1")
    dry = rewrite_image_refs(RewriteImageRefsParams(old_prefix="127.0.0.1:5750", new_prefix="127.0.0.1:5751",
                                                    store_url=store_url))
    assert len(dry.rows) == 2 and store.get_task("t1").image_ref == "127.0.0.1:5750/task-00:t1"
    rewrite_image_refs(RewriteImageRefsParams(old_prefix="127.0.0.1:5750", new_prefix="127.0.0.1:5751",
                                              dry_run=False, store_url=store_url))
    assert store.get_task("t1").image_ref == "127.0.0.1:5751/task-00:t1"
    rewrite_image_refs(RewriteImageRefsParams(old_prefix="127.0.0.1:5751", new_prefix="127.0.0.1:5750",
                                              dry_run=False, store_url=store_url))
    assert store.get_task("t1").image_ref == "127.0.0.1:5750/task-00:t1"
    assert store.get_image("127.0.0.1:5750/task-00:t1") is not None
    store.dispose()


def test_prewarm_plan_histogram_and_rejection_at_the_cap(prefect_harness, tmp_path: Path) -> None:
    from flows.registry import PrewarmPlanParams, prewarm_plan

    tasks = tmp_path / "tasks.jsonl"
    base = "sha256:" + hashlib.sha256(b"base").hexdigest()
    tasks.write_text("".join(json.dumps({"task_id": f"t-{i}", "base_digest": base}) + "\n" for i in range(20)))
    plot = tmp_path / "plan.png"
    plan = prewarm_plan(PrewarmPlanParams(tasks_path=tasks, shards=4, lanes=2, tag_cap=100, plot_path=plot))
    assert sum(plan.projected_tag_counts.values()) == 20 + len(plan.projected_tag_counts)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = _artifact("prewarm-plan-histogram")
    assert image.type == "image" and image.data == plot.resolve().as_uri()
    plot.unlink()
    with pytest.raises(PlanRejectedError, match=r"task-\d\d \(2[01] tags\)"):
        prewarm_plan(PrewarmPlanParams(tasks_path=tasks, shards=4, lanes=1, tag_cap=20, plot_path=plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot shows what was rejected


def test_prewarm_plan_in_a_lifecycle_stage_counts_its_plan_and_a_rerun_is_cached(prefect_harness,
                                                                                   tmp_path: Path) -> None:
    """The lifecycle's prewarm stage writes its tasks file (rewritten each run) and runs this flow: the plan
    task counts in the stage, and the same tasks read again come from the cache, so a re-run stays ``cached``."""
    import secrets

    from prefect import flow

    from flows.registry import PrewarmPlanParams, prewarm_plan
    from flows.stagekit import StageLog, run_stage_flow
    from tasks.registry import write_plan_tasks

    base = "sha256:" + secrets.token_hex(32)  # no earlier plan of these tasks in Prefect's cache
    pairs = [(f"t-{i}", base) for i in range(5)]
    log = StageLog(tmp_path / "summary.json", None)

    def stage(name: str):
        with log.stage(name):
            tasks_path = write_plan_tasks(pairs, tmp_path / "plan-tasks.jsonl")
            return prewarm_plan(PrewarmPlanParams(tasks_path=tasks_path, shards=4, lanes=2,
                                                  plot_path=tmp_path / "plan.png"))

    @flow
    def parent():
        return run_stage_flow("first", stage, "first"), run_stage_flow("second", stage, "second")

    first, second = parent()
    assert [(p.task_id, p.base_digest) for p in first.placements] == pairs and second == first
    assert (log.stages["first"]["status"], log.stages["first"]["tasks_run"]) == ("completed", 1)
    assert (log.stages["second"]["status"], log.stages["second"]["tasks_cached"]) == ("cached", 1)


def test_dataset_column_of_local_names_is_refused_and_full_references_are_used(
        prefect_harness, endpoints, tmp_path: Path) -> None:
    # regression: the demo's candidates.jsonl: 'image' holds local podman names, 'registry_ref' full
    # references; both gave 'docker://host/host/...' refs and wrong answers
    from flows.registry import MigrateParams, RegistryAuditParams, migrate_images, registry_audit

    source, target = endpoints["source"].address, endpoints["target"].address
    dataset = tmp_path / "candidates.jsonl"
    rows = [{"image": f"localhost/forgeflow/task:{tag}", "registry_ref": f"{source}/{ref}"}
            for tag, ref in [("small", "env/small:1"), ("nope", "env/nope:2")]]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(InputError, match=r"params\.dataset_path \S+ column 'image' value 'localhost/forgeflow/task:small' "
                                         r"names registry host 'localhost'.*expected 'repo:tag' relative to the "
                                         r"registry.*\['registry_ref'\]"):
        registry_audit(RegistryAuditParams(target=endpoints["source"], dataset_path=dataset))
    report = registry_audit(RegistryAuditParams(target=endpoints["source"], dataset_path=dataset,
                                                image_column="registry_ref"))
    assert [(r.ref, r.availability) for r in report.rows] == [
        (f"docker://{source}/env/small:1", "available"), (f"docker://{source}/env/nope:2", "missing")]
    with pytest.raises(InputError, match=rf"params\.images entry .*names registry host '127.0.0.1:9', which is not "
                                         rf"'{target}' or '{source}'"):
        migrate_images(MigrateParams(source=endpoints["source"], target=endpoints["target"],
                                     images=["127.0.0.1:9/env/small:1"], store_url=f"sqlite:///{tmp_path / 'store.db'}"))
    # a full reference in the target names the same image as its repo:tag
    summary = migrate_images(MigrateParams(source=endpoints["source"], target=endpoints["target"],
                                           images=[f"{target}/env/small:1", "env/small:1"],
                                           store_url=f"sqlite:///{tmp_path / 'store.db'}"))
    assert [(r.source_ref, r.target_ref, r.status) for r in summary.records] == [
        (f"docker://{source}/env/small:1", f"docker://{target}/env/small:1", "completed")]


def _unchecked_limits(**fields: object) -> TransferLimits:
    """Limits with ``fields`` set past the model's validation (as ``model_copy(update=...)`` sets them)."""
    return TransferLimits().model_copy(update=fields)


def test_malformed_inputs_are_refused_before_anything_is_recorded(prefect_harness, endpoints, tmp_path: Path) -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.registry import MigrateParams, migrate_images

    db = tmp_path / "store.db"
    common = dict(source=endpoints["source"], images=["env/small:1"], store_url=f"sqlite:///{db}")
    target = endpoints["target"]
    # each error names the field as the user wrote it: params.<field>
    cases = [
        (dict(target=target.model_copy(update={"address": "127.0.0.1:99999"})),
         r"params\.target\.address '127\.0\.0\.1:99999': port '99999' is not a number in 1-65535"),
        (dict(target=target.model_copy(update={"namespace": "../x"})),
         r"params\.target\.namespace '\.\./x' is not a repository path"),
        (dict(target="no-such-registry"), r"params\.target registry block 'no-such-registry' is not saved"),
        (dict(target=target, images=["env/six:1.17.0@sha256:abc"]),
         r"params\.images entry 'env/six:1\.17\.0@sha256:abc': digest 'sha256:abc' is not 'sha256:<64 lowercase hex>'"),
        (dict(target=target, images=None),
         r"give exactly one of params\.images \(repo:tag names\) or params\.dataset_path"),
        # limits built without validation are still checked by the flow, by name
        (dict(target=target, transfer=_unchecked_limits(concurrency_limit=0)),
         r"params\.transfer\.concurrency_limit must be a whole number of images in 1-64, got 0"),
        (dict(target=target, transfer=_unchecked_limits(rate_limit_per_s=-1)),
         r"params\.transfer\.rate_limit_per_s must be a positive number .* got -1"),
        (dict(target=target, transfer=_unchecked_limits(max_size_bytes=-1)),
         r"params\.transfer\.max_size_bytes must be >= 0, got -1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            migrate_images(MigrateParams(**(common | kwargs)))
    # a dict endpoint is validated by Prefect into the block, whose validator names the field
    with pytest.raises(ParameterTypeError,
                       match=r"params\.target\.RegistryEndpoint\.address: .*'http://127\.0\.0\.1:5751' has a scheme"):
        migrate_images(params={**common, "target": {"address": "http://127.0.0.1:5751"}})
    # transfer limits given as a dict (the UI, the API, a deployment) are validated by Prefect into the model
    with pytest.raises(ParameterTypeError, match=r"params\.transfer\.concurrency_limit: .*less than or equal to 64"):
        migrate_images(params={**common, "target": target, "transfer": {"concurrency_limit": 65}})
    assert not db.exists()  # nothing was recorded


def test_registry_endpoint_refuses_a_bad_address_or_namespace() -> None:
    from pydantic import ValidationError

    assert RegistryEndpoint(address="127.0.0.1:5702", namespace="/mirror/").namespace == "mirror"
    for fields, message in [({"address": "http://127.0.0.1:5702"}, "has a scheme"),
                            ({"address": "127.0.0.1:99999"}, "port '99999'"),
                            ({"address": "127.0.0.1:5702", "namespace": "../x"}, "namespace '../x' is not a repository path")]:
        with pytest.raises(ValidationError, match=message):
            RegistryEndpoint(**fields)


def test_unreachable_registry_fails_fast_before_anything_is_recorded(prefect_harness, endpoints, tmp_path: Path) -> None:
    # regression: a wrong target address took 71 s of retries per image and ended Completed, 'copied 0'
    import time

    from flows.registry import MigrateParams, RegistryAuditParams, migrate_images, registry_audit
    from tests.helpers import free_port

    db = tmp_path / "store.db"
    nowhere = RegistryEndpoint(address=f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(RegistryUnavailableError, match=rf"target registry {nowhere.address} is not reachable"):
        migrate_images(MigrateParams(source=endpoints["source"], target=nowhere, images=["env/small:1"],
                                     store_url=f"sqlite:///{db}"))
    with pytest.raises(RegistryUnavailableError, match=rf"source registry {nowhere.address} is not reachable"):
        migrate_images(MigrateParams(source=nowhere, target=endpoints["target"], images=["env/small:1"],
                                     store_url=f"sqlite:///{db}"))
    with pytest.raises(RegistryUnavailableError, match=rf"target registry {nowhere.address}"):
        registry_audit(RegistryAuditParams(target=nowhere, images=["env/small:1"], store_url=f"sqlite:///{db}"))
    assert time.monotonic() - started < 30
    assert not db.exists()


def test_rewrite_moves_a_repository_and_says_when_nothing_matches(prefect_harness, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from flows.registry import RewriteImageRefsParams, rewrite_image_refs

    def rewrite(old_prefix: str, new_prefix: str):
        return rewrite_image_refs(RewriteImageRefsParams(old_prefix=old_prefix, new_prefix=new_prefix, dry_run=False,
                                                         store_url=store_url))

    store_url, store = _store_with_task_image(tmp_path, "127.0.0.1:5750/task-01:t1")
    moved = rewrite("127.0.0.1:5750/task-01", "127.0.0.1:5750/task-02")
    assert moved.applied and len(moved.rows) == 2
    assert store.get_task("t1").image_ref == "127.0.0.1:5750/task-02:t1"
    nothing = rewrite("127.0.0.1:5750/task-07", "127.0.0.1:5750/task-08")
    assert nothing.rows == [] and nothing.unmatched_example == "127.0.0.1:5750/task-02:t1"
    rewrite("127.0.0.1:5750/task-02", "127.0.0.1:5750/task-01")
    assert store.get_task("t1").image_ref == "127.0.0.1:5750/task-01:t1"
    # a prefix check names the field as the user wrote it (through Prefect: tests/flows/test_stage_params.py)
    with pytest.raises(ValidationError, match=r"old_prefix\n  Value error, 'http://x' is not host\[:port\]\[/path\]"):
        rewrite("http://x", "127.0.0.1:5750/task-09")
    store.dispose()


@pytest.mark.parametrize("fields,refused,message", [
    (dict(shards=0), "ParameterTypeError", r"params\.shards: Input should be greater than or equal to 1"),
    (dict(shards=4, lanes=5), "InputError", r"params\.lanes \(5\) must not exceed params\.shards \(4\)"),
    (dict(tag_cap=0), "ParameterTypeError", r"params\.tag_cap: Input should be greater than or equal to 1"),
    (dict(prefix="Task"), "ParameterTypeError", r"params\.prefix: String should match pattern"),
])
def test_prewarm_plan_names_a_bad_layout_parameter(prefect_harness, tmp_path: Path, fields: dict, refused: str,
                                                   message: str) -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.registry import prewarm_plan

    error = {"ParameterTypeError": ParameterTypeError, "InputError": InputError}[refused]
    with pytest.raises(error, match=message):
        prewarm_plan(params={"tasks_path": str(tmp_path / "absent.jsonl"), "plot_path": str(tmp_path / "plan.png"),
                             **fields})
    assert not (tmp_path / "plan.png").exists()
