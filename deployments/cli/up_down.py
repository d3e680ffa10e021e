"""``forgeflow up`` and ``forgeflow down``: the local Prefect service of :mod:`deployments.service`."""

from __future__ import annotations

from typing import Optional

import typer

from deployments.cli.app import app, console, fail, prepare_env, read_store
from deployments.cli.records import SERVING_STATE_FILES


@app.command(short_help="Start the Prefect server, work pool, deployments, automations and a worker.")
def up(port: int = typer.Option(4200, min=1, max=65535, help="Prefect API/UI port on 127.0.0.1"),
       pool: str = typer.Option("local", help="process work pool the deployments target"),
       notify_url: Optional[str] = typer.Option(None, envvar="FORGEFLOW_NOTIFY_URL",
                                                help="webhook URL notified of every failed flow run"),
       database: Optional[str] = typer.Option(None, envvar="FORGEFLOW_PREFECT_DATABASE_URL",
                                              help="the Prefect server's PostgreSQL database, e.g. "
                                                   "postgresql://USER@HOST:PORT/DB (default: SQLite in PREFECT_HOME)"),
       as_json: bool = typer.Option(False, "--json", help="print the recorded state as JSON")) -> None:
    """Start a Prefect server (SQLite in PREFECT_HOME, or PostgreSQL with --database), create the work
    pool, deploy prefect.yaml, create the automations and start a process worker; a second `up`
    reuses what still runs. The forgeflow store is created (schema at head) too, so `status` and the
    other read-only commands work before the first flow run."""
    home = prepare_env()
    from deployments import service  # noqa: PLC0415
    from forgeflow.common.errors import ForgeflowError, InputError  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415

    try:
        state = service.up(home, port=port, pool=pool, notify_url=notify_url, database_url=database)
        store = Store()
        try:
            store.upgrade()
            store_url = store.display_url
        finally:
            store.dispose()
    except (InputError, KeyError) as exc:
        fail(exc)
    except ForgeflowError as exc:  # infrastructure: the server did not start, a database is unreachable
        fail(exc, 1)
    if as_json:
        print(service.state_json(state))
        return
    for proc in (state.server, state.worker):
        if proc is not None:
            how = "reused" if proc.role in state.reused else "started"
            console.print(f"{proc.role}: pid {proc.pid} ({how}), log {proc.log_path}")
    console.print(f"{len(state.deployments)} deployments on pool {state.pool!r}; automations: "
                  f"{', '.join(state.automations) or 'none'}")
    console.print(f"Prefect database: {state.database}")
    console.print(f"forgeflow store: {store_url}")
    console.print(f"model store block {service.MODEL_STORE_BLOCK!r} (publish): {state.model_store}")
    console.print(f"Prefect UI: {state.ui_url}  (API {state.api_url}; stop with `forgeflow down`)")


@app.command(short_help="Stop what `forgeflow up` started (with --serving: the model servers too).")
def down(grace_s: float = typer.Option(10.0, min=0.0, help="seconds between SIGTERM and SIGKILL"),
         serving: bool = typer.Option(False, "--serving", help="also stop the model servers that the serve flow "
                                      "or the demo left serving (the store records their generations retired)")
         ) -> None:
    """Stop the Prefect server and worker that `forgeflow up` started (by recorded PID only); with
    --serving also the live model servers of the known serving state files (a model server is not
    started by `up`, so without --serving it is only named)."""
    home = prepare_env()
    from deployments import service  # noqa: PLC0415
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.serving.bluegreen import read_state, stop_active

    reports = service.down(home, grace_s=grace_s)
    if not reports:
        console.print("nothing to stop (no service recorded)")
    for r in reports:
        console.print(f"{r.role}: pid {r.pid} {r.outcome}")
    for relative in SERVING_STATE_FILES:
        path = home / relative
        try:
            state = read_state(path)
        except InputError:  # a damaged state file names no server to stop
            state = None
        if state is None or state.pid is None:
            continue
        if not serving:
            console.print(f"model server: generation {state.generation} on port {state.active_port} (pid {state.pid}, "
                          f"{path}) still serves; `forgeflow down --serving` stops it")
            continue
        stopped = stop_active(path)
        if stopped is not None and stopped.pid is not None:  # it was live: the ledger says so no more
            from tasks.serving import generation_row  # noqa: PLC0415

            store = read_store()  # a generation that served was recorded, so the store exists
            try:
                store.record_serving_generation(generation_row(stopped, "retired", None))
            finally:
                store.dispose()
        console.print(f"model server: generation {state.generation} on port {state.active_port} (pid {state.pid}) "
                      "stopped")
