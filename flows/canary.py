"""The ``canary`` flow: agent trials on one split of a recorded freeze against a served model.

The lifecycle's canary stages run this flow as a subflow. Every input is checked before the first trial
(concurrency within the profile's limit: ``default`` 4, ``verified`` 10; the freeze, split, task rows and
images; the endpoint answers). The endpoint comes from the serving state file, or an explicit ``base_url`` +
``model_sha256`` (refused when that file records a live server at ``base_url`` serving another model).

``canary-recover`` re-runs exactly the exception trials of a canary job as a new ``recovery`` job linked by
``parent_job_id``; the original's rows are never rewritten, and the merged view reads "job X + N recovery jobs".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows.stagekit import StageLog, StageParams
from forgeflow.common import settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import apply_container_env, home_dir
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.task_rows import DatasetSource, TaskSource, TestSpec
from forgeflow.evaluation import agent, compare
from forgeflow.evaluation.canary import (
    JOB_KIND,
    RECOVERY_JOB_KIND,
    CanaryTask,
    check_concurrency,
    render_job_report,
)
from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings
from forgeflow.evaluation.canary_result import (
    CanaryRecoveryResult,
    CanaryResult,
    CanaryTrialOutcome,
)
from forgeflow.evaluation.mswea import MODEL_API_KEY_ENV
from forgeflow.ledger import records
from forgeflow.sandbox import dispatch
from tasks import evaluation as evaluation_tasks
from tasks.common import record_rows, sweep_trial_sandboxes, table_artifact, trial_dispatcher
from tasks.curation import sandbox_block

REPORT_ARTIFACT_KEY = "canary-job-report"
RECOVERY_REPORT_ARTIFACT_KEY = "canary-recovery-report"


@dataclass(frozen=True)
class CanaryJobRun:
    """One canary job to run: the job row, its tasks (report order) and how their agent trials run.

    Attributes:
        base_url: the OpenAI-compatible endpoint (``http://127.0.0.1:PORT/v1``); ``model_alias`` the name sent.
        verifier_timeout_s: absolute limit of one test run, seconds.
        run_key: names the trials (default: the job id, so a second job re-measures instead of replaying the
            first one's cached trials); a recovery job passes its own id.
    """

    job: records.JobRecord
    tasks: Sequence[CanaryTask]
    base_url: str
    model_alias: str
    agent_config: agent.AgentConfig
    trajectories_dir: Path
    verifier_timeout_s: float
    concurrency: int
    run_key: str | None = None


def run_canary_job(log: StageLog, stage: str, run: CanaryJobRun) -> tuple[list, compare.JobReport]:
    """Run one canary job as stage ``stage`` of ``log`` (``canary``'s and ``canary-recover``'s).

    Trials run in a sliding window of ``run.concurrency``; each is recorded once, by its own task as it ends,
    in a transaction it may share with trials that ended together (:mod:`forgeflow.ledger.group_commit`). With
    ``run.agent_config.verifier_ray`` the trials run on that Ray cluster.

    Returns:
        The trials (in task order) and their JobReport.

    Raises:
        InputError / InfraError: recording the job or a trial row failed. A trial's own exception is recorded.
    """
    store_url = settings.store_url()
    with log.stage(stage) as st:
        job, tasks, agent_config = run.job, run.tasks, run.agent_config
        record_rows(store_url, "jobs", [job])
        model_sha256 = job.model_sha256

        def submit(t: CanaryTask) -> Any:
            return evaluation_tasks.agent_trial.submit(t, run.base_url, run.model_alias, model_sha256, agent_config,
                                                       run.trajectories_dir, run.verifier_timeout_s, job_id=job.job_id,
                                                       run_key=run.run_key or job.job_id)

        ended = {}
        try:
            for t, state in log.window(tasks, submit, run.concurrency):
                ended[t.instance_id] = state.result()  # recorded by its task (record_agent_trial)
        finally:  # a driver outlived by its Ray cluster is ended by Ray: leave it now
            if agent_config.verifier_ray is not None:
                dispatch.disconnect()
        trials = [ended[t.instance_id] for t in tasks]
        report = compare.JobReport.from_trials(trials)
        table_artifact(stage.replace("_", "-"), [
            {"instance_id": tr.instance_id, "reward": tr.reward, "exception": tr.exception_type,
             "agent_s": tr.agent_s, "verifier_s": tr.verifier_s} for tr in trials],
            f"{stage}: agent trials ({job.job_id})")
        st["counts"] = {"requested": report.requested, "scored": report.scored, "reward_1": report.reward_1,
                        "exceptions": sum(report.exceptions_by_type.values())}
        st["digests"] = {"model": model_sha256}
        return trials, report


def _recovery_agent_config(original: records.JobRecord, given: agent.AgentConfig | None) -> agent.AgentConfig:
    """The agent config the original job recorded, or ``given`` when it recorded none.

    Raises:
        InputError: ``given`` differs from the recorded config, or neither exists.
    """
    recorded = original.params.get("agent_config")
    if recorded is not None:
        config = agent.AgentConfig.model_validate(recorded)
        if given is not None and agent.AgentConfig.model_validate(given) != config:
            raise InputError(f"canary-recover: params.agent_config "
                             f"{agent.AgentConfig.model_validate(given).model_dump()} differs from the one job "
                             f"{original.job_id!r} ran with ({config.model_dump()}): a recovery re-runs the same "
                             "trials; leave params.agent_config out")
        return config
    if given is None:
        raise InputError(f"canary-recover: job {original.job_id!r} records no agent_config (params "
                         f"{sorted(original.params)}); give params.agent_config, the one the job ran with")
    return agent.AgentConfig.model_validate(given)


def _rows_param(own_candidates: bool, from_dataset: bool, source: str) -> dict[str, str]:
    """Where a job's task rows came from, as its params record it (a dataset is recorded whole)."""
    if from_dataset:
        return {}
    return {"candidates_path" if own_candidates else "generated_path": source}


@contextmanager
def _naming(field: str) -> Iterator[None]:
    """For the ``with``: an InputError raised inside names ``params.<field>``, as the user wrote it."""
    try:
        yield
    except InputError as exc:
        raise type(exc)(f"params.{field}: {exc}") from None


@contextmanager
def _model_key(api_key: str | None) -> Iterator[None]:
    """For the ``with``: ``$FORGEFLOW_MODEL_API_KEY`` set to ``api_key`` (restored after); None: unchanged."""
    if api_key is None:
        yield
        return
    previous = os.environ.get(MODEL_API_KEY_ENV)
    os.environ[MODEL_API_KEY_ENV] = api_key
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(MODEL_API_KEY_ENV, None)
        else:
            os.environ[MODEL_API_KEY_ENV] = previous


class CanaryParams(StageParams):
    """The ``canary`` flow's parameters (the canary deployment's defaults are the model's)."""

    freeze_name: str = Field("demo-v1", min_length=1, description="a freeze recorded in the store (freeze flow "
                             "or the lifecycle; the canary-on-freeze automation renders it from the freeze run)")
    split: str = Field("test", min_length=1, description="the freeze's split the trials run on: test, validation "
                                                         "or train (where the freeze has it)")
    endpoint: CanaryEndpoint = Field(CanaryEndpoint(), description="the model endpoint: the serving state file "
                                     "(default $FORGEFLOW_HOME/serving/state.json) or base_url + model_sha256, "
                                     "the model alias sent, the API key's Secret block")
    run: CanaryRunSettings = Field(CanaryRunSettings(), description="how the trials run: concurrency (trials at "
                                   "once, default 1) within the profile's limit (default: up to 4, verified: up to "
                                   "10), agent config, verifier timeout (seconds), a seeded sample of the split")
    source: TaskSource = Field(TaskSource(), description="the task rows: candidates_path, dataset or "
                               "generated_path (default $FORGEFLOW_HOME/demo/candidates.jsonl), test_commands and "
                               "test_specs per repository")
    job_id: str | None = Field(None, min_length=1, description="the job's id; None: canary-<freeze>-<split>-"
                               "<model sha256[:12]> (with -s<sample>x<sample_seed> for a sample)")
    out_dir: Path | None = Field(None, description="folder for <job_id>/report.md, summary.json and trajectories; "
                                                   "None: $FORGEFLOW_HOME/canary")
    sandbox: str | None = Field(None, min_length=1, description="a forgeflow-sandbox block: its backend runs the "
                                "agent's and the verifier's containers, with its memory (MiB) and CPUs where "
                                "run.agent_config leaves them none; None: podman")
    dispatcher: str | None = Field(None, min_length=1, description="a forgeflow-dispatcher block: ray runs each "
                                   "agent trial as a Ray task on a sandbox node; None or in-process: here")


@flow(name="canary", log_prints=True,
      on_cancellation=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")],
      on_crashed=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")])
def canary(params: CanaryParams = CanaryParams()) -> CanaryResult:
    """Agent trials on ``params.split`` of freeze ``params.freeze_name`` against a served model: one canary job.

    Args:
        params: the freeze split the agent runs on, the model endpoint, how the trials run and the task rows.

    Raises:
        InputError: a bad parameter, the field named (``params.run.concurrency``, ...), or a ``base_url`` the
            serving state records serving another model.
        PreflightError: tasks that cannot run (listed), a stopped or silent endpoint.
    """
    freeze_name, split, endpoint, run, source = params.freeze_name, params.split, params.endpoint, params.run, \
        params.source
    job_id, out_dir, sandbox, dispatcher = params.job_id, params.out_dir, params.sandbox, params.dispatcher
    concurrency, profile, sample, sample_seed = run.concurrency, run.profile, run.sample, run.sample_seed
    with _naming("run.concurrency"):
        check_concurrency(concurrency, profile)
    agent_config = run.agent_config.resolved()  # its own limits, else the defaults (no sandbox block)
    if sandbox is not None:  # a missing block or unknown kind: refused before anything runs
        with _naming("sandbox"):
            limits, target = sandbox_block(sandbox)
        agent_config = run.agent_config.resolved(limits).model_copy(  # its own limits, else the block's
            update={"verifier_backend": target.as_backend(), "sandbox_backend": target.as_backend()})
    if dispatcher is not None:  # a missing block: refused before anything runs
        with _naming("dispatcher"):
            ray = trial_dispatcher(dispatcher)
        agent_config = agent_config.model_copy(update={"verifier_ray": ray})
    logger = get_run_logger()
    apply_container_env()
    key = evaluation_tasks.endpoint_api_key(endpoint)
    inputs = evaluation_tasks.canary_inputs(freeze_name, split, sample, sample_seed, source, endpoint,
                                            home_dir() / "demo" / GENERATED_FILE, key)
    tasks, url, sha, alias, sampled = (inputs.tasks, inputs.base_url, inputs.model_sha256, inputs.model_alias,
                                       inputs.sampled)
    job_id = job_id or f"canary-{freeze_name}-{split}-{sha[:12]}" + (f"-s{sample}x{sample_seed}" if sampled else "")
    run_id = str(flow_run.get_id() or "")
    job_dir = Path(out_dir or home_dir() / "canary") / job_id
    job = records.JobRecord(job_id=job_id, kind=JOB_KIND, freeze_name=freeze_name, split=split, model_sha256=sha,
                           run_id=run_id[:64] or None,
                           params={"concurrency": concurrency, "profile": profile, "base_url": url,
                                   "model_alias": alias, "agent_config": agent_config.model_dump(mode="json"),
                                   "verifier_timeout_s": run.verifier_timeout_s,
                                   "trajectories_dir": str(job_dir / "trajectories"),
                                   **_rows_param(source.candidates_path is not None, source.dataset is not None,
                                                 inputs.rows_source),
                                   **({"test_commands": source.test_commands} if source.test_commands else {}),
                                   **({"dataset": source.dataset.model_dump()} if source.dataset is not None else {}),
                                   **({"test_specs": {r: v.model_dump() for r, v in source.test_specs.items()}}
                                      if source.test_specs else {}),
                                   **({"sample": sample, "sample_seed": sample_seed} if sampled else {})})
    log = StageLog(job_dir / "summary.json", run_id)
    logger.info("canary %s: %d task(s) of %s/%s against %s (%s), %d at a time", job_id, len(tasks), freeze_name,
                split, url, sha[:12], concurrency)
    with _model_key(key):
        trials, report = run_canary_job(log, "canary", CanaryJobRun(
            job, tasks, url, alias, agent_config, job_dir / "trajectories", run.verifier_timeout_s, concurrency))
    markdown = render_job_report(job, report, trials, {"endpoint": url, "model alias": alias,
                                                       "profile": f"{profile} (concurrency {concurrency})"})
    report_path = evaluation_tasks.write_job_report(markdown, job_dir / "report.md", REPORT_ARTIFACT_KEY,
                                                    f"canary job {job_id}: {freeze_name}/{split}")
    log.write({"job_id": job_id, "report": report.model_dump(mode="json")})
    logger.info("canary %s: scored %d/%d, reward 1: %d, exceptions %s", job_id, report.scored, report.requested,
                report.reward_1, report.exceptions_by_type or "none")
    return CanaryResult(job_id=job_id, report=report, report_path=report_path,
                        trials=[CanaryTrialOutcome(instance_id=t.instance_id, reward=t.reward,
                                                   exception_type=t.exception_type) for t in trials])


class CanaryRecoverParams(StageParams):
    """The ``canary-recover`` flow's parameters."""

    job_id: str = Field(min_length=1, description="the original canary job (forgeflow trials lists the jobs)")
    endpoint: CanaryEndpoint = Field(CanaryEndpoint(), description="the (restarted) model server, as for canary: "
                                     "the serving state file or base_url; model_sha256 defaults to the job's (it "
                                     "must be the job's model), model_alias to the job's, else the state's")
    exception_types: list[str] | None = Field(None, description="re-run only trials that ended in one of these "
                                              "exception class names; None: every exception in the merged view")
    concurrency: int | None = Field(None, ge=1, description="trials at once, within the job's profile limit; "
                                    "None: the job's")
    agent_config: agent.AgentConfig | None = Field(None, description="only for a job that did not record its "
                                                   "agent config (the lifecycle's); another than the recorded "
                                                   "one is refused")
    generated_path: Path | None = Field(None, description="the candidates file; None: the job's, else "
                                                          "$FORGEFLOW_HOME/demo/candidates.jsonl")
    recovery_job_id: str | None = Field(None, min_length=1, description="the recovery job's id; None: "
                                        "<job_id>-recovery-<digest of the trial ids>")
    out_dir: Path | None = Field(None, description="folder for <recovery job id>/report.md, summary.json and "
                                                   "trajectories; None: $FORGEFLOW_HOME/canary")


@flow(name="canary-recover", log_prints=True)
def canary_recover(params: CanaryRecoverParams) -> CanaryRecoveryResult:
    """Re-run exactly the exception trials of canary job ``params.job_id`` as a linked recovery job.

    The tasks whose standing trial (in the merged view so far) ended in an exception re-run against an
    endpoint that must serve the job's model; scored trials and tasks never run are not re-run.

    Args:
        params: the canary job whose exception trials re-run, the endpoint serving its model, what to retry.

    Raises:
        InputError: an unknown, recovery or non-canary job; an endpoint serving another model; a bad
            concurrency; an agent_config that differs from the job's; no candidates file.
        PreflightError: a task cannot run (listed), the endpoint does not answer.
    """
    job_id, endpoint, exception_types, concurrency = (params.job_id, params.endpoint, params.exception_types,
                                                      params.concurrency)
    agent_config, generated_path, recovery_job_id, out_dir = (params.agent_config, params.generated_path,
                                                              params.recovery_job_id, params.out_dir)
    logger = get_run_logger()
    apply_container_env()
    plan = evaluation_tasks.plan_recovery(job_id, exception_types, recovery_job_id)
    original = plan.original
    if plan.empty:
        logger.info("canary-recover %s: nothing to recover (%s: %d scored, no exception%s)", job_id, plan.merged.view,
                    plan.merged.report.scored, f" of type {exception_types}" if exception_types else "")
        return CanaryRecoveryResult(job_id=None, parent_job_id=job_id, recovered=[], report=None, report_path=None,
                                    merged=plan.merged)
    recorded = original.params
    profile = str(recorded.get("profile", "default"))
    with _naming("concurrency"):
        concurrency = check_concurrency(concurrency or int(recorded.get("concurrency", 1)), profile)
    config = _recovery_agent_config(original, agent_config)
    verifier_timeout_s = float(recorded.get("verifier_timeout_s", 180.0))
    dataset = DatasetSource(**recorded["dataset"]) if generated_path is None and recorded.get("dataset") else None
    own_candidates = generated_path is None and dataset is None and recorded.get("candidates_path")
    default_generated = home_dir() / "demo" / GENERATED_FILE
    key = evaluation_tasks.endpoint_api_key(endpoint)
    inputs, loaded = evaluation_tasks.recovery_inputs(
        plan, endpoint, Path(recorded["candidates_path"]) if own_candidates else None,
        None if own_candidates or dataset else Path(generated_path or recorded.get("generated_path")
                                                    or default_generated),
        default_generated, dataset, recorded.get("test_commands"),
        {r: TestSpec(**v) for r, v in (recorded.get("test_specs") or {}).items()}, key)
    tasks, url, sha, alias = inputs.tasks, inputs.base_url, inputs.model_sha256, inputs.model_alias
    run_id = str(flow_run.get_id() or "")
    new_id = plan.recovery_job_id
    job_dir = Path(out_dir or home_dir() / "canary") / new_id
    job = records.JobRecord(job_id=new_id, kind=RECOVERY_JOB_KIND, parent_job_id=job_id,
                           freeze_name=original.freeze_name, split=original.split, model_sha256=sha,
                           run_id=run_id[:64] or None,
                           params={"concurrency": concurrency, "profile": profile, "base_url": url,
                                   "model_alias": alias, "agent_config": config.model_dump(mode="json"),
                                   "verifier_timeout_s": verifier_timeout_s,
                                   "trajectories_dir": str(job_dir / "trajectories"),
                                   **_rows_param(bool(own_candidates), dataset is not None, loaded.source),
                                   **{k: recorded[k] for k in ("test_commands", "dataset", "test_specs")
                                      if recorded.get(k)},
                                   "recovers": {t.instance_id: t.trial_id for t in plan.exception_trials}})
    log = StageLog(job_dir / "summary.json", run_id)
    logger.info("canary-recover %s: re-running %d exception trial(s) of %s (%s) as %s against %s", job_id,
                len(tasks), job_id, plan.merged.view, new_id, url)
    with _model_key(key):
        trials, report = run_canary_job(log, "canary_recover", CanaryJobRun(
            job, tasks, url, alias, config, job_dir / "trajectories", verifier_timeout_s, concurrency, run_key=new_id))
    merged = evaluation_tasks.merged_view(job_id)
    merged_report = merged.report
    extra = {"recovers": f"{len(tasks)} exception trial(s) of job `{job_id}`", "endpoint": url, "model alias": alias,
             "merged view": f"{merged.view}: scored {merged_report.scored}/{merged_report.requested}, "
                            f"exceptions {merged_report.exceptions_by_type or 'none'}"}
    markdown = render_job_report(job, report, trials, extra)
    report_path = evaluation_tasks.write_job_report(markdown, job_dir / "report.md", RECOVERY_REPORT_ARTIFACT_KEY,
                                                    f"canary recovery {new_id} of {job_id}")
    log.write({"job_id": new_id, "parent_job_id": job_id, "report": report.model_dump(mode="json")})
    logger.info("canary-recover %s: %s; scored %d/%d in the merged view, exceptions %s", new_id, merged.view,
                merged_report.scored, merged_report.requested, merged_report.exceptions_by_type or "none")
    by_instance = {t.instance_id: t for t in trials}
    recovered = [CanaryTrialOutcome(instance_id=old.instance_id, original_trial_id=old.trial_id,
                                trial_id=by_instance[old.instance_id].trial_id,
                                reward=by_instance[old.instance_id].reward,
                                exception_type=by_instance[old.instance_id].exception_type)
                 for old in plan.exception_trials if old.instance_id in by_instance]
    return CanaryRecoveryResult(job_id=new_id, parent_job_id=job_id, recovered=recovered, report=report,
                                report_path=report_path, merged=merged)
