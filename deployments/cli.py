"""The ``forgeflow`` command line (typer).

``forgeflow demo`` runs the lifecycle flow on the embedded default and prints its summary;
``forgeflow ui`` starts the Prefect UI on the same Prefect database; ``forgeflow freeze verify``
recomputes a freeze's digests; ``forgeflow recover`` lists (dry run) or, with ``--apply``, voids the
trials an infrastructure fault broke and requeues their tasks; ``forgeflow derived build|verify``
writes and checks derived task sets (:mod:`forgeflow.curation.derived`). Prefect's environment
(PREFECT_HOME under FORGEFLOW_HOME, analytics off, a startup timeout that suits a 2-core machine)
is set before Prefect is imported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from forgeflow.curation import derived_store

if TYPE_CHECKING:
    from forgeflow.ledger.store import Store

app = typer.Typer(help="forgeflow: the post-training lifecycle of an LLM coding agent as Prefect flows.",
                  no_args_is_help=True)
freeze_app = typer.Typer(help="Frozen datasets.")
app.add_typer(freeze_app, name="freeze")
console = Console()


def prefect_env(home: Path) -> dict[str, str]:
    """Prefect settings for a forgeflow home: its own PREFECT_HOME (the UI reads the same
    database), analytics off, a generous ephemeral-server startup timeout (27-39 s on
    two busy cores). Values the user already set win."""
    defaults = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240",
        "PREFECT_UI_ENABLED": "true",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def _prepare_env(create: bool = True) -> Path:
    """Export FORGEFLOW_HOME (resolved) and Prefect's environment; with ``create`` (commands that
    write: flows, servers) also make PREFECT_HOME. Read-only commands pass False so a mistyped
    home leaves nothing behind."""
    home = Path(os.environ.get("FORGEFLOW_HOME", ".forgeflow")).resolve()
    os.environ["FORGEFLOW_HOME"] = str(home)
    os.environ.update(prefect_env(home))
    if create:
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes only the leaf
    return home


def _read_store() -> "Store":
    """The store for a command that only reads it; nothing is ever written or created. Exits 2
    with one line naming the store when it does not exist (a mistyped FORGEFLOW_HOME or
    FORGEFLOW_STORE_URL), is not a forgeflow store (not SQLite, or no forgeflow schema: a 0-byte
    file stays 0 bytes) or is at an older schema revision: that store is *not* migrated here — the
    message says to run any flow or `forgeflow up`, which migrate it. A database server that
    cannot be reached exits 1 naming the masked URL and its setting (:class:`Store` ``create=False``)."""
    from forgeflow.common.errors import InfraError, InputError  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415

    try:
        return Store(create=False)
    except InputError as exc:
        _fail(exc)
    except InfraError as exc:  # also inside commands that map ForgeflowError to exit 2
        _fail(exc, status=1)
    raise AssertionError("unreachable: _fail exits")


@app.command()
def demo(
    output_dir: Optional[Path] = typer.Option(None, help="results folder (default $FORGEFLOW_HOME/demo)"),
    projects: Optional[str] = typer.Option(None, help="comma-separated project names (default: all six)"),
    candidates: int = typer.Option(5, min=1, max=200, help="candidate bugs per project"),
    freeze_name: str = typer.Option("demo-v1", help="name of the frozen dataset (immutable: a new "
                                    "selection needs a new name)"),
    keep_serving: bool = typer.Option(False, help="leave the candidate model server running"),
) -> None:
    """Run the whole lifecycle on the embedded default and print its summary."""
    home = _prepare_env()
    from pydantic import ValidationError  # noqa: PLC0415

    from flows.lifecycle import lifecycle  # noqa: PLC0415
    from forgeflow.common.errors import ForgeflowError, InputError  # noqa: PLC0415
    from forgeflow.config import DEMO_PROJECTS, LifecycleConfig  # noqa: PLC0415 - after the env is set
    from forgeflow.curation.freeze import check_freeze_inputs  # noqa: PLC0415

    names = tuple(p.strip() for p in projects.split(",")) if projects is not None else DEMO_PROJECTS
    try:
        config = LifecycleConfig(projects=names, candidates_per_project=candidates, freeze_name=freeze_name,
                                 output_dir=output_dir or home / "demo", keep_serving=keep_serving)
    except ValidationError as exc:
        messages = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise typer.BadParameter(messages) from None
    try:  # a freeze name made from other inputs: refused here, before a flow run logs a traceback
        check_freeze_inputs(config.freeze_name, config.output_dir.resolve() / "freezes", config.freeze_inputs())
    except InputError as exc:
        _fail(exc)
    try:
        lifecycle(config=config)
    except InputError as exc:  # bad input (e.g. a freeze name reused): one line, exit 2
        _fail(f"lifecycle failed: {type(exc).__name__}: {exc} (what was done so far: "
              f"{config.output_dir.resolve() / 'summary.json'})")
    except ForgeflowError as exc:  # infrastructure: exit 1
        console.print(f"[red]lifecycle failed: {type(exc).__name__}: {exc}[/red]")
        console.print(f"what was done so far: {config.output_dir.resolve() / 'summary.json'}")
        raise typer.Exit(1) from None
    _print_summary(config.output_dir.resolve() / "summary.json")


def _print_summary(path: Path) -> None:
    summary = json.loads(path.read_text())
    table = Table(title=f"forgeflow lifecycle — {path}")
    for col in ("stage", "status", "wall s", "counts"):
        table.add_column(col)
    for name, st in summary["stages"].items():
        counts = ", ".join(f"{k}={v}" for k, v in st.get("counts", {}).items())
        table.add_row(name, st["status"], f"{st.get('wall_s', 0):.1f}", counts)
    console.print(table)
    if "freeze" in summary:
        console.print(f"freeze {summary['freeze']['name']}: semantic sha256 {summary['freeze']['semantic_sha256']}")
    if "comparison" in summary:
        c = summary["comparison"]
        console.print(f"compare: wins {c['wins']} ties {c['ties']} losses {c['losses']}, "
                      f"exact McNemar p = {c['mcnemar_p']:.3g}")
    if "promotion" in summary:
        d = summary["promotion"]
        console.print(f"promotion gate: {d['verdict']} ({d['reason']})")
    for name, art in summary.get("artifacts", {}).items():
        console.print(f"  {name}: {art['path']}  sha256 {art['sha256']}")
    console.print(f"total wall time {summary['total_wall_s']:.1f} s")


@app.command()
def ui(port: int = typer.Option(4200, help="UI/API port on 127.0.0.1")) -> None:
    """Start the Prefect server and UI on forgeflow's Prefect database (Ctrl-C stops it)."""
    _prepare_env()
    console.print(f"Prefect UI on http://127.0.0.1:{port} (PREFECT_HOME={os.environ['PREFECT_HOME']})")
    raise SystemExit(subprocess.call([sys.executable, "-m", "prefect", "server", "start",
                                      "--host", "127.0.0.1", "--port", str(port)]))


@freeze_app.command("verify")
def freeze_verify(name: str, freezes_dir: Optional[Path] = typer.Option(
        None, help="default $FORGEFLOW_HOME/demo/freezes")) -> None:
    """Recompute a freeze's semantic and file digests and compare them with the ones the store recorded."""
    home = _prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation.freeze import manifest_path, verify_freeze  # noqa: PLC0415

    try:
        path = manifest_path(name, freezes_dir or home / "demo" / "freezes")
        store = _read_store()
        recorded = store.get_freeze(name)
        manifest = verify_freeze(path, expected_file_sha256=recorded.file_sha256 if recorded else None)
    except ForgeflowError as exc:
        _fail(exc)
    problems = []
    if manifest.name != name:
        problems.append(f"the manifest at {path} is freeze {manifest.name!r}, not {name!r}")
    if recorded is not None and recorded.semantic_sha256 != manifest.semantic_sha256:
        problems.append(f"semantic sha256 {manifest.semantic_sha256} differs from the store's "
                        f"{recorded.semantic_sha256}")
    if problems:
        _fail("; ".join(problems))
    where = "matches the store" if recorded is not None else f"not recorded in the store {store.display_url}"
    console.print(f"freeze {manifest.name}: OK ({where}); semantic sha256 {manifest.semantic_sha256}, "
                  f"file sha256 {manifest.file_sha256}")


def _fail(problem: object, status: int = 2) -> None:
    """One line on stderr and exit ``status`` (2: bad input; 1: infrastructure), no traceback."""
    text = f"{type(problem).__name__}: {problem}" if isinstance(problem, Exception) else str(problem)
    Console(stderr=True).print(f"[red]error:[/red] {text}", highlight=False, soft_wrap=True)
    raise typer.Exit(status)


def _tampering(verifier: dict | None) -> list[str] | None:
    """The protected paths a tampering submission changed (None when it did not tamper)."""
    screening = (verifier or {}).get("submission") or {}
    return sorted(screening.get("protected_paths", {})) if screening.get("tampering") else None


@app.command()
def trials(job: Optional[str] = typer.Option(None, help="job id (omit to list the jobs in the store)"),
           merged: bool = typer.Option(False, "--merged", help="the job merged with its recovery jobs: prints "
                                       "{view, job_id, recovery_job_ids, trials} (the view says "
                                       "'original job + N recovery jobs')"),
           as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Each trial's outcome (reward or exception type; flagged when an agent timeout, dead loop or
    hang kept the verifier's reward beside the exception; the protected paths of a tampering
    submission; with --json the verifier's evidence) of a job recorded in the store."""
    _prepare_env(create=False)
    from forgeflow.common.errors import SCORED_DESPITE_EXCEPTION, InputError  # noqa: PLC0415
    from forgeflow.evaluation.compare import merged_job  # noqa: PLC0415

    if job is not None and not job.strip():
        _fail("--job is empty: give a job id (omit --job to list the jobs in the store)")
    if merged and job is None:
        _fail("--merged needs --job JOB (the job to merge with its recovery jobs)")
    store = _read_store()
    if job is None:
        counts: dict[str, int] = {}
        for t in store.trials_for():
            counts[t.job_id or "-"] = counts.get(t.job_id or "-", 0) + 1
        if as_json:
            console.print_json(json.dumps(counts))
        else:
            for name, n in sorted(counts.items()):
                console.print(f"{name}\t{n} trials")
        return
    try:
        view = merged_job(store, job, include_recovery=merged)
    except InputError as exc:
        _fail(exc)
    rows = view.trials if merged else store.trials_for(job_id=job)
    events = {e.trial_id: e for e in store.supervision_events()}
    out = [{"trial_id": t.trial_id, "instance_id": t.instance_id, "kind": t.kind, "job_id": t.job_id,
            "reward": t.reward, "exception_type": t.exception_type, "exception_message": t.exception_message,
            "flagged": t.exception_type in SCORED_DESPITE_EXCEPTION and t.reward is not None,
            "supervision": events[t.trial_id].kind if t.trial_id in events else None,
            "agent_steps": t.agent_steps, "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
            "timings": t.timings, "tampering": _tampering(t.verifier), "verifier": t.verifier}
           for t in rows]
    if as_json:
        body: object = out
        if merged:
            body = {"view": view.label, "job_id": view.job_id, "recovery_job_ids": view.recovery_job_ids,
                    "from_recovery": view.from_recovery, "trials": out}
        print(json.dumps(body, indent=2))
        return
    table = Table(title=f"trials of {view.label if merged else 'job ' + job}")
    for col in ("instance_id", "job", "kind", "reward", "exception"):
        table.add_column(col)
    for t in out:
        exc = (t["exception_type"] or "") + (" (flagged: reward kept)" if t["flagged"] else "")
        if t["tampering"]:
            exc = f"tampering: {', '.join(t['tampering'])}"
        table.add_row(t["instance_id"], t["job_id"] or "", t["kind"], "" if t["reward"] is None else f"{t['reward']:g}",
                      exc)
    console.print(table)


@app.command()
def compare(job_a: str, job_b: str,
            no_recovery: bool = typer.Option(False, "--no-recovery", help="compare the jobs alone, without "
                                             "merging their recovery jobs"),
            as_json: bool = typer.Option(False, "--json", help="print JSON instead of markdown"),
            max_drop: float = typer.Option(0.05, help="promotion gate: largest tolerated drop in pass rate (0.05 = "
                                           "5 points)"),
            alpha: float = typer.Option(0.05, help="promotion gate: significance level (interval at 1 - alpha)"),
            min_pairs: int = typer.Option(30, help="promotion gate: fewest pairs for a verdict other than hold"),
            min_repos: int = typer.Option(3, help="promotion gate: fewest repositories the pairs come from"),
            max_wall_ratio: float = typer.Option(1.5, help="promotion gate: largest mean wall seconds ratio B/A"),
            max_tokens_ratio: float = typer.Option(1.25, help="promotion gate: largest mean input tokens ratio B/A"),
            max_steps_ratio: float = typer.Option(1.25, help="promotion gate: largest mean agent steps ratio B/A"),
            ) -> None:
    """Paired comparison of two jobs on the same frozen split: wins/ties/losses, exact McNemar p, the
    delta interval (Newcombe's paired interval united with the repository-clustered bootstrap),
    excluded tasks with reasons, cost ratios and the promotion gate's verdict and reason (JSON:
    ``promotion``). Each job is merged with its recovery jobs (said in the output) unless --no-recovery."""
    _prepare_env(create=False)
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.evaluation import compare as comparison
    from forgeflow.evaluation.gate import GatePolicy  # noqa: PLC0415

    store = _read_store()
    try:
        gate = GatePolicy.build(max_drop=max_drop, alpha=alpha, min_pairs=min_pairs, min_repos=min_repos,
                                           max_wall_s_ratio=max_wall_ratio, max_input_tokens_ratio=max_tokens_ratio,
                                           max_agent_steps_ratio=max_steps_ratio)
        result = comparison.compare_stored_jobs(store, job_a, job_b, merge_recovery=not no_recovery, gate=gate)
    except InputError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    print(result.markdown)


@app.command()
def lineage(artifact_sha256: str, as_json: bool = typer.Option(False, "--json", help="print JSON: {artifact_sha256, "
                                     "chain (the newest), chains (one per distinct set of producing parents), "
                                     "serving_generations, warnings}"),
            verify: bool = typer.Option(True, "--verify/--no-verify", help="digest each recorded path and say "
                                        "when it is gone or now holds other content")) -> None:
    """Every chain from the base model to ARTIFACT_SHA256 (a GGUF, adapter or model: base -> adapter ->
    merged -> GGUF), the runs that recorded each step, and the serving generations that served it,
    from the store. An artifact made by several producers shows one chain each, newest first."""
    _prepare_env(create=False)
    store = _read_store()
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.packaging.lineage import lineage_of  # noqa: PLC0415

    try:
        report = lineage_of(store, artifact_sha256, verify_paths=verify)
    except InputError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, default=str))
        return
    for n, chain in enumerate(report.chains, 1):
        if len(report.chains) > 1:
            console.print(f"chain {n} of {len(report.chains)}{' (newest)' if n == 1 else ''}")
        for step in chain:
            flag = "" if step.path_status in ("ok", "unchecked") else f"  [{step.path_status}]"
            runs = ", ".join(r or "-" for r in step.run_ids)
            console.print(f"{step.kind:>8} {step.quantization or '':<7} {step.sha256[:16]}  {step.path}{flag}  "
                          f"(runs: {runs})", highlight=False, soft_wrap=True)
    for g in report.serving_generations:
        console.print(f"  served as generation {g.generation} on port {g.port} ({g.status})")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)

@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of text: "
                                         "{schema_version, home, store, counts, last_lifecycle, last_freeze, "
                                         "serving, service} (the last four null when there is none)")) -> None:
    """The last lifecycle run's stages, the store's counts, the latest freeze, the serving endpoint,
    and what `forgeflow up` started (server address, pool, deployments, whether its processes run)."""
    home = _prepare_env(create=False)
    store = _read_store()
    summary_path = home / "demo" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    from deployments import service  # noqa: PLC0415

    svc = service.read_state(home)
    freeze = _latest_freeze(store, summary)
    out = {
        "schema_version": STATUS_SCHEMA_VERSION, "home": str(home), "store": store.display_url,
        "counts": store.counts(),
        "last_lifecycle": None if summary is None else {
            "prefect_flow_run_id": summary.get("prefect_flow_run_id"), "total_wall_s": summary.get("total_wall_s"),
            "stages": {k: v["status"] for k, v in summary["stages"].items()}},
        "last_freeze": freeze,
        "serving": _serving_status(store, home),
        "service": None if svc is None else {
            "ui_url": svc.ui_url, "api_url": svc.api_url, "pool": svc.pool, "database": svc.database,
            "server_running": service.is_ours(svc.server),
            "worker_running": svc.worker is not None and service.is_ours(svc.worker),
            "deployments": sorted(svc.deployments), "automations": sorted(svc.automations)},
    }
    if as_json:
        print(json.dumps(out, indent=2, default=str))
        return
    console.print("\n".join(_status_lines(out)), highlight=False, soft_wrap=True)


SERVING_STATE_FILES = (Path("serving") / "state.json", Path("demo") / "serving" / "state.json")
"""The serving state files ``status`` knows, under ``$FORGEFLOW_HOME``: the ``serve`` flow's (and the
``canary`` flow's) default, and the demo lifecycle's."""


def _serving_status(store: "Store", home: Path) -> Optional[dict]:
    """``status``'s serving part: the store's newest active serving generation (else its newest
    generation of any status; None when it records none) with ``generation``, ``port``,
    ``gguf_sha256``, ``status`` (the row's), ``live`` and ``state_path``.

    The store's row does not name its state file, so the known ones (:data:`SERVING_STATE_FILES`)
    are read and the first whose recorded generation, port and GGUF are the row's is its endpoint:
    ``live`` is whether that file names a running server (a PID), ``state_path`` that file. A
    generation no known state file holds any more (superseded, or served from another state file)
    is reported not live, with ``state_path`` None."""
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.serving.bluegreen import read_state

    row = store.latest_serving_generation()
    if row is None:
        return None
    out = {"generation": row.generation, "port": row.port, "gguf_sha256": row.gguf_sha256, "status": row.status,
           "live": False, "state_path": None}
    for relative in SERVING_STATE_FILES:
        try:
            state = read_state(home / relative)
        except InputError:  # a damaged state file is not this generation's endpoint
            continue
        if state is not None and (state.generation, state.active_port, state.gguf_sha256) == (
                row.generation, row.port, row.gguf_sha256):
            return {**out, "live": state.pid is not None, "state_path": str(home / relative)}
    return out


def _latest_freeze(store: "Store", summary: Optional[dict]) -> Optional[dict]:
    """The latest freeze the store recorded (by ``created_at``, then name), as ``status`` shows it
    (the :class:`~forgeflow.ledger.store.FreezeRecord` fields); when the store holds none, the freeze the
    last lifecycle's summary.json names (``name``, ``semantic_sha256``, ``counts`` where it has
    them); None when neither has one."""
    freezes = store.freezes()
    if freezes:
        return freezes[0].model_dump(mode="json")
    recorded = (summary or {}).get("freeze")
    if not isinstance(recorded, dict) or not recorded.get("name"):
        return None
    return {"name": recorded["name"], "semantic_sha256": recorded.get("semantic_sha256"),
            "counts": recorded.get("counts") or {}}


STATUS_SCHEMA_VERSION = 1
"""Version of the object ``forgeflow status --json`` prints (keys are only ever added)."""


def _status_lines(out: dict) -> list[str]:
    """``forgeflow status``'s object as lines of text a person reads (one topic per line)."""
    counts = ", ".join(f"{name} {n}" for name, n in sorted(out["counts"].items()))
    lines = [f"home:      {out['home']}", f"store:     {out['store']}", f"counts:    {counts}"]
    run = out["last_lifecycle"]
    if run is None:
        lines.append("lifecycle: no run yet (forgeflow demo)")
    else:
        stages = ", ".join(f"{k} {v}" for k, v in run["stages"].items())
        wall = "" if run["total_wall_s"] is None else f", {run['total_wall_s']:.1f} s"
        lines.append(f"lifecycle: flow run {run['prefect_flow_run_id'] or '-'}{wall}: {stages}")
    freeze = out["last_freeze"]
    if freeze is None:
        lines.append("freeze:    none")
    else:
        splits = ", ".join(f"{k} {v}" for k, v in (freeze.get("counts") or {}).items())
        lines.append(f"freeze:    {freeze['name']}" + (f" ({splits})" if splits else "")
                     + (f", semantic sha256 {freeze['semantic_sha256']}" if freeze.get("semantic_sha256") else ""))
    serving = out["serving"]
    lines.append("serving:   none" if serving is None else
                 f"serving:   generation {serving['generation']} on port {serving['port']} "
                 f"({'live' if serving['live'] else 'stopped'}), gguf sha256 {serving['gguf_sha256']}")
    svc = out["service"]
    if svc is None:
        lines.append("service:   not started (forgeflow up)")
    else:
        lines.append(f"service:   UI {svc['ui_url']} (API {svc['api_url']}), pool {svc['pool']!r}, "
                     f"server {'running' if svc['server_running'] else 'stopped'}, "
                     f"worker {'running' if svc['worker_running'] else 'stopped'}; "
                     f"{len(svc['deployments'])} deployments; automations: {', '.join(svc['automations']) or 'none'}")
    return lines


@app.command()
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
    home = _prepare_env()
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
        _fail(exc)
    except ForgeflowError as exc:  # infrastructure: the server did not start, a database is unreachable
        _fail(exc, 1)
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


@app.command()
def down(grace_s: float = typer.Option(10.0, min=0.0, help="seconds between SIGTERM and SIGKILL"),
         serving: bool = typer.Option(False, "--serving", help="also stop the model servers that the serve flow "
                                      "or the demo left serving (the store records their generations retired)")
         ) -> None:
    """Stop the Prefect server and worker that `forgeflow up` started (by recorded PID only); with
    --serving also the live model servers of the known serving state files (a model server is not
    started by `up`, so without --serving it is only named)."""
    home = _prepare_env()
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

            store = _read_store()  # a generation that served was recorded, so the store exists
            try:
                store.record_serving_generation(generation_row(stopped, "retired", None))
            finally:
                store.dispose()
        console.print(f"model server: generation {state.generation} on port {state.active_port} (pid {state.pid}) "
                      "stopped")


def _parse_instant(text: Optional[str], option: str) -> Optional[datetime]:
    """ISO 8601 instant (``2026-12-01T10:00:00+00:00``) or None; a bad text exits 2 naming ``option``."""

    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        _fail(f"{option} {text!r} is not an ISO 8601 instant (e.g. 2026-12-01T10:00:00+00:00)")
    return None  # unreachable: _fail exits


_RECOVER_FLAGS = {"batch_ids": "--batch", "batch ids": "--batch ids", "trial_ids": "--trial",
                  "trial ids": "--trial ids", "exception_type": "--exception-type", "since": "--since",
                  "until": "--until", "reason": "--reason", "include_rejections": "--include-rejections"}
_RECOVER_FIELD = re.compile(r"(?<![\w-])(" + "|".join(sorted(_RECOVER_FLAGS, key=len, reverse=True)) + r")(?!\w)")


def _recover_flags(message: str) -> str:
    """``message`` from :class:`~forgeflow.curation.recovery.RecoveryRequest` / ``plan_recovery`` with each
    field name (``batch_ids``, ``since``, ...) replaced by the flag the user typed (``--batch``,
    ``--since``, ...). Quoted values ('...') are left as they are."""
    parts = re.split(r"('[^']*')", message)
    return "".join(part if part.startswith("'") else _RECOVER_FIELD.sub(lambda m: _RECOVER_FLAGS[m.group(1)], part)
                   for part in parts)


def _check_exception_type(name: str) -> None:
    """Exit 2 when ``name`` (``--exception-type``) is neither recorded on any trial in the store
    (void ones included) nor a forgeflow exception class (:mod:`forgeflow.common.errors`): a typo must not
    read as "nothing to recover". The message lists the exception types the store has."""
    from forgeflow.common import errors  # noqa: PLC0415

    known = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.ForgeflowError)}
    if name in known:
        return
    store = _read_store()
    try:
        recorded = sorted({t.exception_type for t in store.trials_for(include_void=True) if t.exception_type})
    finally:
        store.dispose()
    if name not in recorded:
        _fail(f"--exception-type {name!r} is not recorded on any trial in the store {store.display_url} nor a "
              f"forgeflow exception class; the store has: {', '.join(recorded) or 'none'}")


@app.command()
def recover(
    batch: Optional[list[str]] = typer.Option(None, "--batch", help="batch id whose trials to select (repeatable)"),
    trial: Optional[list[str]] = typer.Option(None, "--trial", help="trial id to select (repeatable)"),
    exception_type: Optional[str] = typer.Option(None, help="select trials that ended in this exception class "
                                                 "(needs --since and --until)"),
    since: Optional[str] = typer.Option(None, help="window start, ISO 8601 with timezone (inclusive)"),
    until: Optional[str] = typer.Option(None, help="window end, ISO 8601 with timezone (exclusive)"),
    reason: Optional[str] = typer.Option(None, help="why (stored on every voided trial; required with --apply)"),
    apply: bool = typer.Option(False, "--apply", help="run the recover flow: back up, void, requeue, audit"),
    backup_dir: Optional[Path] = typer.Option(None, help="backup folder (default $FORGEFLOW_HOME/recovery)"),
    include_rejections: bool = typer.Option(False, "--include-rejections",
                                            help="also void and requeue REJECTED tasks whose every live NOP/Oracle "
                                                 "trial is selected (a rejection an infrastructure fault caused); "
                                                 "only with --batch/--trial"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Void exactly the trials an infrastructure fault broke and requeue their tasks.

    A dry run by default (reads the store only, no Prefect server): lists the trials that would be
    voided, the tasks that would be requeued and the selected trials kept (real outcomes).
    ``--apply`` runs the ``recover`` flow (backup with sha256, one transaction with counts
    verified, audit artifact). ``--include-rejections`` also voids the rewarded NOP/Oracle trials
    of rejected tasks named by the ids (accepted tasks and rejections outside the ids stay)."""
    _prepare_env(create=apply)
    from pydantic import ValidationError  # noqa: PLC0415

    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation.recovery import RecoveryRequest, plan_recovery, render_plan  # noqa: PLC0415

    if apply and not (reason or "").strip():
        _fail("--apply needs --reason (it is stored on every voided trial and requeued task)")
    start, end = _parse_instant(since, "--since"), _parse_instant(until, "--until")
    try:
        request = RecoveryRequest(batch_ids=batch or [], trial_ids=trial or [], exception_type=exception_type,
                                  since=start, until=end, reason=reason or "dry run",
                                  include_rejections=include_rejections)
    except ValidationError as exc:
        _fail("; ".join(_recover_flags(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                                       f"{e['msg'].removeprefix('Value error, ')}") for e in exc.errors()))
    if request.exception_type is not None:
        _check_exception_type(request.exception_type)
    if not apply:
        store = _read_store()  # a dry run reads only: a missing store is an error, never created
        try:
            plan = plan_recovery(store, request)
        except ForgeflowError as exc:
            _fail(f"{type(exc).__name__}: {_recover_flags(str(exc))}")
        if as_json:
            print(json.dumps({
                "dry_run": True, "plan_sha256": plan.plan_sha256,
                "void": [{"trial_id": t.trial_id, "instance_id": t.instance_id, "kind": t.kind,
                          "exception_type": t.exception_type, "reward": t.reward, "batch_id": t.batch_id,
                          "created_at": t.created_at.isoformat() if t.created_at else None} for t in plan.void],
                "requeue": [{"instance_id": t.instance_id, "status": t.status, "reason": t.reason}
                            for t in plan.requeue],
                "kept": [k.model_dump() for k in plan.kept],
                "before": plan.before.model_dump(), "expected_after": plan.expected_after.model_dump()}, indent=2))
            return
        console.print(render_plan(plan), highlight=False, soft_wrap=True)
        console.print("dry run: nothing changed; add --apply --reason TEXT to do it")
        return
    from flows.curate import recover as recover_flow  # noqa: PLC0415

    try:
        out = recover_flow(reason=request.reason, batch_ids=request.batch_ids, trial_ids=request.trial_ids,
                           exception_type=request.exception_type, since=request.since, until=request.until,
                           dry_run=False, backup_dir=backup_dir, include_rejections=request.include_rejections)
    except ForgeflowError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(out, indent=2, default=str))
        return
    console.print(f"recovery {out['recovery_id']}: {out['voided']} trial(s) voided, {out['requeued']} task(s) "
                  f"requeued; backup {out['backup_path']} sha256 {out['backup_sha256']}", highlight=False,
                  soft_wrap=True)


derived_app = typer.Typer(help="Derived task sets (set algebra over store, frozen and external sets).")
app.add_typer(derived_app, name="derived")


def _derived_sources(store: "object", freeze_name: Optional[str], freezes_dir: Path,
                     id_lists: list[str]) -> list:
    """The source sets a definition may name: one per store task status (``accepted``,
    ``rejected``, ``error``, ``candidate``), ``images_available``, ``frozen``/``frozen.<split>``
    for ``--freeze``, and each ``--id-list NAME=PATH@REVISION``."""
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415
    from forgeflow.curation.freeze import manifest_path  # noqa: PLC0415

    sources = [derived.store_status_set(status, store, status)
               for status in ("accepted", "rejected", "error", "candidate")]
    sources.append(derived.store_images_available_set("images_available", store))
    if freeze_name is not None:
        recorded = store.get_freeze(freeze_name)
        path = Path(recorded.manifest_path) if recorded is not None else manifest_path(freeze_name, freezes_dir)
        sources.extend(derived.frozen_split_sets(path, prefix="frozen").values())
    for spec in id_lists:
        name, sep, rest = spec.partition("=")
        path, sep2, revision = rest.rpartition("@")
        if not sep or not sep2 or not name or not path or not revision:
            raise InputError(f"--id-list {spec!r}: expected NAME=PATH@REVISION (e.g. solved=ids.txt@abc123)")
        sources.append(derived.id_list_set(name, Path(path), revision))
    return sources


def _derived_json(item: "object", path: Path) -> dict:
    return {"name": item.name, "path": str(path), "count": item.count, "ids_sha256": item.ids_sha256,
            "expression": item.expression, "split_counts": item.split_counts,
            "inputs": {k: {"kind": v.kind, "count": v.count, "ids_sha256": v.ids_sha256}
                       for k, v in item.inputs.items()}}


@derived_app.command("build")
def derived_build(
    name: str,
    definitions: Optional[Path] = typer.Option(None, help="file of 'name = expression' lines "
                                               "(default $FORGEFLOW_HOME/derived/definitions.txt)"),
    define: Optional[list[str]] = typer.Option(None, "--define", help="a definition 'name = expression' "
                                               "(repeatable; instead of --definitions)"),
    freeze: Optional[str] = typer.Option(None, help="a freeze name: its splits are the sets frozen, frozen.train, ..."),
    id_list: Optional[list[str]] = typer.Option(None, "--id-list", help="an external id list NAME=PATH@REVISION "
                                                "(.json list or one id per line; repeatable)"),
    out_dir: Optional[Path] = typer.Option(None, help="where NAME.json goes (default $FORGEFLOW_HOME/derived)"),
    freezes_dir: Optional[Path] = typer.Option(None, help="default $FORGEFLOW_HOME/demo/freezes"),
    replace: bool = typer.Option(False, "--replace", help="replace an existing NAME.json whose content differs "
                                 "(the old file is kept under OUT_DIR/replaced/)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Evaluate derived set NAME over the store's task sets (accepted, rejected, error, candidate,
    images_available), a freeze's splits and external id lists; write NAME.json with the digests
    of its inputs (rebuild and check it with `forgeflow derived verify NAME`). An identical rebuild
    changes nothing; one with other content is refused (exit 2, saying what NAME.json holds)
    unless --replace. The store is only read: a missing one is an error (exit 2), never created.
    NAME is a plain name (no path separators or '..')."""
    home = _prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415

    try:
        derived.validate_derived_name(name)
        if define and definitions is not None:
            _fail("give --definitions or --define, not both")
        if define:
            text = "\n".join(define)
        else:
            source = definitions or home / "derived" / "definitions.txt"
            if not source.is_file():
                _fail(f"no definitions: {source} does not exist; give --definitions FILE or --define 'name = expr'")
            text = source.read_text(encoding="utf-8")
        parsed = derived.parse_definitions(text)
        if name not in parsed.expressions:
            _fail(f"derived set {name!r} is not defined; defined: {', '.join(parsed.expressions) or 'none'}")
        store = _read_store()
        sources = _derived_sources(store, freeze, freezes_dir or home / "demo" / "freezes", id_list or [])
        item = derived.derive(parsed, sources)[name]
        saved = derived_store.save_derived(item, out_dir or home / "derived", replace=replace)
    except ForgeflowError as exc:
        _fail(exc)
    path, old = saved.path, saved.previous
    replaced = None if saved.previous_path is None else {
        "path": str(saved.previous_path), "count": None if old is None else old.count,
        "ids_sha256": None if old is None else old.ids_sha256}
    if as_json:
        print(json.dumps({**_derived_json(item, path), "written": saved.written, "replaced": replaced}, indent=2))
        return
    splits = "; ".join(f"{f}: " + ", ".join(f"{s} {n}" for s, n in c.items()) for f, c in item.split_counts.items())
    done = f"written to {path}" if saved.written else f"unchanged in {path} (identical rebuild)"
    if replaced is not None:
        was = "" if old is None else f"{old.count} ids, sha256 {old.ids_sha256}; "
        done += f" (replaced {was}previous file kept at {saved.previous_path})"
    console.print(f"derived {item.name} = {item.expression}: {item.count} ids, sha256 {item.ids_sha256}"
                  + (f" ({splits})" if splits else "") + f"; {done}", highlight=False, soft_wrap=True)


@derived_app.command("verify")
def derived_verify(
    name: str,
    out_dir: Optional[Path] = typer.Option(None, help="where NAME.json is (default $FORGEFLOW_HOME/derived)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Rebuild derived set NAME from its recorded inputs (store, freeze manifest, id-list files)
    and check every digest; exit 2 naming each changed input otherwise."""
    home = _prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415

    try:
        path = (out_dir or home / "derived") / f"{derived.validate_derived_name(name)}.json"
        store = _read_store()
        item = derived_store.verify_derived(path, store=store)
    except ForgeflowError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps({"ok": True, **_derived_json(item, path)}, indent=2))
        return
    console.print(f"derived {item.name}: OK ({item.count} ids, sha256 {item.ids_sha256}; "
                  f"{len(item.inputs)} input(s) unchanged)", highlight=False, soft_wrap=True)


@app.command()
def version() -> None:
    """Print forgeflow's version."""
    import forgeflow  # noqa: PLC0415

    console.print(forgeflow.__version__)


def main() -> None:
    """The ``forgeflow`` console entry point: the typer app, with known errors as one line.

    Bad input (:class:`~forgeflow.common.errors.InputError`, e.g. a malformed store URL; a path that is a
    folder, unreadable or not UTF-8; a file that does not validate) prints one ``error:`` line and
    exits 2; an infrastructure failure (:class:`~forgeflow.common.errors.InfraError`,
    or a database the store URL points to that cannot be reached) prints one line and exits 1.
    Anything else is a bug and keeps its traceback.
    """
    from pydantic import ValidationError
    from sqlalchemy.exc import OperationalError

    from forgeflow.common.errors import InfraError, InputError

    def one_line(exc: BaseException, status: int) -> SystemExit:
        lines = str(exc).splitlines()
        text = " ".join(lines[:3]) if isinstance(exc, ValidationError) else (lines[0] if lines else "")
        Console(stderr=True).print(f"[red]error:[/red] {type(exc).__name__}: {text}", highlight=False, soft_wrap=True)
        return SystemExit(status)

    try:
        app()
    except (InfraError, OperationalError, ConnectionError) as exc:
        raise one_line(exc, 1) from None
    except (InputError, ValidationError, UnicodeDecodeError, OSError) as exc:
        # a path that is a folder, missing, unreadable or not UTF-8 text, or a file of the wrong kind
        raise one_line(exc, 2) from None


if __name__ == "__main__":
    main()
