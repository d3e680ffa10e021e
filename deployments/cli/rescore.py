"""``forgeflow rescore JOB``: a canary job's stored submissions re-verified under the current verifier, without
re-running the model (the ``rescore`` flow), or with ``--dry-run`` what would be (reads only, no Prefect)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from deployments.cli.app import app, console, fail, prepare_env


def _store(dry_run: bool) -> object:
    """The store, opened without writing: a missing one exits 2; one at an older schema is left to the flow
    (it migrates) unless this is a dry run, which never writes (exit 2 saying how to migrate)."""
    from forgeflow.common.errors import InfraError, StoreInvalidError, StoreNotFoundError  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415

    try:
        return Store(create=False)
    except StoreNotFoundError as exc:
        fail(exc)
    except StoreInvalidError as exc:
        if dry_run or "older than" not in str(exc):
            fail(exc)
    except InfraError as exc:
        fail(exc, status=1)
    return None


def _plan_lines(plan: object) -> list[str]:
    """``--dry-run``'s text: the view, the new job's id, and per task what the re-score does and why."""
    counts = plan.counts()
    lines = [f"rescore of {plan.merged_label} as job {plan.rescore_job_id} (verifier {plan.verifier_sha256[:12]}): "
             f"{counts['reverify']} to re-verify, {counts['carried']} carried over, {counts['missing']} missing"]
    for item in plan.items:
        how = f"re-verify ({item.source})" if item.action == "reverify" else f"{item.action}: {item.reason}"
        lines.append(f"  {item.original.instance_id}\t{item.original.trial_id}\t{how}")
    return lines


@app.command(short_help="Re-verify a canary job's stored submissions under the current verifier, as a new job.")
def rescore(
    job: str = typer.Argument(..., help="the canary job to re-score (`forgeflow trials` lists the jobs)"),
    rescore_job_id: Optional[str] = typer.Option(None, help="the new job's id (default <JOB>-rescore-<digest of the "
                                                 "standing trials and the verifier source>)"),
    verifier_timeout_s: Optional[float] = typer.Option(None, min=0.001, help="limit of one test run, seconds "
                                                       "(default: the job's)"),
    concurrency: int = typer.Option(1, min=1, max=10, help="verifier sandboxes at once"),
    generated_path: Optional[Path] = typer.Option(None, help="the task-rows file (default: the job's source)"),
    out_dir: Optional[Path] = typer.Option(None, help="folder for <new job>/report.md (default "
                                           "$FORGEFLOW_HOME/canary)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be re-verified, carried over or "
                                 "missing; reads only, starts nothing"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Re-verify every stored submission of canary job JOB (with its recovery jobs merged in) under the current
    verifier, without re-running the model, as a new job (kind ``rescore``) linked to JOB; JOB's rows are never
    rewritten. Each submission comes from its trial row, else its trajectory file; a trial whose agent made none
    keeps its exception, and a lost submission is recorded as SubmissionMissingError (never reward 0). Prints the
    verdicts that changed and the new job's id, which `forgeflow compare` and the `promote` flow take like any
    job. An unknown JOB exits 2 naming the canary jobs the store has."""
    prepare_env(create=not dry_run)
    from pydantic import ValidationError  # noqa: PLC0415

    from flows.rescore import RescoreParams  # noqa: PLC0415
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.common.settings import home_dir  # noqa: PLC0415
    from forgeflow.curation.generated import GENERATED_FILE  # noqa: PLC0415
    from forgeflow.evaluation.rescore import check_rescorable, plan_rescore  # noqa: PLC0415

    if not job.strip():
        fail("JOB is empty: give a canary job id (`forgeflow trials` lists the jobs)")
    try:  # the flow's own parameter model checks the options, with or without --dry-run
        params = RescoreParams(job_id=job, rescore_job_id=rescore_job_id, concurrency=concurrency,
                               verifier_timeout_s=verifier_timeout_s, generated_path=generated_path, out_dir=out_dir)
    except ValidationError as exc:
        fail("; ".join(f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']}" for e in exc.errors()))
    store = _store(dry_run)
    if store is not None:
        try:
            check_rescorable(store, job)
            if dry_run:
                plan = plan_rescore(store, job, home_dir() / "demo" / GENERATED_FILE,
                                    rescore_job_id=params.rescore_job_id, verifier_timeout_s=params.verifier_timeout_s,
                                    generated_path=params.generated_path)
        except ForgeflowError as exc:
            fail(exc)
        finally:
            store.dispose()
    if dry_run:
        if as_json:
            print(json.dumps({"dry_run": True, "job_id": plan.rescore_job_id, "view": plan.merged_label,
                              "counts": plan.counts(), "items": [
                                  {"instance_id": i.original.instance_id, "trial_id": i.original.trial_id,
                                   "action": i.action, "source": i.source, "reason": i.reason} for i in plan.items]},
                             indent=2))
            return
        console.print("\n".join(_plan_lines(plan)), highlight=False, soft_wrap=True)
        console.print("dry run: nothing ran or changed")
        return
    from flows.rescore import rescore as rescore_flow  # noqa: PLC0415

    try:
        out = rescore_flow(params)
    except ForgeflowError as exc:
        fail(exc)
    if as_json:
        print(out.model_dump_json(indent=2))
        return
    counts = out.counts
    console.print(f"rescore {out.job_id} of {out.view}: {counts['reverify']} re-verified, {counts['carried']} "
                  f"carried over, {counts['missing']} missing; {counts['changed']} verdict(s) changed; scored "
                  f"{out.report.scored}/{out.report.requested} (was {out.original_report.scored}/"
                  f"{out.original_report.requested}); report {out.report_path}", highlight=False, soft_wrap=True)
    for change in out.changed:
        console.print(f"  changed {change.instance_id}: {change.old_exception or change.old_reward} -> "
                      f"{change.new_exception or change.new_reward} ({change.why})", highlight=False, soft_wrap=True)
