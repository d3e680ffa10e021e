"""Credentials, layer reuse and a migration whose target dies mid-run, against real registries.

Ports 5743 (source), 5744 (target, stopped and restarted by one test), 5745 (htpasswd auth);
the benchmark (benchmarks/registry.py) uses 5740/5741.
Real docker-registry, skopeo and podman; nothing is mocked.
"""

from __future__ import annotations

import base64
import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd
import io
import json
import stat
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from blocks.core import RegistryEndpoint
from forgeflow.common.errors import (
    DigestMismatchError,
    InputError,
    RegistryError,
    is_transient,
)
from forgeflow.common.settings import tool_env
from forgeflow.ledger.store import Store
from forgeflow.registry.auth import authfile, scrub, secrets_of
from forgeflow.registry.migration import (
    ALREADY_COMPLETED,
    MigrationRecord,
    load_states,
    migrate_images,
)
from forgeflow.registry.prewarm import verify_layer_reuse
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo

pytestmark = pytest.mark.integration

SOURCE_PORT, TARGET_PORT, AUTH_PORT = 5743, 5744, 5745
USER, PASSWORD = "ci-user", "s3cr3t-Pa55word-" + uuid.uuid4().hex[:8]


def _podman(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(
        ["podman", *args], env=tool_env(), capture_output=True, text=True, timeout=180, cwd=cwd
    )
    assert done.returncode == 0, f"podman {args}: {done.stderr}"
    return done.stdout.strip()


def _import_image(name: str, files: dict[str, bytes], scratch: Path) -> str:
    """``podman import`` a tar of ``files``; return the local image name."""
    tar_path = scratch / f"{uuid.uuid4().hex}.tar"
    with tarfile.open(tar_path, "w") as tar:
        for path, content in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    _podman("import", "--message", "forgeflow test", str(tar_path), name)
    return name


def _build_child(name: str, base: str, content: bytes, scratch: Path) -> str:
    """``podman build`` an image ``FROM base`` that adds one file (no RUN step)."""
    context = scratch / uuid.uuid4().hex
    context.mkdir()
    (context / "task.txt").write_bytes(content)
    (context / "Containerfile").write_text(f"FROM {base}\nCOPY task.txt /task.txt\n")
    _podman("build", "--pull=never", "-t", name, "-f", "Containerfile", ".", cwd=context)
    return name


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory, registry_runner) -> Iterator[dict[str, RegistryServer]]:
    root = tmp_path_factory.mktemp("auth-registries")
    htpasswd = root / "htpasswd"
    hashed = crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    htpasswd.write_text(f"{USER}:{hashed}\n")
    servers = {
        "source": RegistryServer("source", SOURCE_PORT, root / "source" / "storage"),
        "target": RegistryServer("target", TARGET_PORT, root / "target" / "storage"),
        "auth": RegistryServer("auth", AUTH_PORT, root / "auth" / "storage", htpasswd_path=htpasswd),
    }
    with registry_runner(servers):
        yield servers


@pytest.fixture(scope="module")
def local_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two bases, a child of each (podman build FROM), and three tiny env images."""
    scratch = tmp_path_factory.mktemp("auth-images")
    run = uuid.uuid4().hex[:8]
    prefix = f"localhost/forgeflow-test-auth/{run}"
    images = {
        "base-a": _import_image(f"{prefix}/base-a:latest", {"etc/base": b"a\n" * 64}, scratch),
        "base-b": _import_image(f"{prefix}/base-b:latest", {"etc/base": b"b\n" * 64}, scratch),
    }
    images["child-a"] = _build_child(f"{prefix}/child-a:latest", images["base-a"], b"task a\n", scratch)
    images["child-b"] = _build_child(f"{prefix}/child-b:latest", images["base-b"], b"task b\n", scratch)
    for index in range(3):
        key = f"env-{index}"
        images[key] = _import_image(f"{prefix}/{key}:latest", {"hello.txt": f"{key} {run}\n".encode()}, scratch)
    try:
        yield images
    finally:
        for name in images.values():
            subprocess.run(
                ["podman", "rmi", "--force", name], env=tool_env(), capture_output=True, timeout=60
            )


def test_authfile_copy_works_and_the_file_is_private_and_gone(
    registries: dict[str, RegistryServer], skopeo: Skopeo, local_images: dict[str, str]
) -> None:
    address = registries["auth"].address
    target = f"docker://{address}/env/private:1"
    seen: dict[str, object] = {}
    endpoint = RegistryEndpoint(address=address, username=USER, password=SecretStr(PASSWORD))
    with endpoint.skopeo(retry_times=0, command_timeout_s=60) as authed:
        path = authed.authfile
        assert path is not None and path.is_file()
        seen["mode"] = stat.S_IMODE(path.stat().st_mode)
        assert PASSWORD in secrets_of(path)
        digest = authed.copy(f"containers-storage:{local_images['env-0']}", target, preserve_digests=False)
        assert authed.inspect_digest(target) == digest
        assert authed.list_tags(f"docker://{address}/env/private") == ["1"]
    assert seen["mode"] == 0o600
    assert not path.exists() and not path.parent.exists()

    # Without credentials: a RegistryError that is neither transient nor retried by skopeo.
    impatient = Skopeo(retry_times=3, command_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(RegistryError) as denied:
        impatient.inspect_digest(target)
    assert time.monotonic() - started < 5  # skopeo's own retries would back off >= 1+2+4 s
    assert not is_transient(denied.value)
    assert address in str(denied.value)


def test_wrong_password_never_shows_in_errors_and_file_is_removed_on_error(
    registries: dict[str, RegistryServer], local_images: dict[str, str]
) -> None:
    address = registries["auth"].address
    wrong = PASSWORD + "-wrong"
    kept: list[Path] = []
    with pytest.raises(RegistryError) as denied:
        with authfile({address: (USER, SecretStr(wrong))}) as path:
            kept.append(path)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            Skopeo(authfile=path, retry_times=0).copy(
                f"containers-storage:{local_images['env-1']}",
                f"docker://{address}/env/private:2",
                preserve_digests=False,
            )
    assert not kept[0].exists()
    text = "".join(
        str(exc) + repr(exc) for exc in (denied.value, denied.value.__cause__, denied.value.__context__)
    )
    assert wrong not in text and PASSWORD not in text
    assert "unauthorized" in str(denied.value).lower() or "401" in str(denied.value)

    with pytest.raises(InputError) as bad:
        with authfile({address: (USER, "")}):
            pass
    assert address in str(bad.value)
    with pytest.raises(InputError, match="both username and password"):
        with RegistryEndpoint(address=address, username=USER).skopeo():
            pass


def test_task_image_reuses_its_base_layers_and_a_foreign_base_fails(
    registries: dict[str, RegistryServer], skopeo: Skopeo, local_images: dict[str, str]
) -> None:
    target = registries["target"].address
    refs = {}
    for key in ("base-a", "base-b", "child-a", "child-b"):
        refs[key] = f"docker://{target}/reuse/{key}:1"
        skopeo.copy(f"containers-storage:{local_images[key]}", refs[key], preserve_digests=False)

    reuse = verify_layer_reuse(skopeo, refs["child-a"], refs["base-a"])
    assert reuse.reused
    assert len(reuse.base_layers) == 1 and len(reuse.task_layers) == 2
    assert reuse.task_layers[0] == reuse.base_layers[0]

    with pytest.raises(DigestMismatchError) as foreign:
        verify_layer_reuse(skopeo, refs["child-b"], refs["base-a"])
    assert refs["child-b"] in str(foreign.value) and refs["base-a"] in str(foreign.value)


def test_target_dying_mid_migration_leaves_correct_state_and_rerun_finishes(
    registries: dict[str, RegistryServer], skopeo: Skopeo, local_images: dict[str, str], tmp_path: Path
) -> None:
    """The state lives in the store's images rows: after the target dies, each image's row says
    completed / failed (with the exception), and a re-run reads the store and copies only the rest."""
    source, target = registries["source"], registries["target"]
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    pairs = []
    for index in range(3):
        src = f"docker://{source.address}/env/mid-{index}:1"
        skopeo.copy(f"containers-storage:{local_images[f'env-{index}']}", src, preserve_digests=False)
        pairs.append((src, f"docker://{target.address}/env/mid-{index}:1"))
    missing = (f"docker://{source.address}/env/absent:1", f"docker://{target.address}/env/absent:1")
    pairs.insert(1, missing)
    source_digests = {src: skopeo.inspect_digest(src) for src, _ in pairs if src != missing[0]}
    seen_in_store: list[dict[str, str]] = []

    def stop_target_after_first(record: MigrationRecord) -> None:
        seen_in_store.append({ref: r.status for ref, r in load_states(store).items()})
        if record.source_ref == pairs[0][0]:
            target.stop()

    try:
        first = migrate_images(skopeo, pairs, transient_retries=1, backoff_s=0.1,
                               on_record=stop_target_after_first, store=store, run_id="run-1")
        assert [r.status for r in first] == ["completed", "failed", "failed", "failed"]
        assert first[0].reason == "" and first[0].target_digest == source_digests[pairs[0][0]]
        # The missing image is reported by name, not retried, whatever the target does.
        assert (first[1].error_type, first[1].attempts) == ("ImageNotFoundError", 1)
        assert "env/absent:1" in first[1].reason
        for record in first[2:]:
            assert record.error_type == "RegistryUnavailableError"
            assert record.attempts == 2  # one retry with backoff
            assert str(TARGET_PORT) in record.reason
            assert record.source_digest == source_digests[record.source_ref]
            assert record.target_digest is None
    finally:
        target.ensure_running()
    # while the run went on, images not reached yet were recorded pending
    assert seen_in_store[0] == {pairs[0][1]: "completed", pairs[1][1]: "pending", pairs[2][1]: "pending",
                                pairs[3][1]: "pending"}
    stored = load_states(store)
    assert {ref: r.status for ref, r in stored.items()} == {
        dst: status for (_, dst), status in zip(pairs, ["completed", "failed", "failed", "failed"])}
    assert stored[pairs[0][1]].target_digest == source_digests[pairs[0][0]]
    assert stored[pairs[1][1]].error_type == "ImageNotFoundError"
    assert stored[pairs[2][1]].error_type == "RegistryUnavailableError"
    assert stored[pairs[2][1]].source_digest == source_digests[pairs[2][0]]

    second = migrate_images(skopeo, pairs, transient_retries=0, store=store, run_id="run-2")
    assert [r.status for r in second] == ["completed", "failed", "completed", "completed"]
    assert second[0].reason == ALREADY_COMPLETED and second[0].attempts == 0  # read from the store, not copied
    assert [r.reason for r in second[2:]] == ["", ""]  # freshly copied
    for record in (second[0], *second[2:]):
        assert record.target_digest == record.source_digest == source_digests[record.source_ref]
        assert skopeo.inspect_digest(record.target_ref) == record.source_digest
    assert store.get_image(pairs[2][1].removeprefix("docker://")).run_id == "run-2"
    assert store.get_image(pairs[0][1].removeprefix("docker://")).run_id == "run-1"  # untouched

    third = migrate_images(skopeo, pairs, transient_retries=0, store=store)
    assert [r.reason for r in third if r.status == "completed"] == [ALREADY_COMPLETED] * 3
    store.dispose()


def test_authfile_holds_the_login_format_and_scrub_removes_every_form_of_the_secret() -> None:
    with authfile({"127.0.0.1:5745": (USER, PASSWORD)}) as path:
        document = json.loads(path.read_text())
        secrets = secrets_of(path)
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert document == {"auths": {"127.0.0.1:5745": {"auth": token}}}
    leaked = f'msg="auth {token} for {USER}:{PASSWORD} failed; password {PASSWORD}"'
    cleaned = scrub(leaked, secrets)
    assert PASSWORD not in cleaned and token not in cleaned
    assert cleaned.count("***") == 3
    assert secrets_of(path) == []  # the file is gone
