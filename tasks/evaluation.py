"""Prefect tasks of evaluation: agent (canary) trials with their supervision events, the compare
stage (paired statistics, the promotion gate, the markdown report), Harbor export/import and the
answer judge (the store and file I/O of ``flows/evaluation.py``), and the canary flows' inputs, records and
reports (the store, file and endpoint I/O of ``flows/canary.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import httpx
from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy
from prefect.states import Completed
from pydantic import BaseModel, ConfigDict

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_file
from forgeflow.curation.task_rows import DatasetSource, TaskRows, TaskSource, TestSpec, load_task_rows
from forgeflow.evaluation import agent, compare, harbor, harbor_import, harbor_tasks, judge
from forgeflow.evaluation.canary import (
    CanaryRecoveryPlan,
    CanaryTask,
    canary_tasks,
    frozen_split,
    plan_canary_recovery,
    sample_split,
)
from forgeflow.evaluation.canary_params import CanaryEndpoint
from forgeflow.evaluation.compare import gate
from forgeflow.ledger import records
from forgeflow.ledger import store as ledger
from forgeflow.sandbox import trial
from forgeflow.sandbox.dispatch import RayPlacement
from tasks.common import (
    RESUMABLE,
    flow_run_id,
    run_labelled,
    run_logger,
    shared_store,
    shared_trial_writer,
    task_run_id,
)


class UnscoredTrialError(Exception):
    """Internal: carries an agent trial that ended in an exception out of the cached task as a
    *failure*, so Prefect never caches it (exceptions are never cached: docs/architecture.md)."""

    def __init__(self, record: trial.TrialResult) -> None:
        super().__init__(f"{record.exception_type}: {record.exception_message}")
        self.record = record

    def __reduce__(self) -> tuple:  # pickled by Prefect's result store: rebuild from the record
        return (type(self), (self.record,))


@task(cache_policy=(INPUTS - "base_url" - "ray") + TASK_SOURCE,
      task_run_name="agent-run-{task.instance_id}-{model_sha256:.12}")
def _cached_agent_trial(task: CanaryTask, base_url: str, model_alias: str, model_sha256: str, config: agent.AgentConfig,
                        out_dir: Path, verifier_timeout_s: float, run_key: str,
                        ray: RayPlacement | None = None) -> trial.TrialResult:
    """The trial itself; only a trial without an exception completes (and is cached), any other
    ends this task run Failed with :class:`UnscoredTrialError` (never cached, retried next run).
    ``run_key`` names the trial (:func:`forgeflow.sandbox.trial.make_trial_id`) and is part of the cache key;
    ``ray`` (the config's ``verifier_ray``, passed apart) is not: where the trial runs is not what it computes.
    With ``ray`` the whole trial (agent, its container, the verifier) runs as one Ray task on a sandbox node
    (:func:`forgeflow.evaluation.agent.run_agent_trial_on`)."""
    # the agent's and verifier's sandboxes carry this run's id (the sweep of a cancelled or crashed run)
    config = config.model_copy(update={field: run_labelled(getattr(config, field))
                                       for field in ("verifier_backend", "sandbox_backend")})
    record = agent.run_agent_trial_on(ray, task, base_url, model_alias, config, out_dir,
                                      verifier_timeout_s=verifier_timeout_s, run_key=run_key)
    if record.exception_type is not None:
        raise UnscoredTrialError(record)
    return record


@task(cache_policy=NO_CACHE, task_run_name="agent-{task.instance_id}-{model_sha256:.12}")
def agent_trial(task: CanaryTask, base_url: str, model_alias: str, model_sha256: str, config: agent.AgentConfig,
                out_dir: Path, verifier_timeout_s: float, job_id: str | None = None,
                run_key: str | None = None) -> trial.TrialResult:
    """One canary trial: mini-swe-agent on the host, commands in a no-network container on the
    config's ``sandbox_backend`` (podman or a Kubernetes pod), then the verifier on its
    ``verifier_backend``; with ``config.verifier_ray`` all of it as one Ray task on a sandbox node of
    that cluster. An infrastructure failure is recorded as the trial's exception, never as reward 0.

    Caching: the trial runs in ``_cached_agent_trial``, keyed on model sha256 + image digest +
    agent/sampling config + the task's tests (not the endpoint URL: blue/green alternates ports for
    the same model). Only a trial without an exception is cached; a trial that ended in an exception
    (endpoint down, sandbox broke, agent timeout, dead loop, hang) is returned here but runs again in
    the next flow run (exceptions are never cached). A cache hit ends this task in a
    ``Cached`` state too, so stage bookkeeping sees it.

    The trial is recorded here, once, as it ends (cached or not; :func:`record_agent_trial`): its ``trials``
    row (:meth:`forgeflow.ledger.records.TrialRecord.from_trial`: ``job_id``, ``model_sha256``, the flow run's id) and,
    when the supervisor stopped the run (dead loop or hang: ``AgentLoopError`` / ``AgentHangError``, the
    verifier's reward kept beside it), its ``supervision_events`` row with the evidence and the trajectory
    path, in one transaction of the store (``settings.store_url()``).

    ``task`` (:class:`forgeflow.evaluation.canary.CanaryTask`) is the task: its image and digest,
    problem statement, test command, FAIL_TO_PASS / PASS_TO_PASS and the log parser the verifier
    reads its output with. ``run_key`` (default: ``model_sha256``) names the trial: a canary
    recovery job passes its own job id so that its trials get ids of their own and never overwrite
    the original job's rows."""
    state = _cached_agent_trial(task, base_url, model_alias, model_sha256,
                                config.model_copy(update={"verifier_ray": None}), out_dir, verifier_timeout_s,
                                run_key or model_sha256, config.verifier_ray, return_state=True)
    try:
        record = state.result()
    except UnscoredTrialError as exc:
        record = exc.record
    record_agent_trial(None, record, job_id, model_sha256, flow_run_id(), task_run_id())
    if state.name == "Cached":  # the trial came from the cache: say so (the stage log counts it)
        return Completed(data=record, name="Cached")
    return record


def record_agent_trial(store_url: str | None, record: trial.TrialResult, job_id: str | None,
                       model_sha256: str | None, run_id: str | None, task_run: str | None = None) -> Any:
    """Record an agent trial as it ends: its ``trials`` row and, when the supervisor stopped it, its
    ``supervision_events`` row, together, in the store at ``store_url`` (None: ``settings.store_url()``),
    returning once they are committed (a crash loses no trial a caller returned for). The canary's only write of
    a trial. Trials that end together share transactions (:func:`tasks.common.shared_trial_writer`: a group
    commit, whichever caller finds no write under way writes every row queued by then).

    Args:
        store_url: the store's SQLAlchemy URL, or None.
        record: the trial (:class:`forgeflow.sandbox.trial.TrialResult`).
        job_id: the job the trial belongs to.
        model_sha256: the model's digest (64 hex), stored on the row.
        run_id: the flow run stamped on the trial row.
        task_run: the task run stamped on the supervision event.

    Returns:
        The supervision event recorded, or None when the supervisor did not stop the run.

    Raises:
        InputError: the store refuses the row (a trial with neither reward nor exception), before anything is
            queued.
        StoreUnavailableError and the store's other errors: the transaction that held the row failed (nothing
            of it was written).
    """
    from forgeflow.common import settings

    event = agent.supervision_event(record, job_id, task_run)
    row = records.TrialRecord.from_trial(record, job_id, model_sha256, run_id)
    records.check_outcome(row)  # one bad row must never fail the other callers' shared transaction
    shared_trial_writer(store_url or settings.store_url()).record((row, event))
    if event is not None:
        run_logger().warning("supervisor stopped %s: %s (%s)", record.instance_id, event.kind, record.exception_message)
    return event


def record_supervision(record: trial.TrialResult, job_id: str | None, run_id: str | None = None) -> Any:
    """Record the supervisor's stop of ``record`` (if any) as a ``supervision_events`` row in the
    store (``settings.store_url()``); returns the row, or None when the supervisor did not stop it."""
    from forgeflow.common import settings

    event = agent.supervision_event(record, job_id, run_id)
    if event is not None:
        shared_store(settings.store_url()).record_supervision_event(event)
        run_logger().warning("supervisor stopped %s: %s (%s)", record.instance_id, event.kind, record.exception_message)
    return event


def _store() -> ledger.Store:
    """This process's store at ``settings.store_url()`` (:func:`tasks.common.shared_store`: migrated once, its
    engine kept; never disposed by a task)."""
    from forgeflow.common import settings

    return shared_store(settings.store_url())


@task(cache_policy=NO_CACHE)
def harbor_export_inputs(freeze_name: str, split: str, candidates_path: Path | None, generated_path: Path | None,
                         default_generated: Path, dataset: DatasetSource | None = None,
                         test_commands: dict[str, str] | None = None,
                         test_specs: dict[str, TestSpec] | None = None) -> tuple[Path, list[harbor.HarborTask]]:
    """The verified manifest of freeze ``freeze_name`` (as the store records it) and the
    :class:`~forgeflow.evaluation.harbor.HarborTask` of every instance of ``split``
    (:func:`forgeflow.evaluation.harbor_tasks.harbor_tasks`: tests from the store, patch/image/command
    from the task rows). Not cached: the store and the files may change between runs.

    Raises:
        InputError: the freeze is not recorded or fails verification, the split is unknown or empty,
            the task rows cannot be read (:func:`forgeflow.curation.task_rows.load_task_rows`).
        PreflightError: tasks that cannot be exported (listed).
    """
    store = _store()
    manifest, ids = frozen_split(store, freeze_name, split)
    loaded = load_task_rows(candidates_path, generated_path, default_generated, test_commands,
                            stage="harbor-export", dataset=dataset, test_specs=test_specs)
    return manifest.path, harbor_tasks.harbor_tasks(store, ids, loaded)


@task(cache_policy=NO_CACHE)
def write_harbor_export(manifest_path: Path, split: str, export_tasks: list[harbor.HarborTask], out_dir: Path,
                        limits: harbor.HarborTaskLimits) -> harbor.HarborExport:
    """:func:`forgeflow.evaluation.harbor.export_split` (atomic; the same export again is a no-op, another
    export into ``out_dir`` is refused with :class:`~forgeflow.common.errors.InputError`)."""
    return harbor.export_split(manifest_path, split, export_tasks, out_dir, limits)


@task(cache_policy=NO_CACHE)
def import_harbor(job_dir: Path, job_id: str | None, freeze_name: str | None, split: str,
                  run_id: str | None) -> harbor_import.HarborImportSummary:
    """Import a Harbor job folder's trials into the store
    (:func:`forgeflow.evaluation.harbor_import.import_harbor_job`, upserts keyed by Harbor's trial UUIDs).

    With ``freeze_name``, the freeze and ``split`` are checked first, every trial's task must be an
    instance of that split, and a ``jobs`` row (kind ``harbor``, the freeze and split, ``job_dir``)
    is recorded so ``compare`` can pair the job with another job of the same frozen split. Without
    it, only the trials are recorded.

    Raises:
        InputError: ``job_dir`` does not exist (named as the ``harbor-import`` flow's ``params.job_dir``), an
            unknown freeze or split, a folder that is not a Harbor job folder, a bad trial
            result (file and field named), a trial of a task outside the split.
    """
    if not Path(job_dir).is_dir():
        raise InputError(f"harbor-import: params.job_dir {job_dir} does not exist (give <jobs dir>/<job name>)")
    store = _store()
    ids = frozen_split(store, freeze_name, split)[1] if freeze_name is not None else None
    found = harbor_import.read_harbor_job(job_dir, job_id=job_id, instance_ids=ids, run_id=run_id)
    if freeze_name is not None:
        store.record_job(records.JobRecord(job_id=found.job_id, kind=harbor_import.HARBOR_JOB_KIND,
                                           freeze_name=freeze_name, split=split, run_id=run_id,
                                           params={"job_dir": str(Path(job_dir).resolve())}))
    store.record_trials(found.trials)
    return harbor_import.HarborImportSummary.of(found, freeze_name, split if freeze_name is not None else None)


@task(cache_policy=NO_CACHE)
def read_answers(path: Path) -> tuple[list[tuple[str, str, str]], str]:
    """The rows of an answers file (:func:`forgeflow.evaluation.judge.load_answer_rows`) and the file's sha256.

    Raises:
        InputError: no file, or a bad row (its line and field named).
    """
    items = judge.load_answer_rows(path)
    return items, sha256_file(path)


@task(cache_policy=NO_CACHE)
def record_judgments(items: list[tuple[str, str, str]], job_id: str, rel_tol: float, abs_tol: float,
                     run_id: str | None) -> list[records.JudgmentRecord]:
    """Judge the rows and record them in the store's ``judgments`` table in one transaction
    (:func:`forgeflow.evaluation.judge.judge_answers`; the same job again updates its rows).

    Raises:
        InputError: a bad tolerance (nothing recorded).
    """
    return judge.judge_answers(items, _store(), job_id=job_id, run_id=run_id, rel_tol=rel_tol, abs_tol=abs_tol)


@task(cache_policy=NO_CACHE)
def job_trial_rows(job_id: str) -> list[dict[str, Any]]:
    """One table row per trial of ``job_id`` in the store: instance_id, kind, reward, exception_type,
    exception_message, agent_s, verifier_s (seconds)."""
    return [{"instance_id": t.instance_id, "kind": t.kind, "reward": t.reward, "exception_type": t.exception_type,
             "exception_message": t.exception_message, "agent_s": (t.timings or {}).get("agent_s"),
             "verifier_s": (t.timings or {}).get("verifier_s")} for t in _store().trials_for(job_id=job_id)]


def _stored_jobs_key(_context: Any, parameters: dict[str, Any]) -> str:
    """Cache key part of :func:`compare_stored_jobs`: a digest of what it reads from the store — both
    jobs as merged (label, freeze, split, model, recovery jobs; per trial the instance, reward,
    exception, tokens, steps and timings) and the repository of each of their tasks — so a recovery
    job, a voided trial or a changed task row is a new key. A job it cannot read gives a key that
    never hits: the task runs and raises the store's error."""
    import hashlib
    import json
    import uuid

    store = _store()
    try:
        jobs = [compare.merged_job(store, parameters[k], include_recovery=parameters.get("merge_recovery", True))
                for k in ("job_a", "job_b")]
    except InputError:
        return uuid.uuid4().hex
    facts = [{"label": j.label, "freeze": j.freeze_name, "split": j.split, "model": j.model_sha256,
              "recorded": j.recorded, "from_recovery": j.from_recovery,
              "trials": [[t.instance_id, t.reward, t.exception_type, t.exception_message, t.input_tokens,
                          t.agent_steps, t.timings] for t in j.trials]} for j in jobs]
    ids = sorted({t.instance_id for j in jobs for t in j.trials})
    repos = {i: getattr(store.get_task(i), "repo", None) for i in ids}
    return hashlib.sha256(json.dumps([facts, repos], sort_keys=True, default=str).encode()).hexdigest()


@task(cache_policy=RESUMABLE + CacheKeyFnPolicy(cache_key_fn=_stored_jobs_key),
      task_run_name="compare-{job_a}-vs-{job_b}")
def compare_stored_jobs(job_a: str, job_b: str, merge_recovery: bool = True, seed: int = 0,
                        gate_policy: gate.GatePolicy | None = None,
                        plot_file: str | None = None) -> compare.StoredJobsComparison:
    """Compare two stored canary jobs (:func:`forgeflow.evaluation.compare.compare_stored_jobs`; the
    markdown embeds ``plot_file``). Cached on its inputs, its source and what it reads from the store
    (:func:`_stored_jobs_key`): the same jobs with the same trials give the same comparison; a job that
    gained a recovery job (when merged) or a voided trial is compared anew.

    Raises:
        InputError: as :func:`~forgeflow.evaluation.compare.compare_stored_jobs` (missing jobs, other splits).
    """
    return compare.compare_stored_jobs(_store(), job_a, job_b, merge_recovery=merge_recovery, seed=seed,
                                       plot_file=plot_file, gate=gate_policy)


@task(cache_policy=NO_CACHE, task_run_name="compare-{job_a}-vs-{job_b}")
def compare_stored(job_a: str, job_b: str, md_path: Path, merge_recovery: bool = True, seed: int = 0,
                   gate_policy: gate.GatePolicy | None = None) -> compare.StoredJobsComparison:
    """Compare two stored canary jobs (:func:`forgeflow.evaluation.compare.compare_stored_jobs`) and write
    the markdown report at ``md_path`` with its PNG beside it (``md_path`` with suffix ``.png``), and
    the ``compare-standalone`` markdown artifact (:func:`write_stored_comparison`'s). Not cached: the
    jobs may have gained recovery jobs.

    Returns:
        The comparison, with the promotion gate's decision under ``gate_policy``.

    Raises:
        InputError: as :func:`~forgeflow.evaluation.compare.compare_stored_jobs` (missing jobs, other splits).
    """
    result = compare_stored_jobs.fn(job_a, job_b, merge_recovery, seed, gate_policy, md_path.with_suffix(".png").name)
    _write_stored_report(result, md_path)
    return result


def _write_stored_report(result: compare.StoredJobsComparison, md_path: Path) -> Path:
    png_path = md_path.with_suffix(".png")
    return _write_report(result, result.markdown, md_path, (result.job_a.job_id, result.job_b.job_id),
                         "compare-standalone", f"{result.job_a.label} vs {result.job_b.label}",
                         f"\nReport: `{md_path}`; plot: `{png_path}`\n")


def _write_report(result: Any, markdown: str, md_path: Path, labels: tuple[str, str], artifact_key: str,
                  description: str, artifact_tail: str = "") -> Path:
    """Draw ``result``'s plot (pass rates, wins/losses per repository) as ``md_path`` with suffix ``.png``,
    write ``markdown`` (which embeds it by file name) atomically at ``md_path`` and publish it as the
    markdown artifact ``artifact_key`` (the plot linked by its file URI). Returns the plot's path."""
    from forgeflow.common.fsutil import atomic_write_text
    from tasks.common import markdown_artifact

    png_path = md_path.with_suffix(".png")
    compare.render_plot(result.report_a, result.report_b, result.paired, png_path, *labels)
    atomic_write_text(md_path, markdown)
    artifact_md = markdown.replace(f"]({png_path.name})", f"]({png_path.resolve().as_uri()})")
    markdown_artifact(artifact_key, artifact_md + artifact_tail, description)
    return png_path


class ComparisonFiles(BaseModel):
    """The comparison report and plot the ``compare`` flow wrote (:func:`write_stored_comparison`).

    Attributes:
        report_path / report_sha256: the markdown report and its sha256 (64 hex).
        plot_path / plot_sha256: the PNG beside it and its sha256.
    """

    model_config = ConfigDict(frozen=True)

    report_path: Path
    report_sha256: str
    plot_path: Path
    plot_sha256: str


@task(cache_policy=NO_CACHE)
def write_stored_comparison(result: compare.StoredJobsComparison, md_path: Path) -> ComparisonFiles:
    """Write :func:`compare_stored_jobs`'s report at ``md_path`` (the PNG beside it, suffix ``.png``)
    and the ``compare-standalone`` markdown artifact; both files with their digests. Not cached: it
    writes the files and the artifact anew on every run (what the ``compare`` flow's cached
    comparison stands for)."""
    plot = _write_stored_report(result, md_path)
    return ComparisonFiles(report_path=md_path, report_sha256=sha256_file(md_path), plot_path=plot,
                           plot_sha256=sha256_file(plot))


@task(cache_policy=NO_CACHE)
def check_promotion_jobs(baseline_job: str, candidate_job: str, gguf_sha256: str, state_path: Path) -> None:
    """Before any comparison: the candidate job canaried the GGUF being promoted (its recorded
    ``model_sha256`` is the file's sha256), and the baseline job canaried the model that serves now
    (when a serving state file exists), so the gate compares what would be swapped.

    Raises:
        InputError: a job is not in the store, or either digest differs (both named).
    """
    from forgeflow.serving.bluegreen import read_state

    store = _store()
    ids = {"baseline": baseline_job, "candidate": candidate_job}
    jobs = {role: store.get_job(job_id) for role, job_id in ids.items()}
    for role, job in jobs.items():
        if job is None:
            raise InputError(f"promote: {role} job {ids[role]!r} is not in the store ({store.display_url})")
    if jobs["candidate"].model_sha256 != gguf_sha256:
        raise InputError(f"promote: candidate job {candidate_job!r} canaried model {jobs['candidate'].model_sha256}, "
                         f"not params.gguf_path's {gguf_sha256}: canary the GGUF to promote first")
    active = read_state(state_path)
    if active is not None and jobs["baseline"].model_sha256 != active.gguf_sha256:
        raise InputError(f"promote: baseline job {baseline_job!r} canaried model {jobs['baseline'].model_sha256}, but "
                         f"{state_path} serves {active.gguf_sha256} ({active.gguf_path}): the gate would compare "
                         "the candidate with a model that is not the one it replaces")


def resolve_endpoint(endpoint: CanaryEndpoint) -> tuple[str, str, str]:
    """``(base_url, model_sha256, model_alias)`` from an explicit endpoint or the serving state file.

    Args:
        endpoint: the serving state file ``state_path`` (default ``$FORGEFLOW_HOME/serving/state.json``): its
            active server; or ``base_url`` + ``model_sha256``, checked against that state file when it
            records a live server at ``base_url`` (the same model, or refused). A ``base_url`` the state
            does not record as serving (a server staged on the idle port, an endpoint of another state
            file or of none) is taken with the ``model_sha256`` given. ``model_alias`` overrides the
            state's (with ``base_url``: the server's default, ``forgeflow``).

    Raises:
        InputError: ``base_url`` without a 64-hex ``model_sha256``; ``model_sha256`` differs from the GGUF the
            state file records serving at that URL; no state file (without ``base_url``) or an invalid one.
        PreflightError: the recorded server is stopped (without ``base_url``).
    """
    from forgeflow.common.settings import home_dir
    from forgeflow.serving import bluegreen
    from forgeflow.serving.server import DEFAULT_ALIAS

    state_path, base_url, model_sha256, model_alias = (endpoint.state_path, endpoint.base_url, endpoint.model_sha256,
                                                       endpoint.model_alias)
    path = Path(state_path or home_dir() / "serving" / "state.json")
    state = bluegreen.read_state(path)
    if base_url is not None:
        if model_sha256 is None or not re.fullmatch(r"[0-9a-f]{64}", model_sha256):
            raise InputError(f"canary: params.endpoint.base_url {base_url} needs params.endpoint.model_sha256 (64 "
                             f"lower-case hex digits, the served GGUF's sha256), got {model_sha256!r}")
        url = base_url.rstrip("/")
        if (state is not None and state.live and state.base_url.rstrip("/") == url
                and state.gguf_sha256 != model_sha256):
            raise InputError(f"canary: params.endpoint.model_sha256 {model_sha256} differs from the GGUF "
                             f"{state.gguf_sha256} ({state.gguf_path}) that {path} records serving at {url} "
                             f"(generation {state.generation})")
        return url, model_sha256, model_alias or DEFAULT_ALIAS  # the server's default name
    if state is None:
        raise InputError(f"canary: no serving state at {path}: run the serve flow first, or give "
                         "params.endpoint.base_url and params.endpoint.model_sha256")
    if not state.live or not state.base_url:
        raise PreflightError(f"canary: the server recorded in {path} (generation {state.generation}) is stopped")
    if model_sha256 is not None and model_sha256 != state.gguf_sha256:
        raise InputError(f"canary: params.endpoint.model_sha256 {model_sha256} differs from the served GGUF "
                         f"{state.gguf_sha256} recorded in {path}")
    return state.base_url.rstrip("/"), state.gguf_sha256, model_alias or state.model_alias


def check_reachable(base_url: str, api_key: str | None = None) -> None:
    """Any HTTP answer from ``GET base_url/models`` counts but a refusal of the key (401/403); a refused or
    timed-out connection does not.

    Raises:
        PreflightError: no answer.
        InputError: 401/403: the endpoint wants a key (none was sent) or refuses the one sent.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/models", timeout=10.0, headers=headers)
    except httpx.HTTPError as exc:
        raise PreflightError(f"canary: the model endpoint {base_url} does not answer: "
                             f"{type(exc).__name__}: {exc}") from None
    if response.status_code in (401, 403):
        raise InputError(f"canary: the model endpoint {base_url} answered HTTP {response.status_code} to "
                         + ("the key of params.endpoint.api_key_secret" if api_key else "a request without a key: "
                            "give params.endpoint.api_key_secret (a Secret block holding its key)"))


class CanaryInputs(BaseModel):
    """What a canary job runs on, read and checked before its first trial (:func:`canary_inputs`).

    Attributes:
        instance_ids: the split's ids, sampled when asked, in the split's order.
        sampled: True when ``sample`` kept fewer ids than the split has.
        tasks: one :class:`forgeflow.evaluation.canary.CanaryTask` per id, in order.
        rows_source: the task rows' file, folder or dataset (:attr:`TaskRows.source`).
        base_url: the OpenAI-compatible endpoint, no trailing slash.
        model_sha256: the served model's sha256 (64 hex).
        model_alias: the model name sent to the endpoint.
    """

    model_config = ConfigDict(frozen=True)

    instance_ids: list[str]
    sampled: bool
    tasks: list[CanaryTask]
    rows_source: str
    base_url: str
    model_sha256: str
    model_alias: str


@task(cache_policy=NO_CACHE, task_run_name="canary-inputs-{freeze_name}-{split}")
def canary_inputs(freeze_name: str, split: str, sample: int | None, sample_seed: int, source: TaskSource,
                  endpoint: CanaryEndpoint, default_generated: Path, api_key: str | None = None) -> CanaryInputs:
    """Everything the ``canary`` flow checks before its first trial, in the order a user fixes it: the freeze
    (verified against the store's digest) and its split (sampled with ``sample_seed``), the endpoint (the
    serving state file or ``base_url`` + ``model_sha256``), the task rows and each task's accepted
    validation and image, then an answer of the endpoint (sent ``api_key``). Not cached: the store, the
    files and the endpoint may change between runs.

    Raises:
        InputError: an unknown freeze or split, an endpoint given wrongly or recorded serving another model
            (:func:`resolve_endpoint`), rows that cannot be read, a 401/403 from the endpoint.
        PreflightError: tasks that cannot run (listed), a stopped or silent endpoint.
    """
    store = _store()
    _, ids = frozen_split(store, freeze_name, split)
    kept = sample_split(ids, sample, sample_seed)
    url, sha, alias = resolve_endpoint(endpoint)
    loaded = source.load(default_generated, "canary")
    tasks = canary_tasks(store, kept, loaded.rows, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers)
    check_reachable(url, api_key)
    return CanaryInputs(instance_ids=kept, sampled=len(kept) < len(ids), tasks=tasks, rows_source=loaded.source,
                        base_url=url, model_sha256=sha, model_alias=alias)


@task(cache_policy=NO_CACHE, task_run_name="plan-recovery-{job_id}")
def plan_recovery(job_id: str, exception_types: Sequence[str] | None,
                  recovery_job_id: str | None) -> CanaryRecoveryPlan:
    """:func:`forgeflow.evaluation.canary.plan_canary_recovery` on the store (reads only; not cached: the
    job may have gained recovery jobs). Raises as that function."""
    store = _store()
    return plan_canary_recovery(store, job_id, list(exception_types) if exception_types else None,
                                recovery_job_id)


@task(cache_policy=NO_CACHE, task_run_name="merged-view-{job_id}")
def merged_view(job_id: str) -> tuple[str, list[str], compare.JobReport]:
    """The merged view of canary job ``job_id`` now (the original + its recovery jobs,
    :func:`forgeflow.evaluation.compare.merged_job`): ``(label, recovery job ids, JobReport)``."""
    store = _store()
    merged = compare.merged_job(store, job_id)
    return merged.label, list(merged.recovery_job_ids), compare.JobReport.from_trials(merged.trials)


@task(cache_policy=NO_CACHE)
def recovery_inputs(plan: CanaryRecoveryPlan, endpoint: CanaryEndpoint, candidates_path: Path | None,
                    generated_path: Path | None, default_generated: Path, dataset: DatasetSource | None,
                    test_commands: dict[str, str] | None, test_specs: dict[str, TestSpec],
                    api_key: str | None = None) -> tuple[CanaryInputs, TaskRows]:
    """What a ``canary-recover`` run re-runs, checked before its first trial: the endpoint (which must serve the
    original job's model: ``endpoint.model_sha256`` defaults to the job's, ``model_alias`` to the job's), the
    task rows the original read, each re-run task's accepted validation and image, an answer of the endpoint.

    Raises:
        InputError: the endpoint serves another model than the job's, rows that cannot be read, a 401/403.
        PreflightError: a task cannot run (listed), the endpoint does not answer.
    """
    original = plan.original
    url, sha, alias = resolve_endpoint(endpoint.model_copy(update={
        "model_sha256": endpoint.model_sha256 or original.model_sha256,
        "model_alias": endpoint.model_alias or original.params.get("model_alias")}))
    if sha != original.model_sha256:
        raise InputError(f"canary-recover: the endpoint serves model {sha}, but job {original.job_id!r} evaluated "
                         f"{original.model_sha256}: a recovery re-runs the same model")
    loaded = load_task_rows(candidates_path, generated_path, default_generated, test_commands,
                            stage="canary-recover", dataset=dataset, test_specs=test_specs)
    store = _store()
    tasks = canary_tasks(store, plan.instance_ids, loaded.rows, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers)
    check_reachable(url, api_key)
    return CanaryInputs(instance_ids=plan.instance_ids, sampled=False, tasks=tasks, rows_source=loaded.source,
                        base_url=url, model_sha256=sha, model_alias=alias), loaded


@task(cache_policy=NO_CACHE)
def write_job_report(markdown: str, report_path: Path, artifact_key: str, description: str) -> Path:
    """Write a canary (or recovery) job's markdown report atomically at ``report_path`` and publish it as the
    markdown artifact ``artifact_key``. Returns ``report_path``."""
    from forgeflow.common.fsutil import atomic_write_text
    from tasks.common import markdown_artifact

    path = atomic_write_text(report_path, markdown)
    markdown_artifact(artifact_key, markdown, description)
    return path


@task(cache_policy=NO_CACHE, persist_result=False)
def endpoint_api_key(endpoint: CanaryEndpoint) -> str | None:
    """The API key of a canary's endpoint: its ``api_key_secret`` block's value, else the one the serving state
    records for an external endpoint (read now), else None (``$FORGEFLOW_MODEL_API_KEY`` then applies). The
    result is never persisted.

    Raises:
        InputError: the Secret block does not exist or is empty.
    """
    from blocks.core import secret_token
    from forgeflow.common.settings import home_dir
    from forgeflow.serving import bluegreen

    name = endpoint.api_key_secret
    if name is None and endpoint.base_url is None:
        state = bluegreen.read_state(Path(endpoint.state_path or home_dir() / "serving" / "state.json"))
        name = state.api_key_secret if state is not None else None
    return secret_token(name, "canary endpoint api_key_secret").get_secret_value() if name else None
