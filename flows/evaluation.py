"""Evaluation flows a user launches on their own inputs: Harbor export and import, and the answer judge.

* ``harbor-export`` (:func:`harbor_export`): one split of a recorded freeze written as a Harbor
  dataset folder (``harbor run -p <path>``), tests from the store, patch / image / test command
  from the task rows (the candidates JSONL, a HF split or the lifecycle's generated file).
* ``harbor-import`` (:func:`harbor_import`): a Harbor job folder's trial results recorded in the
  store as one job; with the freeze it ran, the job pairs with canary or other Harbor jobs of the
  same frozen split in ``compare`` / ``forgeflow compare``, and ``forgeflow trials --job`` lists it.
* ``judge`` (:func:`judge`): GAIA-style question/answer rows judged by normalised matching into the
  store's ``judgments`` table.

The store and file I/O happens in the tasks of :mod:`tasks.evaluation`; the flows check their
parameters, call them and publish an artifact.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.curation.freeze import validate_freeze_name
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.task_rows import DatasetSource, TestSpec
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


@flow(name="harbor-export", log_prints=True)
def harbor_export(freeze_name: str, split: str = "test", out_dir: Path | None = None,
                  limits: HarborTaskLimits = HarborTaskLimits(), candidates_path: Path | None = None,
                  generated_path: Path | None = None, dataset: DatasetSource | None = None,
                  test_commands: dict[str, str] | None = None,
                  test_specs: dict[str, TestSpec] | None = None) -> HarborExport:
    """Export ``split`` of freeze ``freeze_name`` as a Harbor dataset folder (one task folder per instance).

    Args:
        freeze_name: a freeze recorded in the store (``freeze`` flow or the lifecycle).
        split: ``train``, ``validation`` or ``test`` (a split of that freeze).
        out_dir: the dataset folder to create (default ``$FORGEFLOW_HOME/harbor/<freeze>-<split>``); the
            same export again is a no-op, a different one is refused.
        limits: timeouts (seconds) and resources written to every ``task.toml``.
        candidates_path: the user's candidates JSONL (patch, image, problem statement, test command).
        generated_path: a generated-candidates file (default ``$FORGEFLOW_HOME/demo/candidates.jsonl``).
        dataset: the rows as a HF ``datasets`` split instead of a file.
        test_commands: repo -> test command for repositories that are not pinned projects.
        test_specs: repo -> test command and log parser (only pytest's can be exported).

    Returns:
        The :class:`~forgeflow.evaluation.harbor.HarborExport` (path, instance ids, digests).

    Raises:
        InputError: an invalid or unrecorded freeze, an unknown or empty split, unreadable task rows,
            an ``out_dir`` holding something else.
        PreflightError: tasks that cannot be exported (no row, not accepted, no image, a non-pytest
            log parser), every one listed, before anything is written.
    """
    validate_freeze_name(freeze_name)
    target = Path(out_dir) if out_dir is not None else home_dir() / "harbor" / f"{freeze_name}-{split}"
    manifest_path, export_tasks = evaluation_tasks.harbor_export_inputs(
        freeze_name, split, candidates_path, generated_path, home_dir() / "demo" / GENERATED_FILE, dataset,
        test_commands, test_specs)
    export = evaluation_tasks.write_harbor_export(manifest_path, split, export_tasks, target, limits)
    image_of = {t.instance_id: t.image_ref for t in export_tasks}
    rows = "\n".join(f"| `{iid}` | `{image_of[iid]}` |" for iid in export.instance_ids)
    markdown_artifact(EXPORT_ARTIFACT_KEY, (
        f"# Harbor export of {freeze_name}/{split}\n\n"
        f"{len(export.instance_ids)} task(s) in `{export.path}` (export sha256 `{export.semantic_sha256[:16]}`, "
        f"freeze sha256 `{export.freeze_semantic_sha256[:16]}`).\n\n| task | image |\n|---|---|\n{rows}\n\n"
        f"Run: `harbor run -p {export.path} -a oracle -e {HARBOR_ENV_IMPORT_PATH} -o JOBS --job-name J`, then the "
        "`harbor-import` deployment with `job_dir=JOBS/J`.\n"), f"Harbor export of {freeze_name}/{split}")
    get_run_logger().info("harbor-export %s/%s: %d task(s) in %s", freeze_name, split, len(export.instance_ids),
                          export.path)
    return export


@flow(name="harbor-import", log_prints=True)
def harbor_import(job_dir: Path, job_id: str | None = None, freeze_name: str | None = None,
                  split: str = "test") -> HarborImportSummary:
    """Record a Harbor job folder's trial results in the store as one job.

    Args:
        job_dir: ``<jobs dir>/<job name>`` as ``harbor run -o <jobs dir> --job-name <job name>`` wrote it.
        job_id: the job id the trials get (default ``harbor-<Harbor's job UUID>``).
        freeze_name: the freeze whose split the job ran (the export's); checked, every trial's task must
            be in the split, and a ``jobs`` row names it so ``compare`` pairs the job with others of the
            same frozen split. None: only the trials are recorded.
        split: the split of ``freeze_name``.

    Returns:
        :class:`~forgeflow.evaluation.harbor_import.HarborImportSummary` (trials, scored, reward 1,
        exceptions by forgeflow type, unfinished trial folders).

    Raises:
        InputError: ``job_dir`` missing or not a Harbor job folder, an invalid or unrecorded freeze, an
            unknown split, a bad trial result (file and field named), a trial outside the split.
    """
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        raise InputError(f"harbor-import: job_dir {job_dir} does not exist (give <jobs dir>/<job name>)")
    if freeze_name is not None:
        validate_freeze_name(freeze_name)
    if job_id is not None and not job_id.strip():
        raise InputError("harbor-import: job_id is empty (None: harbor-<Harbor's job UUID>)")
    summary = evaluation_tasks.import_harbor(job_dir, job_id, freeze_name, split, _run_id())
    trials = evaluation_tasks.job_trial_rows(summary.job_id)
    table_artifact(IMPORT_ARTIFACT_KEY, trials, f"Harbor job {job_dir} imported as {summary.job_id}: "
                   f"{summary.scored}/{summary.trials} scored, reward 1: {summary.reward_1}")
    get_run_logger().info("harbor-import %s: %d trial(s), %d scored, reward 1: %d, exceptions %s, unfinished %d",
                          summary.job_id, summary.trials, summary.scored, summary.reward_1,
                          summary.exceptions or "none", len(summary.unfinished))
    return summary


@flow(name="judge", log_prints=True)
def judge(path: Path, job_id: str | None = None, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> JudgeSummary:
    """Judge a file of GAIA-style answers and record the verdicts in the store's ``judgments`` table.

    Args:
        path: a JSONL file (or parquet / CSV, read with HF ``datasets``) of rows ``{question_id, answer,
            reference}`` (:func:`forgeflow.evaluation.judge.load_answer_rows`).
        job_id: the evaluation job the judgments belong to (default ``judge-<file sha256[:12]>``: the
            same file again updates its rows).
        rel_tol: relative tolerance for numeric references (``math.isclose``).
        abs_tol: absolute tolerance for numeric references.

    Returns:
        :class:`~forgeflow.evaluation.judge.JudgeSummary` (judged, correct, incorrect, rows per rule).

    Raises:
        InputError: a negative tolerance, an empty job id, no file at ``path``, a bad row (its line and
            field named): nothing is recorded.
    """
    if rel_tol < 0 or abs_tol < 0:
        raise InputError(f"judge: tolerances must be >= 0, got rel_tol={rel_tol}, abs_tol={abs_tol}")
    if job_id is not None and not job_id.strip():
        raise InputError("judge: job_id is empty (None: judge-<file sha256[:12]>)")
    path = Path(path)
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
