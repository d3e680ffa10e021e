"""The commands that read the store: ``trials``, ``compare``, ``lineage``, ``status``, ``freeze verify``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from deployments.cli.app import app, console, fail, freeze_app, prepare_env, read_store
from forgeflow.ledger.store import Store


@freeze_app.command("verify", short_help="Recompute a freeze's three digests and check its bundle loads.")
def freeze_verify(name: str, freezes_dir: Optional[Path] = typer.Option(
        None, help="the folder holding NAME.json and its bundle; default the folder of the manifest the store "
        "recorded (the freeze flow's $FORGEFLOW_HOME/freezes, the demo's $FORGEFLOW_HOME/demo/freezes), else "
        "$FORGEFLOW_HOME/demo/freezes")) -> None:
    """Check a freeze's three digests: the manifest's semantic sha256 (recomputed from its content),
    the manifest file's sha256 and the export bundle tarball's sha256 (both against the store's
    record), and that the bundle's DatasetDict loads with the manifest's splits and ids. Exits 2
    naming the digest that failed and the file; a freeze made before export bundles verifies with
    its bundle reported absent."""
    home = prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation.bundle import bundle_paths, verify_bundle  # noqa: PLC0415
    from forgeflow.curation.freeze import manifest_path, verify_freeze  # noqa: PLC0415

    try:
        store = read_store()
        recorded = store.get_freeze(name)
        folder = freezes_dir or (Path(recorded.manifest_path).parent if recorded else home / "demo" / "freezes")
        path = manifest_path(name, folder)
        manifest = verify_freeze(path, expected_file_sha256=recorded.file_sha256 if recorded else None)
    except ForgeflowError as exc:
        fail(exc)
    problems = []
    if manifest.name != name:
        problems.append(f"the manifest at {path} is freeze {manifest.name!r}, not {name!r}")
    if recorded is not None and recorded.semantic_sha256 != manifest.semantic_sha256:
        problems.append(f"semantic sha256 of {path}: {manifest.semantic_sha256} differs from the store's "
                        f"{recorded.semantic_sha256}")
    if problems:
        fail("; ".join(problems))
    try:
        bundle = verify_bundle(manifest, recorded.bundle_sha256 if recorded else None, folder)
    except ForgeflowError as exc:
        fail(exc)
    where = "matches the store" if recorded is not None else f"not recorded in the store {store.display_url}"
    if bundle is not None:
        bundle_text = f"bundle sha256 {bundle.sha256} ({bundle.tarball}; splits {bundle.counts})"
    else:
        bundle_text = (f"bundle absent (no {bundle_paths(name, folder)[2]}, none recorded: the freeze was "
                       "made before export bundles)")
    console.print(f"freeze {manifest.name}: OK ({where}); semantic sha256 {manifest.semantic_sha256}, "
                  f"file sha256 {manifest.file_sha256}, {bundle_text}", soft_wrap=True, highlight=False)


def _tampering(verifier: dict | None) -> list[str] | None:
    """The protected paths a tampering submission changed (None when it did not tamper)."""
    screening = (verifier or {}).get("submission") or {}
    return sorted(screening.get("protected_paths", {})) if screening.get("tampering") else None


TRIALS_PAGE_DEFAULT = 50
"""Trials ``forgeflow trials --job`` shows unless ``--limit`` says otherwise (the rest: ``--offset``)."""

def unknown_job(store: "Store", job: str) -> str:
    """The message for a job id with no live trials in ``store`` (:meth:`Store.unknown_job_message`)."""
    return store.unknown_job_message(job)


@app.command(short_help="A job's trials (reward or exception, flags), a page at a time; no --job: the jobs.")
def trials(job: Optional[str] = typer.Option(None, help="job id (omit to list the jobs in the store)"),
           merged: bool = typer.Option(False, "--merged", help="the job merged with its recovery jobs: prints "
                                       "{view, job_id, recovery_job_ids, trials} (the view says "
                                       "'original job + N recovery jobs')"),
           as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
           limit: int = typer.Option(TRIALS_PAGE_DEFAULT, min=1, help="with --job: most trials shown, oldest first "
                                     "(how many more there are is said after them)"),
           offset: int = typer.Option(0, min=0, help="with --job: trials to skip first (the next page: the "
                                      "offset the output names)")) -> None:
    """Each trial's outcome (reward or exception type; flagged when an agent timeout, dead loop or
    hang kept the verifier's reward beside the exception; the protected paths of a tampering
    submission; with --json the verifier's evidence) of a job recorded in the store, a page at a time
    (--limit, --offset), after the job's counts per verdict and per repository. Without --job: the jobs
    and their trials per verdict (with --json: {job: trials})."""
    prepare_env(create=False)
    from forgeflow.common.errors import SCORED_DESPITE_EXCEPTION, InputError  # noqa: PLC0415

    if job is not None and not job.strip():
        fail("--job is empty: give a job id (omit --job to list the jobs in the store)")
    if merged and job is None:
        fail("--merged needs --job JOB (the job to merge with its recovery jobs)")
    store = read_store()
    if job is None:
        summaries = store.job_summaries()
        if as_json:
            console.print_json(json.dumps({s.job_id or "-": s.trials for s in summaries}))
        else:
            for s in summaries:
                console.print(f"{s.job_id or '-'}\t{s.trials} trials (reward 1: {s.reward_1}, reward 0: {s.reward_0}, "
                              f"exceptions: {s.exceptions})", highlight=False, soft_wrap=True)
        return
    if not store.has_trials(job):
        fail(unknown_job(store, job))
    try:
        if merged:  # the compare package (statistics) is imported only here: 1.3 s
            from forgeflow.evaluation.compare import merged_job  # noqa: PLC0415

            view = merged_job(store, job)
            total, rows = len(view.trials), view.trials[offset:offset + limit]
        else:  # any job, validation (nop/oracle) jobs too: the merged view takes agent jobs only
            total, rows = store.job_verdict_counts(job).trials, store.job_trial_page(job, limit=limit, offset=offset)
    except InputError as exc:
        fail(exc)
    events = {e.trial_id: e for e in store.supervision_events(trial_ids=[t.trial_id for t in rows])}
    out = [{"trial_id": t.trial_id, "instance_id": t.instance_id, "kind": t.kind, "job_id": t.job_id,
            "reward": t.reward, "exception_type": t.exception_type, "exception_message": t.exception_message,
            "flagged": t.exception_type in SCORED_DESPITE_EXCEPTION and t.reward is not None,
            "supervision": events[t.trial_id].kind if t.trial_id in events else None,
            "agent_steps": t.agent_steps, "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
            "timings": t.timings, "tampering": _tampering(t.verifier), "verifier": t.verifier}
           for t in rows]
    remaining = max(0, total - offset - len(rows))
    more = (f"{remaining} more trial(s) after these (of {total}): --offset {offset + len(rows)}" if remaining
            else None)
    if as_json:
        body: object = out
        if merged:
            body = {"view": view.label, "job_id": view.job_id, "recovery_job_ids": view.recovery_job_ids,
                    "from_recovery": view.from_recovery, "trials": out}
        print(json.dumps(body, indent=2))
        if more:
            typer.echo(more, err=True)
        return
    counts = store.job_verdict_counts(job)
    repos = store.job_repository_counts(job)
    console.print(f"job {job}: {counts.trials} trials (reward 1: {counts.reward_1}, reward 0: {counts.reward_0}, "
                  f"exceptions: {counts.exceptions}); per repository: "
                  + ", ".join(f"{repo} {n}" for repo, n in repos.items()), highlight=False, soft_wrap=True)
    shown = f"{offset + 1}-{offset + len(rows)} of {total}" if rows else f"none of {total} (offset {offset})"
    table = Table(title=f"trials of {view.label if merged else 'job ' + job}: {shown}")
    for col in ("instance_id", "job", "kind", "reward", "exception"):
        table.add_column(col)
    for t in out:
        exc = (t["exception_type"] or "") + (" (flagged: reward kept)" if t["flagged"] else "")
        if t["tampering"]:
            exc = f"tampering: {', '.join(t['tampering'])}"
        table.add_row(t["instance_id"], t["job_id"] or "", t["kind"], "" if t["reward"] is None else f"{t['reward']:g}",
                      exc)
    console.print(table)
    if more:
        console.print(more, highlight=False, soft_wrap=True)


@app.command(short_help="Paired comparison of two jobs on one frozen split and the promotion verdict.")
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
            max_exception_rate: float = typer.Option(
                0.2, help="promotion gate: largest fraction of a job's trials excluded as exceptions (or missing); "
                "a job above it is unusable: not compared, the gate holds"),
            ) -> None:
    """Paired comparison of two jobs on the same frozen split: wins/ties/losses, exact McNemar p, the
    delta interval (Newcombe's paired interval united with the repository-clustered bootstrap),
    excluded tasks with reasons, each job's trials excluded as exceptions per type with the rate (JSON:
    ``exclusions``), cost ratios and the promotion gate's verdict and reason (JSON: ``promotion``). A job
    whose excluded fraction is above --max-exception-rate is marked unusable (job, rate, limit named) and the
    gate holds. Each job is merged with its recovery jobs (said in the output) unless --no-recovery; a
    re-scored job (``forgeflow rescore``) is compared by its own id like any other."""
    prepare_env(create=False)
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.evaluation import compare as comparison
    from forgeflow.evaluation.compare.gate import GatePolicy  # noqa: PLC0415

    store = read_store()
    for job in (job_a, job_b):  # an unknown id is answered from the index, before any trial is read
        if not store.has_trials(job):
            fail(unknown_job(store, job))
    try:
        gate = GatePolicy.build(max_drop=max_drop, alpha=alpha, min_pairs=min_pairs, min_repos=min_repos,
                                           max_wall_s_ratio=max_wall_ratio, max_input_tokens_ratio=max_tokens_ratio,
                                           max_agent_steps_ratio=max_steps_ratio,
                                           max_exception_rate=max_exception_rate)
        result = comparison.compare_stored_jobs(store, job_a, job_b, merge_recovery=not no_recovery, gate=gate)
    except InputError as exc:
        fail(exc)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    print(result.markdown)


@app.command(short_help="Chains from the base model to an artifact, the runs that made them, who served it.")
def lineage(artifact_sha256: str, as_json: bool = typer.Option(False, "--json", help="print JSON: {artifact_sha256, "
                                     "chain (the newest), chains (one per distinct set of producing parents), "
                                     "serving_generations, warnings}"),
            verify: bool = typer.Option(True, "--verify/--no-verify", help="digest each recorded path and say "
                                        "when it is gone or now holds other content")) -> None:
    """Every chain from the base model to ARTIFACT_SHA256 (a GGUF, adapter or model: base -> adapter ->
    merged -> GGUF), the runs that recorded each step, and the serving generations that served it,
    from the store. An artifact made by several producers shows one chain each, newest first.

    A GGUF packaged from an image-text-to-text checkpoint shows its vision projector (mmproj) on the
    line below it: the projector's sha256 and path, the file it must be served with."""
    prepare_env(create=False)
    store = read_store()
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.packaging.lineage import lineage_of  # noqa: PLC0415

    try:
        report = lineage_of(store, artifact_sha256, verify_paths=verify)
    except InputError as exc:
        fail(exc)
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
            trained = step.lineage
            if trained.get("dataset_sha256"):  # an adapter: what it was trained on, and how
                how = "/".join(str(trained[k]) for k in ("algorithm", "device", "dtype") if trained.get(k))
                console.print(f"{'':>17}dataset {trained['dataset_sha256'][:16]}  ({how})", highlight=False,
                              soft_wrap=True)
            if trained.get("mmproj_sha256"):  # a GGUF packaged with a vision projector: served beside it
                console.print(f"{'':>17}projector {trained['mmproj_sha256'][:16]}  {trained.get('mmproj_path', '')}",
                              highlight=False, soft_wrap=True)
    for g in report.serving_generations:
        console.print(f"  served as generation {g.generation} on port {g.port} ({g.status})")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)


@app.command(short_help="The last lifecycle run, store counts, latest freeze, serving endpoint and service.")
def status(as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of text: "
                                         "{schema_version, home, store, counts, last_lifecycle, last_freeze, "
                                         "serving, service} (the last four null when there is none)")) -> None:
    """The last lifecycle run's stages, the store's counts, the latest freeze, the serving endpoint,
    and what `forgeflow up` started (server address, pool, deployments, whether its processes run)."""
    home = prepare_env(create=False)
    store = read_store()
    found = [home / folder / "summary.json" for folder in DEMO_FOLDERS if (home / folder / "summary.json").is_file()]
    summary_path = max(found, key=lambda p: p.stat().st_mtime) if found else None  # the last demo profile run
    summary = json.loads(summary_path.read_text()) if summary_path is not None else None
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


DEMO_FOLDERS = ("demo", "demo-tiny-vl")
"""The results folders of ``forgeflow demo``'s profiles under ``$FORGEFLOW_HOME`` (text, then ``--base-model
tiny-vl``); ``status`` shows the newer summary."""

SERVING_STATE_FILES = (Path("serving") / "state.json",
                       *(Path(folder) / "serving" / "state.json" for folder in DEMO_FOLDERS))
"""The serving state files ``status`` and ``down`` know, under ``$FORGEFLOW_HOME``: the ``serve`` flow's (and
the ``canary`` flow's) default, and each demo profile's lifecycle's."""


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
            return {**out, "live": state.live, "state_path": str(home / relative)}
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
