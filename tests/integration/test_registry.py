"""Registry stages against two real docker-registry processes and real skopeo/podman.

Ports 5711 (source) and 5712 (target) for the shared module fixture; 5713 (auth) and 5714
(nothing listens) for error mapping; 5727 for the fault-injecting proxy (tests/faultproxy.py, a
loopback reverse proxy in front of the real source registry). The demo uses 5701/5702.
"""

from __future__ import annotations

import crypt  # deprecated in 3.11, still present; bcrypt for the htpasswd test
import hashlib
import io
import json
import socket
import subprocess
import tarfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeflow.common.errors import (
    DigestMismatchError,
    ImageNotFoundError,
    RegistryError,
    RegistryUnavailableError,
    ServerStartError,
    is_transient,
)
from forgeflow.common.settings import tool_env
from forgeflow.registry.layout import ShardLayout
from forgeflow.registry.migration import migrate_image
from forgeflow.registry.prewarm import prewarm_basecache, verify_prewarm
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo, classify_error

pytestmark = pytest.mark.integration

SOURCE_PORT, TARGET_PORT, AUTH_PORT, DEAD_PORT = 5711, 5712, 5713, 5714
PROXY_PORT = 5727  # tests/faultproxy.py in front of the source


def _podman(*args: str) -> str:
    done = subprocess.run(
        ["podman", *args], env=tool_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"podman {args}: {done.stderr}"
    return done.stdout.strip()


def _tiny_image(name: str, content: bytes, scratch: Path) -> str:
    """``podman import`` a tar holding one file; return its containers-storage reference."""
    tar_path = scratch / f"{uuid.uuid4().hex}.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    _podman("import", "--message", "forgeflow test", str(tar_path), name)
    return f"containers-storage:{name}"


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory, registry_runner) -> Iterator[dict[str, RegistryServer]]:
    root = tmp_path_factory.mktemp("registries")
    servers = {
        "source": RegistryServer("source", SOURCE_PORT, root / "source" / "storage"),
        "target": RegistryServer("target", TARGET_PORT, root / "target" / "storage"),
    }
    with registry_runner(servers):
        yield servers


@pytest.fixture(scope="module")
def local_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    scratch = tmp_path_factory.mktemp("images")
    run = uuid.uuid4().hex[:8]
    names = {key: f"localhost/forgeflow-test/{key}-{run}:latest" for key in ("env", "base-a", "base-b")}
    refs = {key: _tiny_image(name, f"{key} {run}\n".encode(), scratch) for key, name in names.items()}
    try:
        yield refs
    finally:
        for name in names.values():
            subprocess.run(
                ["podman", "rmi", "--force", name], env=tool_env(), capture_output=True, timeout=60
            )


@pytest.fixture(scope="module")
def pushed_env(
    registries: dict[str, RegistryServer], skopeo: Skopeo, local_images: dict[str, str]
) -> tuple[str, str]:
    """The env image pushed into the source registry: (reference, registry digest)."""
    ref = f"docker://{registries['source'].address}/env/tiny:1.0"
    digest = skopeo.copy(local_images["env"], ref, preserve_digests=False)
    return ref, digest


def test_push_from_local_storage_and_migrate_keeps_the_digest(
    registries: dict[str, RegistryServer], skopeo: Skopeo, pushed_env: tuple[str, str]
) -> None:
    source_ref, pushed_digest = pushed_env
    assert skopeo.inspect_digest(source_ref) == pushed_digest
    assert skopeo.list_tags(f"docker://{registries['source'].address}/env/tiny") == ["1.0"]

    target_ref = f"docker://{registries['target'].address}/env/tiny:1.0"
    record = migrate_image(skopeo, source_ref, target_ref)
    assert record.status == "completed"
    assert record.source_digest == record.target_digest == pushed_digest
    assert skopeo.inspect_digest(target_ref) == pushed_digest
    assert skopeo.layers(target_ref) == skopeo.layers(source_ref)
    assert len(skopeo.layers(target_ref)) == 1
    assert record.size_bytes == skopeo.size_bytes(target_ref) > 0

    again = migrate_image(skopeo, source_ref, target_ref)
    assert (again.status, again.reason, again.target_digest) == (
        "completed",
        "already present",
        pushed_digest,
    )


def test_migrating_a_missing_image_names_it(
    registries: dict[str, RegistryServer], skopeo: Skopeo
) -> None:
    missing = f"docker://{registries['source'].address}/env/absent:0.0"
    with pytest.raises(ImageNotFoundError, match="env/absent:0.0"):
        migrate_image(skopeo, missing, f"docker://{registries['target'].address}/env/absent:0.0")
    with pytest.raises(ImageNotFoundError, match="env/absent"):
        skopeo.list_tags(f"docker://{registries['source'].address}/env/absent")


def test_oversize_image_is_skipped_and_not_copied(
    registries: dict[str, RegistryServer], skopeo: Skopeo, pushed_env: tuple[str, str]
) -> None:
    source_ref, digest = pushed_env
    size = skopeo.size_bytes(source_ref)
    target_ref = f"docker://{registries['target'].address}/env/too-big:1.0"
    record = migrate_image(skopeo, source_ref, target_ref, max_size_bytes=size - 1)
    assert record.status == "skipped"
    assert record.reason.startswith("oversize")
    assert record.size_bytes == size and record.source_digest == digest
    assert record.target_digest is None
    with pytest.raises(ImageNotFoundError):
        skopeo.inspect_digest(target_ref)


def test_prewarm_two_basecache_tags_and_verify(
    registries: dict[str, RegistryServer], skopeo: Skopeo, local_images: dict[str, str]
) -> None:
    target = registries["target"].address
    base_refs = {}
    for key in ("base-a", "base-b"):
        ref = f"docker://{target}/base/{key}:1"
        base_refs[skopeo.copy(local_images[key], ref, preserve_digests=False)] = ref
    digest_a, digest_b = base_refs
    assert digest_a != digest_b

    plan = ShardLayout(shards=2, lanes=1, prefix="it", tag_cap=10).plan(
        [("owner/proj-a#1", digest_a), ("owner/proj-b#1", digest_b)]
    )
    assert plan.basecache_tag_count == 2
    records = prewarm_basecache(skopeo, plan, target, base_refs)
    assert len(records) == 2 and all(r.copied for r in records)
    assert {r.base_digest for r in records} == {digest_a, digest_b}
    verify_prewarm(skopeo, records)
    for record in records:
        assert skopeo.inspect_digest(record.target_ref) == record.base_digest
        assert record.tag in skopeo.list_tags(f"docker://{target}/{record.repository}")

    rerun = prewarm_basecache(skopeo, plan, target, base_refs)
    assert [r.copied for r in rerun] == [False, False]

    # Overwrite one basecache tag with the other base: verification must name that tag.
    broken = records[0]
    other = next(ref for digest, ref in base_refs.items() if digest != broken.base_digest)
    skopeo.copy(other, broken.target_ref)
    with pytest.raises(DigestMismatchError, match=broken.tag):
        verify_prewarm(skopeo, records)

    # A re-run repairs exactly that tag (listed as present, but serving another digest).
    repaired = prewarm_basecache(skopeo, plan, target, base_refs, max_workers=1)
    assert [(r.tag, r.copied) for r in repaired] == [(r.tag, r.tag == broken.tag) for r in records]
    verify_prewarm(skopeo, repaired)


def test_error_mapping_for_auth_and_unreachable_registries(
    tmp_path: Path, skopeo: Skopeo, registries: dict[str, RegistryServer]
) -> None:
    with pytest.raises(RegistryUnavailableError, match=str(DEAD_PORT)) as unreachable:
        skopeo.inspect_digest(f"docker://127.0.0.1:{DEAD_PORT}/env/tiny:1.0")
    assert is_transient(unreachable.value)

    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"ci:{crypt.crypt('secret', crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    with RegistryServer("auth", AUTH_PORT, tmp_path / "storage", htpasswd_path=htpasswd) as auth:
        assert auth.is_ready()
        with pytest.raises(RegistryError) as denied:
            skopeo.inspect_digest(f"docker://{auth.address}/env/tiny:1.0")
        assert not is_transient(denied.value)
        assert not isinstance(denied.value, ImageNotFoundError)
        authfile = tmp_path / "auth.json"
        login = subprocess.run(
            ["skopeo", "login", f"--authfile={authfile}", "--tls-verify=false",
             "-u", "ci", "-p", "secret", auth.address],
            env=tool_env(), capture_output=True, text=True, timeout=60,
        )
        assert login.returncode == 0, login.stderr
        with pytest.raises(ImageNotFoundError):  # past auth now: the image simply is not there
            Skopeo(authfile=authfile, retry_times=0).inspect_digest(
                f"docker://{auth.address}/env/tiny:1.0"
            )
    assert auth.pid is None

    squatter = RegistryServer("squatter", SOURCE_PORT, tmp_path / "squat" / "storage")
    with pytest.raises(ServerStartError, match=f"port {SOURCE_PORT} already answers"):
        squatter.start()


def test_registry_restart_keeps_stored_images(
    registries: dict[str, RegistryServer], skopeo: Skopeo, pushed_env: tuple[str, str]
) -> None:
    source = registries["source"]
    source_ref, digest = pushed_env
    again = RegistryServer(source.name, source.port, source.storage_dir)
    first_pid = source.pid
    assert again.ensure_running().pid == first_pid  # reuses the live process

    source.stop()
    assert source.pid is None and not again.is_ready()
    with pytest.raises(RegistryUnavailableError):
        skopeo.inspect_digest(source_ref)

    again.ensure_running()
    assert again.pid not in (None, first_pid)
    assert skopeo.inspect_digest(source_ref) == digest  # storage persisted across the restart


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        ('level=fatal msg="reading manifest v1 in h/r: manifest unknown: manifest unknown"', ImageNotFoundError),
        ('level=fatal msg="fetching tags list: invalid status code from registry 404 (Not Found)"', ImageNotFoundError),
        ('level=fatal msg="reading manifest 1 in h/r: unauthorized: authentication required"', RegistryError),
        ('level=fatal msg="dial tcp 127.0.0.1:5714: connect: connection refused"', RegistryUnavailableError),
        ('level=fatal msg="received unexpected HTTP status: 503 Service Unavailable"', RegistryUnavailableError),
        ('level=fatal msg="toomanyrequests: rate limit exceeded (429)"', RegistryUnavailableError),
        # seen in a demo run's prewarm (a transient error the registry answered while a blob was mounted)
        ('level=fatal msg="trying to reuse blob sha256:e281 at destination: failed to read from destination '
         'repository task-06: 500 (Internal Server Error)"', RegistryUnavailableError),
        ('level=fatal msg="copying: Digest of blob changes, --preserve-digests refused"', RegistryError),
    ],
)
def test_skopeo_stderr_lines_map_to_error_kinds(stderr: str, expected: type[Exception]) -> None:
    error = classify_error("docker://h/r:1", stderr)
    assert type(error) is expected
    assert "docker://h/r:1" in str(error) and "level=fatal" not in str(error)


def test_start_on_a_taken_port_fails_with_the_log_tail(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", DEAD_PORT))
        blocker.listen(1)
        server = RegistryServer("blocked", DEAD_PORT, tmp_path / "storage")
        with pytest.raises(ServerStartError, match="address already in use"):
            server.start(timeout_s=10)
    assert server.pid is None


def test_multi_arch_index_migrates_with_its_digest(
    registries: dict[str, RegistryServer], skopeo: Skopeo, pushed_env: tuple[str, str]
) -> None:
    """An index copied with --all --preserve-digests keeps its digest; layers() picks amd64."""
    source = registries["source"].address
    source_ref, _ = pushed_env
    # Two "platform" manifests in one repository (the same tiny image content twice is fine).
    amd = skopeo.copy(source_ref, f"docker://{source}/multi/tiny:amd64")
    arm_ref = f"docker://{source}/multi/tiny:arm64"
    arm = skopeo.copy(source_ref, arm_ref)
    child = skopeo.inspect_raw(arm_ref)
    oci = child["config"]["mediaType"].startswith("application/vnd.oci")
    child_type = child.get("mediaType") or (
        "application/vnd.oci.image.manifest.v1+json"
        if oci
        else "application/vnd.docker.distribution.manifest.v2+json"
    )
    index_type = (
        "application/vnd.oci.image.index.v1+json"
        if oci
        else "application/vnd.docker.distribution.manifest.list.v2+json"
    )
    size = len(skopeo.raw_manifest(arm_ref))
    index = {
        "schemaVersion": 2,
        "mediaType": index_type,
        "manifests": [
            {"mediaType": child_type, "digest": amd, "size": size,
             "platform": {"architecture": "amd64", "os": "linux"}},
            {"mediaType": child_type, "digest": arm, "size": size,
             "platform": {"architecture": "arm64", "os": "linux"}},
        ],
    }
    body = json.dumps(index).encode()
    request = urllib.request.Request(
        f"http://{source}/v2/multi/tiny/manifests/index", data=body, method="PUT",
        headers={"Content-Type": index_type},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 201

    index_ref = f"docker://{source}/multi/tiny:index"
    assert skopeo.inspect_digest(index_ref) == "sha256:" + hashlib.sha256(body).hexdigest()
    assert skopeo.size_bytes(index_ref) == 2 * skopeo.size_bytes(arm_ref)
    assert skopeo.layers(index_ref, arch="amd64") == skopeo.layers(arm_ref)
    with pytest.raises(ImageNotFoundError, match="linux/s390x"):
        skopeo.layers(index_ref, arch="s390x")

    target_ref = f"docker://{registries['target'].address}/multi/tiny:index"
    record = migrate_image(skopeo, index_ref, target_ref)
    assert record.target_digest == record.source_digest == skopeo.inspect_digest(index_ref)


def test_core_migration_retries_a_503_with_backoff_and_names_what_it_cannot_fix(
    registries: dict[str, RegistryServer], skopeo: Skopeo, pushed_env: tuple[str, str], tmp_path: Path
) -> None:
    """forgeflow.registry.migration.migrate_images (no Prefect) behind tests/faultproxy.py: the first two
    manifest/blob requests to the source answer 503; the image completes on its third attempt
    after waits of 0.5 s and 1 s, while a missing image fails once, by name, without a retry."""
    from forgeflow.ledger.store import Store
    from forgeflow.registry.migration import load_states, migrate_images
    from tests.faultproxy import FaultProxy

    source_ref, digest = pushed_env
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    target = registries["target"].address
    with FaultProxy(PROXY_PORT, registries["source"].address, fail_first=2, status=503) as proxy:
        proxied = source_ref.replace(registries["source"].address, proxy.address)
        pairs = [(proxied, f"docker://{target}/retry/tiny:1.0"),
                 (f"docker://{proxy.address}/env/absent:0.0", f"docker://{target}/retry/absent:0.0")]
        records = migrate_images(skopeo, pairs, transient_retries=3, backoff_s=0.5, store=store)
    done, absent = records
    assert (done.status, done.attempts, done.target_digest, proxy.injected) == ("completed", 3, digest, 2)
    faults = [entry.at_s for entry in proxy.log if entry.injected]
    assert faults[1] - faults[0] >= 0.5
    assert (absent.status, absent.error_type, absent.attempts) == ("failed", "ImageNotFoundError", 1)
    assert "env/absent:0.0" in absent.reason
    states = load_states(store)
    assert states[pairs[0][1]].status == "completed" and states[pairs[1][1]].error_type == "ImageNotFoundError"
    store.dispose()


def test_the_canary_takes_a_task_image_that_lives_only_in_a_registry(
    registries: dict[str, RegistryServer], pushed_env: tuple[str, str], tmp_path: Path
) -> None:
    """A team's row may name its task image in a registry (``host:port/repo:tag``) that podman pulls when the
    sandbox starts: the canary's preflight finds it there (no local copy) and takes the digest the registry
    serves; a tag the registry does not have is named as missing there, before any trial."""
    from types import SimpleNamespace

    from forgeflow.common.errors import PreflightError
    from forgeflow.evaluation.canary import canary_tasks
    from forgeflow.ledger.records import TaskRecord
    from forgeflow.ledger.store import Store
    from forgeflow.registry import images

    ref, digest = pushed_env[0].removeprefix("docker://"), pushed_env[1]
    assert not images.image_exists(ref)  # only in the registry
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    rows = []
    for iid, image in (("team__a-1", ref), ("team__a-2", ref.replace(":1.0", ":no-such-tag"))):
        store.record_task(TaskRecord(instance_id=iid, repo="team/a", status="accepted", FAIL_TO_PASS=["t::f"]))
        rows.append(SimpleNamespace(instance_id=iid, repo="team/a", patch="p", image_ref=image, test_command="pytest -rA",
                                    problem_statement="add() is wrong"))
    (task,) = canary_tasks(store, ["team__a-1"], rows)
    assert (task.image_ref, task.image_digest) == (ref, digest)
    with pytest.raises(PreflightError, match=r"team__a-2: task image .*:no-such-tag does not exist in its registry"):
        canary_tasks(store, ["team__a-1", "team__a-2"], rows)
    store.dispose()
