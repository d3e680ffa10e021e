"""Evaluation flows on a user's own inputs: ``harbor-export``, ``harbor-import`` and the answer ``judge``.

An imported Harbor job with its freeze pairs with canary jobs of the same split in ``compare``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows.stagekit import StageParams
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.curation.freeze import FreezeName
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.task_rows import TaskSource
from forgeflow.evaluation.harbor import HARBOR_ENV_IMPORT_PATH, HarborExport, HarborTaskLimits
from forgeflow.evaluation.harbor_import import HarborImportSummary
from forgeflow.evaluation.judge import JudgeSummary
from tasks import evaluation as evaluation_tasks
from tasks.common import markdown_artifact, table_artifact

EXPORT_ARTIFACT_KEY = "harbor-export"
IMPORT_ARTIFACT_KEY = "harbor-import"
JUDGE_ARTIFACT_KEY = "judge-results"


def _run_id() -> str | None:
    return str(flow_run.get_id() or "")[:64] or None


class HarborExportParams(StageParams):
    """The ``harbor-export`` flow's parameters."""

    freeze_name: FreezeName = Field("demo-v1", description="a freeze recorded in the store")
    split: str = Field("test", description="the split of that freeze: train, validation or test")
    out_dir: Path | None = Field(None, description="the dataset folder to create; None: "
                                                   "$FORGEFLOW_HOME/harbor/<freeze>-<split>")
    limits: HarborTaskLimits = Field(HarborTaskLimits(), description="timeouts (seconds), memory (MB) and CPUs "
                                                                     "written to every task.toml")
    source: TaskSource = Field(TaskSource(), description="the task rows (patch, image, problem statement, test "
                               "command): candidates_path, dataset or generated_path (default "
                               "$FORGEFLOW_HOME/demo/candidates.jsonl), test_commands and test_specs (pytest's log "
                               "parser only) per repository; images: the image each Dockerfile is FROM")


@flow(name="harbor-export", log_prints=True)
def harbor_export(params: HarborExportParams = HarborExportParams()) -> HarborExport:
    """Export ``params.split`` of freeze ``params.freeze_name`` as a Harbor dataset folder (``harbor run -p``).

    Args:
        params: the freeze split to export, the output folder, the task limits and the task rows' source.

    Raises:
        InputError: an invalid or unrecorded freeze, an unknown or empty split, unreadable task rows,
            a ``params.out_dir`` holding something else.
        PreflightError: tasks that cannot be exported (each listed), before anything is written.
    """
    freeze_name, split = params.freeze_name, params.split
    target = Path(params.out_dir) if params.out_dir is not None else home_dir() / "harbor" / f"{freeze_name}-{split}"
    manifest_path, export_tasks = evaluation_tasks.harbor_export_inputs(
        freeze_name, split, params.source, home_dir() / "demo" / GENERATED_FILE)
    export = evaluation_tasks.write_harbor_export(manifest_path, split, export_tasks, target, params.limits)
    image_of = {t.instance_id: t.image_ref for t in export_tasks}
    rows = "\n".join(f"| `{iid}` | `{image_of[iid]}` |" for iid in export.instance_ids)
    markdown_artifact(EXPORT_ARTIFACT_KEY, (
        f"# Harbor export of {freeze_name}/{split}\n\n"
        f"{len(export.instance_ids)} task(s) in `{export.path}` (export sha256 `{export.semantic_sha256[:16]}`, "
        f"freeze sha256 `{export.freeze_semantic_sha256[:16]}`).\n\n| task | image |\n|---|---|\n{rows}\n\n"
        f"Run: `harbor run -p {export.path} -a oracle -e {HARBOR_ENV_IMPORT_PATH} -o JOBS --job-name J`, then the "
        "`harbor-import` deployment with `params.job_dir=JOBS/J`.\n"), f"Harbor export of {freeze_name}/{split}")
    get_run_logger().info("harbor-export %s/%s: %d task(s) in %s", freeze_name, split, len(export.instance_ids),
                          export.path)
    return export


class HarborImportParams(StageParams):
    """The ``harbor-import`` flow's parameters."""

    job_dir: Path = Field(description="the Harbor job folder <jobs dir>/<job name>")
    job_id: str | None = Field(None, description="the job id the trials get; None: harbor-<Harbor's job UUID>")
    freeze_name: FreezeName | None = Field(None, description="the freeze whose split the job ran (checked; pairs "
                                                             "the job in compare); None: only the trials are recorded")
    split: str = Field("test", description="the split of freeze_name: train, validation or test")


@flow(name="harbor-import", log_prints=True)
def harbor_import(params: HarborImportParams) -> HarborImportSummary:
    """Record a Harbor job folder's trial results in the store as one job.

    Args:
        params: the Harbor job folder to import, the job id to record it under, its freeze and split.

    Raises:
        InputError: not a Harbor job folder, a bad freeze or split, a bad trial result (named), a trial outside the
            split.
    """
    job_dir, job_id, freeze_name = Path(params.job_dir), params.job_id, params.freeze_name
    if job_id is not None and not job_id.strip():
        raise InputError("harbor-import: params.job_id is empty (None: harbor-<Harbor's job UUID>)")
    summary = evaluation_tasks.import_harbor(job_dir, job_id, freeze_name, params.split, _run_id())
    trials = evaluation_tasks.job_trial_rows(summary.job_id)
    table_artifact(IMPORT_ARTIFACT_KEY, trials, f"Harbor job {job_dir} imported as {summary.job_id}: "
                   f"{summary.scored}/{summary.trials} scored, reward 1: {summary.reward_1}")
    get_run_logger().info("harbor-import %s: %d trial(s), %d scored, reward 1: %d, exceptions %s, unfinished %d",
                          summary.job_id, summary.trials, summary.scored, summary.reward_1,
                          summary.exceptions or "none", len(summary.unfinished))
    return summary


class JudgeParams(StageParams):
    """The ``judge`` flow's parameters."""

    path: Path = Field(description="the answers file: JSONL (or parquet / CSV) rows {question_id, answer, reference}")
    job_id: str | None = Field(None, description="the evaluation job id; None: judge-<file sha256[:12]>")
    rel_tol: float = Field(1e-6, description="relative tolerance for numeric references (a fraction, >= 0)")
    abs_tol: float = Field(1e-9, description="absolute tolerance for numeric references (the reference's units, "
                                             ">= 0)")


@flow(name="judge", log_prints=True)
def judge(params: JudgeParams) -> JudgeSummary:
    """Judge a file of GAIA-style answers and record the verdicts in the store's ``judgments`` table.

    Args:
        params: the answers file to judge, the job id for its verdicts and the numeric tolerances.

    Raises:
        InputError: a negative tolerance, an empty job id, no file, a bad row (line and field named).
    """
    rel_tol, abs_tol, job_id = params.rel_tol, params.abs_tol, params.job_id
    if rel_tol < 0 or abs_tol < 0:
        raise InputError(f"judge: tolerances must be >= 0, got params.rel_tol={rel_tol}, params.abs_tol={abs_tol}")
    if job_id is not None and not job_id.strip():
        raise InputError("judge: params.job_id is empty (None: judge-<file sha256[:12]>)")
    path = Path(params.path)
    items, file_sha256 = evaluation_tasks.read_answers(path)
    job = job_id or f"judge-{file_sha256[:12]}"
    recorded = evaluation_tasks.record_judgments(items, job, rel_tol, abs_tol, _run_id())
    summary = JudgeSummary.of(job, path, recorded)
    table_artifact(JUDGE_ARTIFACT_KEY, [
        {"question_id": r.question_id, "answer": r.answer, "reference": r.reference, "correct": r.correct,
         "rule": r.rule, "normalized_answer": r.normalized_answer, "normalized_reference": r.normalized_reference}
        for r in recorded], f"judge {job}: {summary.correct}/{summary.judged} correct ({path})")
    get_run_logger().info("judge %s: %d/%d correct, rules %s", job, summary.correct, summary.judged, summary.rules)
    return summary
