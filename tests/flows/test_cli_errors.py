"""The installed ``forgeflow`` entry point turns known errors into one line, never a traceback:
bad input exits 2, an unreachable store database exits 1 (run as a real process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forgeflow.common.settings import REPO_ROOT
from tests.helpers import free_port, store_revision


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_a_malformed_store_url_is_one_line_and_exit_2() -> None:
    done = _run("trials", FORGEFLOW_STORE_URL="notaurl")
    assert done.returncode == 2
    assert "store URL 'notaurl' is not a valid SQLAlchemy URL" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_an_unreachable_store_database_is_one_line_and_exit_1() -> None:
    url = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/x"  # nothing listens there
    done = _run("status", FORGEFLOW_STORE_URL=url)
    assert done.returncode == 1
    line = " ".join(done.stderr.split())
    assert "error: StoreUnavailableError" in line and "Connection refused" in line
    assert f"store database {url} (FORGEFLOW_STORE_URL) cannot be reached" in line  # names the store and setting
    assert "Traceback" not in done.stderr + done.stdout


def test_an_unreachable_store_database_masks_its_password(tmp_path) -> None:
    url = f"postgresql+psycopg://forge:s3cr3t-pw@127.0.0.1:{free_port()}/x"
    done = _run("trials", FORGEFLOW_STORE_URL=url, FORGEFLOW_HOME=str(tmp_path))
    assert done.returncode == 1
    assert "forge:***@127.0.0.1" in done.stderr and "s3cr3t-pw" not in done.stderr + done.stdout


def test_a_folder_given_as_an_id_list_is_one_line_and_exit_2(tmp_path) -> None:
    from forgeflow.ledger.store import Store

    store = Store(f"sqlite:///{tmp_path / 'home' / 'store.db'}")  # `derived build` only reads the store
    store.upgrade()
    store.dispose()
    done = _run("derived", "build", "x", "--define", "x = accepted - s", "--id-list", f"s={tmp_path}@v1",
                FORGEFLOW_HOME=str(tmp_path / "home"))
    assert done.returncode == 2
    assert "IsADirectoryError" in done.stderr and str(tmp_path) in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


READ_ONLY_COMMANDS = [["status"], ["status", "--json"], ["trials"], ["trials", "--job", "a"], ["compare", "a", "b"],
                      ["lineage", "deadbeefdeadbeef"], ["recover", "--batch", "b1"], ["freeze", "verify", "v1"],
                      ["derived", "verify", "x"], ["derived", "build", "x", "--define", "x = accepted"],
                      ["derived", "build", "x", "--define", "x = nosuch"]]


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=" ".join)
def test_a_read_only_command_on_a_mistyped_home_names_the_store_and_creates_nothing(tmp_path, command) -> None:
    home = tmp_path / "forgeflw"  # the typo
    env = {k: v for k, v in os.environ.items() if k != "FORGEFLOW_STORE_URL"}
    done = subprocess.run([sys.executable, "-m", "deployments.cli", *command], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**env, "FORGEFLOW_HOME": str(home)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: StoreNotFoundError: no forgeflow store at {home / 'store.db'}; run a flow first or set " \
           "FORGEFLOW_HOME" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr + done.stdout
    assert not home.exists()


def test_a_store_url_to_a_missing_sqlite_file_is_named_and_not_created(tmp_path) -> None:
    missing = tmp_path / "x" / "forgeflow.db"
    done = _run("trials", FORGEFLOW_STORE_URL=f"sqlite:///{missing}", FORGEFLOW_HOME=str(tmp_path / "home"))
    assert done.returncode == 2
    assert f"no forgeflow store at {missing}; run a flow first or fix FORGEFLOW_STORE_URL" in " ".join(
        done.stderr.split())
    assert not missing.parent.exists() and not (tmp_path / "home").exists()


CORRUPTIBLE_COMMANDS = [["status"], ["trials"], ["freeze", "verify", "demo-v1"], ["lineage", "deadbeefdeadbeef"],
                        ["derived", "verify", "x"], ["recover", "--batch", "b1"]]


@pytest.mark.parametrize("command", CORRUPTIBLE_COMMANDS, ids=" ".join)
def test_a_store_file_that_is_not_a_database_is_one_line_naming_it_and_exit_2(tmp_path, command) -> None:
    store_db = tmp_path / "store.db"
    store_db.write_text("garbage\n")
    done = _run(*command, FORGEFLOW_HOME=str(tmp_path), FORGEFLOW_STORE_URL=f"sqlite:///{store_db}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: StoreInvalidError: {store_db} is not a forgeflow store (file is not a database)" in " ".join(
        done.stderr.split())
    assert "Traceback" not in done.stderr + done.stdout and len(done.stderr.strip().splitlines()) <= 2
    assert store_db.read_text() == "garbage\n"


def test_an_empty_store_file_is_refused_and_left_empty(tmp_path) -> None:
    store_db = tmp_path / "store.db"
    store_db.touch()
    for command in (["status"], ["status", "--json"], ["trials"]):
        done = _run(*command, FORGEFLOW_HOME=str(tmp_path), FORGEFLOW_STORE_URL=f"sqlite:///{store_db}")
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{store_db} is not a forgeflow store (it has no forgeflow schema)" in " ".join(done.stderr.split())
        assert store_db.stat().st_size == 0  # a read never writes the schema into it


def test_a_store_at_an_older_revision_is_refused_not_migrated_by_a_read(tmp_path) -> None:
    from forgeflow.ledger.store import Store

    url = f"sqlite:///{tmp_path / 'store.db'}"
    old = Store(url)
    old.upgrade("0002")
    old.dispose()
    done = _run("status", FORGEFLOW_HOME=str(tmp_path), FORGEFLOW_STORE_URL=url)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is at schema revision 0002, older than this forgeflow's" in done.stderr
    assert "run any flow or `forgeflow up` to migrate it" in " ".join(done.stderr.split())
    assert store_revision(Store(url)) == "0002"


def test_up_refuses_a_notify_url_that_is_not_http_before_starting_anything(tmp_path) -> None:
    done = _run("up", "--port", str(free_port()), "--notify-url", "not-a-url", FORGEFLOW_HOME=str(tmp_path))
    assert done.returncode == 2
    assert "--notify-url 'not-a-url' is not an http(s) URL" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "service").exists()  # no server, no worker, no state


def test_up_on_an_unreachable_prefect_database_is_one_line_exit_1_and_leaves_nothing(tmp_path) -> None:
    from tests.helpers import pid_alive

    url = f"postgresql://nobody@127.0.0.1:{free_port()}/prefect"  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "up", "--port", str(free_port()), "--database", url],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FORGEFLOW_HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")})
    assert done.returncode == 1, done.stderr  # infrastructure, not bad input
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    text = " ".join(done.stderr.split())
    assert text.startswith("error: ServerStartError: prefect server exited before answering"), text
    assert "ConnectionRefusedError" in text  # the log's exception line, not its last line ("Server stopped!")
    assert "(log " in text and len(lines) <= 3, lines  # one message (the console may wrap it), not the log
    assert "Traceback" not in done.stdout
    assert not (tmp_path / "service" / "server.pid").exists()
    state = tmp_path / "service" / "server.log"
    assert state.is_file()  # the log stays for the user to read
    import json
    recorded = tmp_path / "service" / "service.json"
    if recorded.exists():  # whatever was recorded names no live process
        server = json.loads(recorded.read_text()).get("server") or {}
        assert not server or not pid_alive(server["pid"])


def _damage(store_db) -> None:
    """Overwrite the b-tree page type of every table's and index's root page but ``alembic_version``'s (the
    schema and the revision stay readable, as in a file a crash or a failing disk damaged mid-way; the job list
    reads an index alone)."""
    import sqlite3

    connection = sqlite3.connect(store_db)
    try:
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        roots = [page for table, page in connection.execute(
            "SELECT tbl_name, rootpage FROM sqlite_master WHERE type IN ('table', 'index')")
            if table != "alembic_version" and page > 1]
    finally:
        connection.close()
    with open(store_db, "r+b") as handle:
        for page in roots:
            handle.seek((page - 1) * page_size)
            handle.write(b"\x00")  # not one of the four b-tree page types (2, 5, 10, 13)


@pytest.mark.parametrize("command", [["status"], ["trials"], ["lineage", "deadbeefdeadbeef"]], ids=" ".join)
def test_a_damaged_store_is_one_line_naming_it_and_how_to_recover(tmp_path, command) -> None:
    """A new-user trial's store was damaged ("database disk image is malformed"); every read printed a
    150-line traceback. Now one line: the store, what SQLite said, and the way back."""
    from forgeflow.ledger.records import TaskRecord
    from forgeflow.ledger.store import Store

    store_db = tmp_path / "store.db"
    store = Store(f"sqlite:///{store_db}")
    store.upgrade()
    for n in range(20):
        store.record_task(TaskRecord(instance_id=f"calc-{n}", repo="calc", patch="x" * 500, status="candidate"))
    store.dispose()
    _damage(store_db)
    done = _run(*command, FORGEFLOW_HOME=str(tmp_path), FORGEFLOW_STORE_URL=f"sqlite:///{store_db}")
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert f"error: StoreInvalidError: the forgeflow store {store_db} cannot be read: database disk image is " \
           f"malformed; restore it from a backup, or copy out what is left with `sqlite3 {store_db} .recover`" in said
    assert "Traceback" not in done.stderr + done.stdout
