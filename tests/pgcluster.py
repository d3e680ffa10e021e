"""A throwaway PostgreSQL cluster for tests, started from Debian's server binaries.

``initdb`` + ``postgres`` from ``/usr/lib/postgresql/N/bin`` (Debian package ``postgresql``, installed
by ``scripts/setup.sh``) or from PATH, run as the ``postgres`` system user when the tests run as root
(PostgreSQL refuses to run as root), trust authentication for the superuser ``forgeflow``, listening
on 127.0.0.1:PORT and on a Unix socket in the cluster's private folder. Stopped by PID (SIGINT: fast
shutdown) and removed afterwards. Used by tests/pgfixtures.py (store tests), tests/flows/conftest.py
(FORGEFLOW_TEST_PREFECT_DB=postgresql) and tests/flows/test_service_postgres.py, each on a free port.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def postgres_bin() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``: on PATH, or Debian's /usr/lib/postgresql/N/bin
    (the highest N); None when neither has them."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).resolve().parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return candidates[-1].parent if candidates else None


def server_user() -> tuple[str, int] | None:
    """(name, uid) the server runs as: ``postgres`` when we are root, else ourselves; None when root
    and there is no ``postgres`` user."""
    import pwd

    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.geteuid())
        return entry.pw_name, entry.pw_uid
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        return None
    return entry.pw_name, entry.pw_uid


def missing_reason() -> str | None:
    """Why a cluster cannot start here (the fixtures fail with it: a missing server is never a skip), or None when it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver (psycopg) is not installed"
    if postgres_bin() is None:
        return "PostgreSQL server binaries (Debian package postgresql) are missing"
    if server_user() is None:
        return "running as root and there is no 'postgres' user to run the server as"
    return None


@dataclass(frozen=True)
class Cluster:
    """A running cluster: superuser ``user`` (no password) on ``host:port``."""

    host: str
    port: int
    user: str
    data_dir: Path
    pid: int

    def url(self, database: str = "postgres", driver: str = "postgresql") -> str:
        """SQLAlchemy/libpq URL of ``database``, e.g. ``postgresql+psycopg://forgeflow@127.0.0.1:5441/db``."""
        return f"{driver}://{self.user}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        """``CREATE DATABASE name`` (autocommit, as PostgreSQL requires)."""
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user=self.user, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


@contextmanager
def postgres_cluster(port: int, startup_timeout_s: float = 60.0) -> Iterator[Cluster]:
    """Start a fresh cluster on 127.0.0.1:``port``, yield it, stop it by PID and delete its files.

    Raises:
        RuntimeError: the binaries or user are missing, the port is taken, or the server did not
            accept connections within ``startup_timeout_s`` (its log is in the message).
    """
    import socket

    reason = missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} on 127.0.0.1 is already in use")
    bindir, (name, uid) = postgres_bin(), server_user()
    root = Path(tempfile.mkdtemp(prefix="forgeflow-pg-"))
    os.chmod(root, 0o755)
    data, sockets, log = root / "data", root / "run", root / "postgres.log"
    sockets.mkdir()
    log.touch()
    if os.geteuid() == 0:
        for path in (root, sockets, log):
            os.chown(path, uid, -1)
    user_kw = {"user": name} if os.geteuid() == 0 else {}
    server = None
    try:
        subprocess.run([str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "forgeflow", "--no-sync",
                        "-E", "UTF8"], check=True, capture_output=True, timeout=120, **user_kw)
        with open(log, "ab") as log_file:
            server = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-k", str(sockets), "-c", "listen_addresses=127.0.0.1",
                 "-p", str(port), "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "max_connections=100"],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **user_kw)
        import psycopg

        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                psycopg.connect(host="127.0.0.1", port=port, user="forgeflow", dbname="postgres",
                                connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL on 127.0.0.1:{port} did not start; log:\n"
                                       f"{log.read_text(errors='replace')[-2000:]}") from None
                time.sleep(0.3)
        yield Cluster(host="127.0.0.1", port=port, user="forgeflow", data_dir=data, pid=server.pid)
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)  # fast shutdown: disconnects clients, then exits
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(root, ignore_errors=True)
