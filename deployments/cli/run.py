"""``forgeflow demo``, ``forgeflow ui`` and ``forgeflow version``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from deployments.cli.app import Stopped, app, console, fail, prepare_env, raise_stopped, stop_signals


@app.command()
def demo(
    output_dir: Optional[Path] = typer.Option(None, help="results folder (default $FORGEFLOW_HOME/demo)"),
    projects: Optional[str] = typer.Option(None, help="comma-separated project names (default: all six)"),
    candidates: int = typer.Option(5, min=1, max=200, help="candidate bugs per project"),
    freeze_name: str = typer.Option("demo-v1", help="name of the frozen dataset (immutable: a new "
                                    "selection needs a new name)"),
    keep_serving: bool = typer.Option(False, help="leave the candidate model server running"),
    base_model: str = typer.Option("tiny", help="demo profile: tiny (the text model) or tiny-vl (the multimodal "
                                   "model served by llama-server with its projector; results default to "
                                   "$FORGEFLOW_HOME/demo-tiny-vl)"),
) -> None:
    """Run the whole lifecycle on the embedded default and print its summary.

    The options set the lifecycle config's projects, candidates_per_project, output_dir,
    freeze.name and serving.keep_running; ``--base-model tiny-vl`` also sets base_model and serving.block
    (a llama-server block it saves first, :data:`forgeflow.config.DEMO_VL_SERVING`); the rest keep the
    demo's defaults. A refused value is
    named by its place in the config (e.g. freeze.name). SIGTERM, SIGINT or SIGHUP stops the run as
    Ctrl-C does: what it started (registries, model server, Prefect's temporary server) stops, and
    it exits 128 + the signal's number with one line saying so.
    """
    home = prepare_env()
    from pydantic import ValidationError  # noqa: PLC0415

    from deployments.cli.records import DEMO_FOLDERS  # noqa: PLC0415
    from flows.lifecycle import lifecycle  # noqa: PLC0415
    from forgeflow.common.errors import ForgeflowError, InputError  # noqa: PLC0415
    from forgeflow.config import DEMO_PROFILES, DEMO_PROJECTS, LifecycleConfig, demo_profile  # noqa: PLC0415
    from forgeflow.curation.freeze import check_freeze_inputs  # noqa: PLC0415

    names = tuple(p.strip() for p in projects.split(",")) if projects is not None else DEMO_PROJECTS
    try:
        profile = demo_profile(base_model)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--base-model") from None
    default_dir = home / DEMO_FOLDERS[DEMO_PROFILES.index(base_model)]  # each profile its own results folder
    try:
        config = LifecycleConfig(**{**profile, "projects": names, "candidates_per_project": candidates,
                                    "output_dir": output_dir or default_dir, "freeze": {"name": freeze_name},
                                    "serving": {**profile.get("serving", {}), "keep_running": keep_serving}})
    except ValidationError as exc:
        messages = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise typer.BadParameter(messages) from None
    try:  # a results folder that cannot be made or written: refused before the lifecycle starts anything
        config.output_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(config.output_dir, os.W_OK | os.X_OK):
            raise PermissionError(f"{config.output_dir} is not writable")
    except OSError as exc:
        fail(f"--output-dir {config.output_dir}: cannot hold the demo's results ({exc.strerror or exc})")
    try:  # a freeze name made from other inputs: refused here, before a flow run logs a traceback
        check_freeze_inputs(config.freeze.name, config.output_dir.resolve() / "freezes", config.freeze_inputs())
    except InputError as exc:
        fail(exc)
    if config.serving.block is not None:  # the profile's llama-server block, saved where the lifecycle reads it
        _save_demo_serving_block(config.serving.block)
    summary_path = config.output_dir.resolve() / "summary.json"
    # a stop signal unwinds the run: its registries and model server stop on the way out, Prefect's
    # temporary server (a child of this process, stopped by atexit) at exit
    with stop_signals(raise_stopped) as stopping:
        try:
            lifecycle(config=config)
            if stopping:  # it came as the flow ended, and Prefect kept the run's outcome
                raise Stopped(stopping[0][1])
            _print_summary(summary_path)
        except (Stopped, Exception) as exc:
            if stopping:  # Stopped, or the signal as another error: Prefect's task engine, stopped while it
                # created a task run, raises its own ValueError("Task run is not set") over the KeyboardInterrupt
                stopped = Stopped(stopping[0][1])
                fail(f"forgeflow demo {stopped} (what was done so far: {summary_path})", status=128 + stopped.signum)
            if isinstance(exc, InputError):  # bad input (e.g. a freeze name reused): one line, exit 2
                fail(f"lifecycle failed: {type(exc).__name__}: {exc} (what was done so far: {summary_path})")
            if isinstance(exc, ForgeflowError):  # infrastructure: exit 1
                console.print(f"[red]lifecycle failed: {type(exc).__name__}: {exc}[/red]")
                console.print(f"what was done so far: {summary_path}")
                raise typer.Exit(1) from None
            raise


def _save_demo_serving_block(name: str) -> None:
    """Save (overwrite) the ``forgeflow-serving`` block ``name`` with the tiny-vl demo's llama-server
    options (:data:`forgeflow.config.DEMO_VL_SERVING`) on the Prefect API the lifecycle uses."""
    from blocks.core import ServingBackend  # noqa: PLC0415
    from forgeflow.config import DEMO_VL_SERVING  # noqa: PLC0415

    ServingBackend(**DEMO_VL_SERVING).save(name, overwrite=True)


def _print_summary(path: Path) -> None:
    """Print a lifecycle's summary.json: the stage table, then one line per fact. The lines that hold
    paths and digests are never wrapped (``soft_wrap``), whatever the width of stdout (a log, a pipe,
    a narrow terminal): a copied path or sha256 is whole."""
    summary = json.loads(path.read_text())
    table = Table(title="forgeflow lifecycle")
    for col in ("stage", "status", "wall s", "counts"):
        table.add_column(col)
    for name, st in summary["stages"].items():
        counts = ", ".join(f"{k}={v}" for k, v in st.get("counts", {}).items())
        table.add_row(name, st["status"], f"{st.get('wall_s', 0):.1f}", counts)
    console.print(table)
    lines = [f"summary: {path}"]
    if "freeze" in summary:
        lines.append(f"freeze {summary['freeze']['name']}: semantic sha256 {summary['freeze']['semantic_sha256']}")
    if "comparison" in summary:
        c = summary["comparison"]
        lines.append(f"compare: wins {c['wins']} ties {c['ties']} losses {c['losses']}, "
                     f"exact McNemar p = {c['mcnemar_p']:.3g}")
    if "promotion" in summary:
        d = summary["promotion"]
        lines.append(f"promotion gate: {d['verdict']} ({d['reason']})")
    lines += [f"  {name}: {art['path']}  sha256 {art['sha256']}" for name, art in summary.get("artifacts", {}).items()]
    lines.append(f"total wall time {summary['total_wall_s']:.1f} s")
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def ui_server_env(port: int) -> dict[str, str]:
    """The environment of ``prefect server start --port PORT`` whose UI calls this server's API.

    ``--port`` alone moves the API but not the UI: the UI page calls PREFECT_UI_API_URL, which
    defaults to PREFECT_API_URL or else to PREFECT_SERVER_API_HOST:PREFECT_SERVER_API_PORT (default
    4200), and shows "Can't connect to Server API" on any other port. Here the server's host and port
    settings are this server's and PREFECT_UI_API_URL is ``http://127.0.0.1:PORT/api`` unless the user
    set it (a server behind a proxy).

    Args:
        port: the server's TCP port on 127.0.0.1.

    Returns:
        A copy of ``os.environ`` with those settings.
    """
    env = dict(os.environ)
    env.update(PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(port))
    env.setdefault("PREFECT_UI_API_URL", f"http://127.0.0.1:{port}/api")
    return env


@app.command()
def ui(port: int = typer.Option(4200, help="UI/API port on 127.0.0.1 (1..65535, free)")) -> None:
    """Start the Prefect server and UI on forgeflow's Prefect database.

    Ctrl-C, SIGTERM or SIGHUP to this command stops the server it started (its whole process
    group: SIGTERM, then SIGKILL after 10 s); an invalid or busy port is refused in one line.
    """
    import signal  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    if not 1 <= port <= 65535:
        fail(f"forgeflow ui: --port must be in 1..65535, got {port}")
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            fail(f"forgeflow ui: port {port} on 127.0.0.1 is not free ({exc.strerror}); give another --port")
    prepare_env()
    console.print(f"Prefect UI on http://127.0.0.1:{port} (PREFECT_HOME={os.environ['PREFECT_HOME']})")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=ui_server_env(port), start_new_session=True)

    def stop(_signum: int) -> None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    with stop_signals(stop) as stopping:
        while True:
            try:
                code = server.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0][0] > 10:  # SIGTERM not heeded in 10 s
                    try:
                        os.killpg(server.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    if stopping:
        try:  # what the server started in its group and left behind
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise SystemExit(128 + stopping[0][1])
    raise SystemExit(code)


@app.command()
def version() -> None:
    """Print forgeflow's version."""
    import forgeflow  # noqa: PLC0415

    console.print(forgeflow.__version__)
