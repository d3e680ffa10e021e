"""Secrets: a registry token held by a RegistryEndpoint block (pydantic ``SecretStr``) is used by a
real migration (skopeo into a docker-registry with htpasswd auth on 127.0.0.1:5707, from an open
one on 5708), once with the right token and once with a wrong one. Then every log (caplog, the
test's own stdout/stderr, the registries' log files), every file the run wrote (state file, store
database, registry storage), every stored row and every skopeo command line seen while it ran
is scanned for either token, raw and as the base64 ``user:token`` of an auth file: none is found.
"""

from __future__ import annotations

import base64
import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import MetaData, select

from blocks.core import RegistryEndpoint
from forgeflow.common.errors import RegistryError
from forgeflow.common.fsutil import atomic_write_json
from forgeflow.common.settings import home_dir
from forgeflow.ledger.store import Store
from forgeflow.registry import migration as migrate
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo
from tests.helpers import oci_image

pytestmark = pytest.mark.integration

AUTH_PORT, SOURCE_PORT = 5707, 5708
USER = "ci-bot"
TOKEN = "ff-token-" + uuid.uuid4().hex  # unique per run: any hit is a leak, never a coincidence
WRONG_TOKEN = "ff-wrong-" + uuid.uuid4().hex


def _forms(token: str) -> list[bytes]:
    """The ways a token can leak: as itself and inside an auth file's base64 ``user:token``."""
    return [token.encode(), base64.b64encode(f"{USER}:{token}".encode())]


FORBIDDEN = _forms(TOKEN) + _forms(WRONG_TOKEN)


def _hits_in_bytes(data: bytes) -> list[bytes]:
    return [form for form in FORBIDDEN if form in data]


def _hits_in_tree(root: Path, since: float = 0.0) -> dict[str, list[bytes]]:
    """Files under ``root`` (modified after ``since``) that hold a forbidden form."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= since:
            hits = _hits_in_bytes(path.read_bytes())
            if hits:
                found[str(path)] = hits
    return found


def _hits_in_rows(store: Store) -> dict[str, int]:
    """Tables whose rows (every column, as text) hold a forbidden form; also the row count read."""
    metadata = MetaData()
    metadata.reflect(store.engine)
    found, rows = {}, 0
    with store.engine.connect() as connection:
        for table in metadata.sorted_tables:
            for row in connection.execute(select(table)):
                rows += 1
                text = " ".join(map(str, row)).encode()
                if _hits_in_bytes(text):
                    found[table.name] = found.get(table.name, 0) + 1
    found["__rows_read__"] = rows
    return found


class _ArgvWatcher(threading.Thread):
    """Samples /proc every few ms while it runs: the skopeo processes this test process started,
    the auth files they were given, and any whose command line or environment holds a forbidden
    form."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.skopeo_pids: set[int] = set()
        self.authfiles: set[Path] = set()
        self.leaks: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    argv = Path(entry.path, "cmdline").read_bytes()
                    if not argv.startswith(b"skopeo") and b"/skopeo\0" not in argv:
                        continue
                    stat = Path(entry.path, "stat").read_text()
                    environ = Path(entry.path, "environ").read_bytes()
                except OSError:
                    continue
                if int(stat.split(") ", 1)[1].split()[1]) != os.getpid():
                    continue  # another process's skopeo
                self.skopeo_pids.add(int(entry.name))
                for arg in argv.split(b"\0"):
                    if arg.startswith(b"--authfile=") or arg.startswith(b"--dest-authfile="):
                        self.authfiles.add(Path(arg.split(b"=", 1)[1].decode()))
                if _hits_in_bytes(argv + b"\0" + environ):
                    self.leaks.append(argv.replace(b"\0", b" ").decode(errors="replace"))
            time.sleep(0.003)



@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[dict]:
    """A run folder with both registries started (logs and storage inside it), stopped by PID."""
    run = tmp_path / "run"
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"{USER}:{crypt.crypt(TOKEN, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    servers = {"auth": RegistryServer("secrets-auth", AUTH_PORT, run / "registries" / "auth" / "storage",
                                      htpasswd_path=htpasswd),
               "source": RegistryServer("secrets-source", SOURCE_PORT, run / "registries" / "source" / "storage")}
    try:
        for server in servers.values():
            server.start()
        Skopeo(retry_times=0, command_timeout_s=60).copy(
            oci_image(tmp_path / "oci", "1", os.urandom(4096)),
            f"docker://{servers['source'].address}/env/demo:1")
        yield {"run": run, "servers": servers}
    finally:
        for server in servers.values():
            server.stop()


def _migrate(endpoint: RegistryEndpoint, source: str, store: Store, state_file: Path) -> list[migrate.MigrationRecord]:
    """The migrate stage's core: copy each image, record its state in the store, and write the
    records as the run's artifact."""
    pairs = [(f"docker://{source}/env/{name}:1", endpoint.ref(f"env/{name}", "1")) for name in ("demo", "absent")]
    migrate.record_pending(store, migrate.pending_records(pairs), run_id="resilience-secrets")
    with endpoint.skopeo(retry_times=0, command_timeout_s=60) as skopeo:
        records = migrate.migrate_images(
            skopeo, pairs, transient_retries=0,
            on_record=lambda r: migrate.record_state(store, r, run_id="resilience-secrets"))
    # the run's artifact: every image's record (status, reason, exception type, digests)
    previous = json.loads(state_file.read_text()) if state_file.exists() else []
    atomic_write_json(state_file, previous + [r.model_dump(mode="json") for r in records])
    return records


def test_no_token_in_logs_artifacts_rows_or_command_lines(
    run_dir: dict, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.time()
    run, servers = run_dir["run"], run_dir["servers"]
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("forgeflow.tests.resilience")
    store = Store(f"sqlite:///{run / 'store.db'}")
    store.upgrade()
    state_file = run / "migrate-state.json"
    watcher = _ArgvWatcher()
    watcher.start()
    try:
        endpoint = RegistryEndpoint(address=servers["auth"].address, username=USER, password=SecretStr(TOKEN))
        log.info("target block: %r / %s", endpoint, endpoint.model_dump_json())
        records = _migrate(endpoint, servers["source"].address, store, state_file)
        log.info("migration: %s", [r.model_dump(mode="json") for r in records])

        wrong = endpoint.model_copy(update={"password": SecretStr(WRONG_TOKEN)})
        denied = _migrate(wrong, servers["source"].address, store, state_file)
        log.info("with a wrong token: %s", [r.model_dump(mode="json") for r in denied])
        with pytest.raises(RegistryError) as unauthorized:
            with wrong.skopeo(retry_times=0, command_timeout_s=60) as skopeo:
                skopeo.copy(f"docker://{servers['source'].address}/env/demo:1", wrong.ref("env/other", "1"))
        log.exception("copy with a wrong token failed", exc_info=unauthorized.value)
    finally:
        watcher.stop_event.set()
        watcher.join()

    # the operation really used the token: the right one copied, a wrong one was refused
    assert [r.status for r in records] == ["completed", "failed"]
    assert records[1].error_type == "ImageNotFoundError"
    assert [(r.status, r.error_type) for r in denied] == [("failed", "RegistryError"), ("failed", "ImageNotFoundError")]
    assert "unauthorized" in denied[0].reason.lower() or "401" in denied[0].reason
    with pytest.raises(RegistryError):  # anonymous access is refused: the copy needed the token
        Skopeo(retry_times=0, command_timeout_s=60).inspect_digest(endpoint.ref("env/demo", "1"))

    # the scanner finds a planted token (so an empty result below means something)
    planted = run.parent / "planted"
    planted.mkdir()
    (planted / "leak.log").write_text(f"auth={base64.b64encode(f'{USER}:{TOKEN}'.encode()).decode()}\n")
    assert list(_hits_in_tree(planted)) == [str(planted / "leak.log")]

    # logs: every captured record, the test's stdout/stderr (subprocess output included), the
    # registries' own log files
    out, err = capfd.readouterr()
    log_text = caplog.text + "".join(
        r.getMessage() + (r.exc_text or "") for r in caplog.records) + out + err
    assert len(caplog.records) >= 4 and "RegistryError" in caplog.text
    assert _hits_in_bytes(log_text.encode()) == []
    for server in servers.values():
        assert server.log_path.is_file() and server.log_path.stat().st_size > 0
    # artifacts: everything under the run folder (registry logs and storage, state file, store)
    # and whatever the run wrote under FORGEFLOW_HOME
    assert state_file.is_file() and (run / "store.db").is_file()
    assert _hits_in_tree(run) == {}
    assert _hits_in_tree(home_dir(), since=started) == {}
    # stored rows, read back column by column
    rows = _hits_in_rows(store)
    store.dispose()
    assert rows.pop("__rows_read__") >= 2 and rows == {}
    # command lines and environments of every skopeo process seen while the run went on
    assert len(watcher.skopeo_pids) >= 4 and watcher.leaks == []
    # the temporary auth files (one per endpoint.skopeo() block) are gone with their folders
    assert len(watcher.authfiles) >= 3
    assert [p for p in watcher.authfiles if p.exists() or p.parent.exists()] == []
