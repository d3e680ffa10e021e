"""``forgeflow up`` / ``forgeflow down``: a local Prefect service (server, pool, deployments, worker).

PIDs, argv and logs go to ``$FORGEFLOW_HOME/service/``; ``down`` stops exactly those processes by PID after
checking ``/proc/PID/cmdline`` against the recorded argv, so it never signals a process it did not start.

Why not ``prefect deploy --all``: from FastAPI 0.151 the 3.9.1 client's ``limit: null`` body is answered 422
(Prefect 3.9.1 declares ``fastapi<0.151``); ``flow.deploy`` needs an image or remote storage; and
``to_deployment(...).apply()`` records the path ``"."``. So ``up`` applies the ``RunnerDeployment`` objects of
``deployments/register.py`` with ``prefect.yaml``'s own pull step (``set_working_directory`` to
``{{ $FORGEFLOW_REPO }}``), and starts the worker with ``FORGEFLOW_REPO`` set to this checkout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError, ServerStartError
from forgeflow.common.fsutil import atomic_write_text
from forgeflow.common.settings import REPO_ROOT

SERVICE_DIRNAME = "service"
STATE_FILE = "service.json"
DATABASE_URL_ENV = "FORGEFLOW_PREFECT_DATABASE_URL"
"""Environment variable ``forgeflow up`` reads the Prefect server's database URL from (``--database``)."""
SQLITE_DEFAULT = "sqlite (PREFECT_HOME)"
LEASE_STORAGE_ENV = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"
LEASE_STORAGE_FILESYSTEM = "prefect.server.concurrency.lease_storage.filesystem"
"""Where ``up``'s server keeps concurrency-slot leases (unless the environment names another module)."""


class ManagedProcess(BaseModel):
    """A background process ``up`` started: its PID (also its process group and session id) and argv."""

    model_config = ConfigDict(frozen=True)

    role: str = Field(description="'server' or 'worker'")
    pid: int = Field(gt=1)
    argv: tuple[str, ...] = Field(min_length=1, description="exact argv, checked against /proc/PID/cmdline")
    log_path: str


MODEL_STORE_BLOCK = "forgeflow-models"
"""The ModelStore block the ``publish`` deployment publishes to; ``up`` saves a local one under
``$FORGEFLOW_HOME/model-store`` when no block of that name exists (an existing one is kept)."""


def ensure_model_store(home: Path) -> str:
    """Save the :data:`MODEL_STORE_BLOCK` block (local, ``home/model-store``) unless it exists; its folder or kind."""
    from blocks.core import ModelStore

    try:
        block = ModelStore.load(MODEL_STORE_BLOCK)
    except ValueError:  # no such block document
        block = ModelStore(kind="local", path=home / "model-store")
        block.save(MODEL_STORE_BLOCK)
    return str(block.path) if block.kind == "local" else f"kind {block.kind}"


def register_block_types() -> tuple[str, ...]:
    """Register (idempotently) the block types of :data:`blocks.__all__` on the API; the slugs, sorted."""
    import blocks

    slugs = []
    for name in blocks.__all__:
        cls = getattr(blocks, name)
        cls.register_type_and_schema()
        slugs.append(cls.get_block_type_slug())
    return tuple(sorted(slugs))


class ServiceState(BaseModel):
    """What ``up`` started and registered (``$FORGEFLOW_HOME/service/service.json``)."""

    model_config = ConfigDict(frozen=True)

    port: int = Field(ge=1, le=65535)
    pool: str = Field(min_length=1)
    api_url: str
    ui_url: str
    server: ManagedProcess
    database: str = Field(default=SQLITE_DEFAULT, description="the server's database URL, password masked, "
                          "or 'sqlite (PREFECT_HOME)' for the embedded default")
    worker: Optional[ManagedProcess] = None
    deployments: dict[str, str] = Field(default_factory=dict, description="'flow/deployment' -> deployment id")
    automations: dict[str, str] = Field(default_factory=dict, description="automation name -> id")
    reused: tuple[str, ...] = Field(default=(), description="roles whose running process was reused")
    block_types: tuple[str, ...] = Field(default=(), description="forgeflow block types registered on the API")
    model_store: str = Field(default="", description=f"the {MODEL_STORE_BLOCK!r} ModelStore block the publish "
                             "deployment names: its local folder, or its kind when not local")


class StopReport(BaseModel):
    """What ``down`` did with one recorded process."""

    model_config = ConfigDict(frozen=True)

    role: str
    pid: int
    outcome: str = Field(description="'terminated', 'killed', 'not running' or 'not ours (left alone)'")


def check_webhook_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host; InputError naming it otherwise."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise InputError(f"--notify-url {url!r} is not a URL: {exc}") from None
    if parsed.scheme not in {"http", "https"} or not parsed.host:
        raise InputError(f"--notify-url {url!r} is not an http(s) URL with a host (e.g. https://hooks.example/forgeflow)")
    return url


def prefect_database_url(url: str) -> str:
    """The async SQLAlchemy URL the Prefect server needs for a PostgreSQL (or SQLite) database URL.

    ``postgresql://``, ``postgres://`` and ``postgresql+psycopg://`` become ``postgresql+asyncpg://``;
    ``sqlite:///PATH`` becomes ``sqlite+aiosqlite:///PATH``; the rest is kept.

    Raises:
        InputError: the URL does not parse, names another database kind or driver, or has no database name.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InputError(f"database URL {_mask(url)!r} does not parse: {exc}") from None
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if backend in {"postgresql", "postgres"}:
        if driver not in {"asyncpg", "psycopg", "psycopg2", "postgresql", "postgres"} and "+" in parsed.drivername:
            raise InputError(f"database URL {_mask(url)!r}: driver {driver!r} is not supported; use "
                             f"postgresql:// or postgresql+asyncpg://")
        if not parsed.database:
            raise InputError(f"database URL {_mask(url)!r} names no database (add /DBNAME)")
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise InputError(f"database URL {url!r}: the Prefect server needs a SQLite file path")
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    else:
        raise InputError(f"database URL {_mask(url)!r}: {backend!r} is not supported by the Prefect server; "
                         f"use postgresql://USER@HOST:PORT/DB (or sqlite:///PATH)")
    return parsed.render_as_string(hide_password=False)


def _mask(url: str) -> str:
    """``url`` with any password replaced by ``***`` (what goes into logs, errors and service.json)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable URL>"


def service_dir(home: Path) -> Path:
    """``$FORGEFLOW_HOME/service`` (created if missing)."""
    path = Path(home) / SERVICE_DIRNAME
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_state(home: Path) -> ServiceState | None:
    """The recorded service state, or None when ``up`` never ran (or ``down`` cleaned up)."""
    path = Path(home) / SERVICE_DIRNAME / STATE_FILE
    return ServiceState.model_validate_json(path.read_text()) if path.is_file() else None


def _cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if not raw:  # zombie or kernel thread
        return None
    return tuple(raw.rstrip(b"\0").decode(errors="replace").split("\0"))


def is_ours(proc: ManagedProcess) -> bool:
    """True when PID ``proc.pid`` is alive and runs exactly the recorded argv (not a reused PID)."""
    return _cmdline(proc.pid) == proc.argv


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``, read from /proc/*/stat."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _spawn(role: str, argv: list[str], env: dict[str, str], sdir: Path) -> ManagedProcess:
    log_path = sdir / f"{role}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    managed = ManagedProcess(role=role, pid=proc.pid, argv=tuple(argv), log_path=str(log_path))
    atomic_write_text(sdir / f"{role}.pid", f"{proc.pid}\n")
    return managed


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Refused)\b.*:")


def _last_log_line(path: Path) -> str:
    """A failed start's log in one line (<= 300 characters): its last exception line, else last line."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace")[-20_000:].splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (errors or lines or ["(empty log)"])[-1][:300]


def _service_env(home: Path, api_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PREFECT_API_URL": api_url, "FORGEFLOW_REPO": str(REPO_ROOT), "FORGEFLOW_HOME": str(home)})
    return env


def _start_server(home: Path, port: int, sdir: Path, startup_timeout_s: float,
                  database_url: str | None = None) -> ManagedProcess:
    api_url = f"http://127.0.0.1:{port}/api"
    if port_in_use(port):
        raise ServerStartError(f"port {port} on 127.0.0.1 is already in use by a process forgeflow did not "
                               f"start; choose another with --port")
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    # `--port` alone leaves the UI calling the API on PREFECT_SERVER_API_PORT (default 4200): the
    # settings make the UI's API URL (PREFECT_UI_API_URL, when the user did not set it) this server's
    env.update(PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(port))
    # concurrency-slot leases on disk (PREFECT_HOME/concurrency_leases), not in the server's memory: with
    # Prefect's in-memory default a server restart forgets the lease of a killed holder while the limit's
    # active_slots (in the database) stays counted, so that slot is never freed
    # (measured; tests/resilience/test_concurrency_slot_restart.py)
    env.setdefault(LEASE_STORAGE_ENV, LEASE_STORAGE_FILESYSTEM)
    if database_url is not None:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    else:
        env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)  # the SQLite default under PREFECT_HOME
    server = _spawn("server", argv, env, sdir)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if _healthy(api_url):
            return server
        if not is_ours(server):
            _stop(server, grace_s=2.0)
            (sdir / "server.pid").unlink(missing_ok=True)
            raise ServerStartError(f"prefect server exited before answering {api_url}/health: "
                                   f"{_last_log_line(Path(server.log_path))} (log {server.log_path})")
        time.sleep(1.0)
    _stop(server, grace_s=5.0)
    (sdir / "server.pid").unlink(missing_ok=True)
    raise ServerStartError(f"prefect server did not answer {api_url}/health within {startup_timeout_s:.0f} s: "
                           f"{_last_log_line(Path(server.log_path))} (log {server.log_path})")


def _ensure_pool(pool: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template(),
                                                   description="forgeflow: flow runs as local processes"))
            return
    if existing.type != "process":
        raise InputError(f"work pool {pool!r} exists with type {existing.type!r}, not 'process'; pass another "
                         f"--pool or delete it")


def _register_deployments(pool: str) -> None:
    """Register every deployment of ``deployments/register.py`` on ``pool``, as ``prefect deploy --all``."""
    import yaml
    from prefect.runner.storage import LocalStorage

    from deployments.register import SPECS, build_deployments

    pull_steps = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["pull"]

    class _PrefectYamlPull(LocalStorage):
        def to_pull_step(self) -> list[dict]:  # noqa: D102 - the pull steps of prefect.yaml
            return pull_steps

    by_name = {spec["name"]: spec for spec in SPECS}
    for deployment in build_deployments(work_pool_name=pool):
        deployment.entrypoint = by_name[deployment.name]["entrypoint"]
        deployment.storage = _PrefectYamlPull(REPO_ROOT)
        deployment.apply(work_pool_name=pool)


def _read_deployments(api_url: str) -> dict[str, str]:
    """``'flow/deployment'`` -> id, over REST with explicit limits (3.9.1's ``limit: null`` gets 422)."""
    flows = httpx.post(f"{api_url}/flows/filter", json={"limit": 200, "offset": 0}, timeout=30)
    deps = httpx.post(f"{api_url}/deployments/filter", json={"limit": 200, "offset": 0}, timeout=30)
    for response in (flows, deps):
        if response.status_code != 200:
            raise ServerStartError(f"{response.request.url} answered {response.status_code}: {response.text[:500]}")
    names = {f["id"]: f["name"] for f in flows.json()}
    return {f"{names.get(d['flow_id'], '?')}/{d['name']}": d["id"] for d in deps.json()}


def up(home: Path, port: int = 4200, pool: str = "local", notify_url: str | None = None,
       startup_timeout_s: float = 240.0, database_url: str | None = None) -> ServiceState:
    """Start (or reuse) the Prefect server and worker, create the pool, deploy, create the automations and blocks.

    Args:
        home: FORGEFLOW_HOME (PREFECT_HOME comes from the environment).
        startup_timeout_s: wait for ``/api/health`` (a fresh SQLite database migrates: 30-60 s on two busy cores).
        database_url: None for SQLite under PREFECT_HOME, or an existing PostgreSQL database (Prefect migrates it);
            a running server on another database is restarted.

    Raises:
        ServerStartError: the port is taken by a foreign process, or the server never became healthy.
        InputError: the pool exists with another type, or a bad ``database_url``/``notify_url`` (checked first).
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.automations import ensure_automations

    home = Path(home).resolve()
    if notify_url is not None:
        check_webhook_url(notify_url)
    server_db_url = prefect_database_url(database_url) if database_url else None
    database = _mask(server_db_url) if server_db_url else SQLITE_DEFAULT
    sdir = service_dir(home)
    previous = read_state(home)
    api_url = f"http://127.0.0.1:{port}/api"
    reused: list[str] = []
    if (previous is not None and previous.port == port and previous.database == database
            and is_ours(previous.server) and _healthy(api_url)):
        server = previous.server
        reused.append("server")
    else:
        if previous is not None and (previous.port != port or previous.database != database):
            down(home)
        server = _start_server(home, port, sdir, startup_timeout_s, server_db_url)
    # recorded before anything else can fail, so `down` can always stop the server
    atomic_write_text(sdir / STATE_FILE, ServiceState(
        port=port, pool=pool, api_url=api_url, ui_url=f"http://127.0.0.1:{port}", server=server, database=database,
        worker=previous.worker if previous is not None and "server" in reused else None).model_dump_json(indent=2))
    env = _service_env(home, api_url)
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        _ensure_pool(pool)
        _register_deployments(pool)
        deployments = _read_deployments(api_url)
        automations = ensure_automations(deployments, notify_url)
        block_types = register_block_types()
        model_store = ensure_model_store(home)
    if (previous is not None and previous.worker is not None and previous.pool == pool
            and "server" in reused and is_ours(previous.worker)):
        worker = previous.worker
        reused.append("worker")
    else:
        if previous is not None and previous.worker is not None and is_ours(previous.worker):
            _stop(previous.worker)
        worker = _spawn("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                   "--type", "process"], env, sdir)
    state = ServiceState(port=port, pool=pool, api_url=api_url, ui_url=f"http://127.0.0.1:{port}", server=server,
                         database=database, worker=worker, deployments=deployments, automations=automations,
                         reused=tuple(reused), model_store=model_store, block_types=block_types)
    atomic_write_text(sdir / STATE_FILE, state.model_dump_json(indent=2))
    return state


def _stop(proc: ManagedProcess, grace_s: float = 10.0) -> str:
    """SIGTERM the process group of ``proc`` (it leads its own session), SIGKILL after ``grace_s``."""
    if not is_ours(proc):
        return "not running" if _cmdline(proc.pid) is None else "not ours (left alone)"
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return "not running"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_members(proc.pid):
            return "terminated"
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return "terminated"
    deadline = time.monotonic() + 5.0
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "killed"


def down(home: Path, grace_s: float = 10.0) -> list[StopReport]:
    """Stop what ``up`` started (worker first) by PID and remove the PID/state files; one StopReport each.

    A PID whose ``/proc/PID/cmdline`` differs from the recorded argv is never signalled; each process's
    group (uvicorn, flow-run processes) stops with it.
    """
    home = Path(home).resolve()
    sdir = Path(home) / SERVICE_DIRNAME
    state = read_state(home)
    reports = []
    if state is not None:
        for proc in (state.worker, state.server):
            if proc is not None:
                reports.append(StopReport(role=proc.role, pid=proc.pid, outcome=_stop(proc, grace_s)))
    for name in ("worker.pid", "server.pid", STATE_FILE):
        (sdir / name).unlink(missing_ok=True)
    return reports


def state_json(state: ServiceState) -> str:
    """The state as indented JSON (for ``--json`` output)."""
    return json.dumps(state.model_dump(mode="json"), indent=2)
