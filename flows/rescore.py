"""The ``rescore`` flow: a canary job's stored submissions re-verified under the current verifier."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows.stagekit import StageLog, StageParams
from forgeflow.common import settings
from forgeflow.common.settings import apply_container_env, home_dir
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.evaluation.compare import JobReport, job_exclusions
from forgeflow.evaluation.rescore import VerdictChange
from forgeflow.evaluation.rescore_report import RescoreResult, change_rows, render_rescore_report
from forgeflow.sandbox.limits import VerifierTimeoutS
from tasks import evaluation as evaluation_tasks
from tasks import rescore as rescore_tasks
from tasks.common import record_rows, table_artifact, upgrade_store

REPORT_ARTIFACT_KEY = "rescore-report"
VERDICTS_ARTIFACT_KEY = "rescore-verdicts"


class RescoreParams(StageParams):
    """The ``rescore`` flow's parameters: the job to re-score, the new job's id and the verifier's timeout
    (:func:`forgeflow.evaluation.rescore.plan_rescore` takes them), and how to run it."""

    job_id: str = Field(min_length=1, description="the canary job to re-score (forgeflow trials lists the jobs)")
    rescore_job_id: str | None = Field(default=None, min_length=1, max_length=512, description="the new job's id; "
                                       "None: <job_id>-rescore-<digest of the standing trials and the verifier source>")
    verifier_timeout_s: VerifierTimeoutS | None = Field(default=None, description="limit of one test run, seconds; "
                                                        "None: the job's recorded one (180 s when none)")
    generated_path: Path | None = Field(default=None, description="the task-rows file; None: the job's recorded "
                                        "source, else $FORGEFLOW_HOME/demo/candidates.jsonl")
    concurrency: int = Field(1, ge=1, le=10, description="verifier sandboxes at once (1 to 10)")
    out_dir: Path | None = Field(None, description="folder for <rescore job id>/report.md and summary.json; None: "
                                                   "$FORGEFLOW_HOME/canary")


@flow(name="rescore", log_prints=True)
def rescore(params: RescoreParams) -> RescoreResult:
    """Re-verify every stored submission of canary job ``params.job_id`` under the current verifier, as a new job.

    Each standing trial's submission (its row, else its trajectory) is re-verified in a fresh sandbox of the
    pristine image with the job's recorded limits. A lost submission is ``SubmissionMissingError``, never
    reward 0. The new job (kind ``rescore``, ``parent_job_id`` the original) is recorded; the original's
    rows are never rewritten.

    Args:
        params: the canary job to re-verify, the new job's id, the verifier timeout, concurrency, task rows.

    Raises:
        InputError: an unknown, recovery or non-canary job; a taken re-score id; unreadable task rows.
        PreflightError: a task to re-verify cannot run (listed).
    """
    logger = get_run_logger()
    apply_container_env()
    store_url = settings.store_url()
    upgrade_store(store_url)
    plan = rescore_tasks.plan_rescore(params.job_id, home_dir() / "demo" / GENERATED_FILE,
                                      rescore_job_id=params.rescore_job_id,
                                      verifier_timeout_s=params.verifier_timeout_s,
                                      generated_path=params.generated_path)
    run_id = str(flow_run.get_id() or "")
    new_id = plan.rescore_job_id
    job_dir = Path(params.out_dir or home_dir() / "canary") / new_id
    log = StageLog(job_dir / "summary.json", run_id)
    counts = plan.counts()
    logger.info("rescore %s: %s, %d task(s): %d to re-verify, %d carried over, %d missing, as job %s",
                params.job_id, plan.merged_label, counts["trials"], counts["reverify"], counts["carried"],
                counts["missing"], new_id)
    done = {}
    with log.stage("rescore") as st:
        record_rows(store_url, "jobs", [plan.job_record(run_id)])
        for item, state in log.window(plan.items, lambda item: rescore_tasks.rescore_trial.submit(
                item, plan.agent_config, plan.verifier_timeout_s, new_id, run_id), params.concurrency):
            row = state.result()
            record_rows(store_url, "trials", [row])
            done[item.original.instance_id] = row
        changes = [VerdictChange.of(item, done[item.original.instance_id]) for item in plan.items]
        counts["changed"] = sum(c.changed for c in changes)
        st["counts"] = counts
    report = JobReport.from_trials([done[item.original.instance_id] for item in plan.items])
    original_report = JobReport.from_trials([item.original for item in plan.items])
    markdown = render_rescore_report(plan, report, original_report, changes)
    report_path = evaluation_tasks.write_job_report(markdown, job_dir / "report.md", REPORT_ARTIFACT_KEY,
                                                    f"re-score {new_id} of {params.job_id}")
    table_artifact(VERDICTS_ARTIFACT_KEY, change_rows(changes), f"re-score {new_id} of {params.job_id}: verdicts")
    log.write({"job_id": new_id, "parent_job_id": params.job_id, "counts": counts,
               "report": report.model_dump(mode="json")})
    logger.info("rescore %s: %d verdict(s) changed; scored %d/%d (was %d/%d), exceptions %s", new_id,
                counts["changed"], report.scored, report.requested, original_report.scored,
                original_report.requested, report.exceptions_by_type or "none")
    return RescoreResult(job_id=new_id, parent_job_id=params.job_id, view=plan.merged_label,
                         verifier_sha256=plan.verifier_sha256, counts=counts, report=report,
                         original_report=original_report, exclusions=job_exclusions(report, new_id), changes=changes,
                         report_path=report_path)
