"""Prefect tasks of evaluation: agent (canary) trials and their supervision events, the compare stage, Harbor
export/import, the answer judge, and the canary flows' inputs, records and reports. The store is
``settings.store_url()``'s."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy
from prefect.context import TaskRunContext
from prefect.states import Completed
from pydantic import BaseModel, ConfigDict

from forgeflow.common import settings
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import JSONObject, sha256_file
from forgeflow.common.task import Task
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
from forgeflow.evaluation.canary_result import MergedView
from forgeflow.evaluation.compare import gate
from forgeflow.ledger import records
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
    """Carries an agent trial that ended in an exception out of the cached task as a failure (never cached)."""

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
    """The trial itself: only one without an exception completes (and is cached); any other fails with
    :class:`UnscoredTrialError`. ``run_key`` names the trial and keys the cache; ``ray`` (where it runs) does not."""
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
    """One canary trial: mini-swe-agent on the host, its commands in a no-network sandbox, then the verifier (with
    ``config.verifier_ray``: one Ray task on a sandbox node). An infrastructure failure is the trial's exception, never
    reward 0. Cached (in ``_cached_agent_trial``) on the model sha256, image digest, agent config and tests, not the
    endpoint URL; a trial with an exception runs again next time. A cache hit ends ``Cached``. The trial is recorded
    once as it ends (:func:`record_agent_trial`). ``run_key`` (default ``model_sha256``) names the trial: a recovery job
    passes its own id, so its trials never overwrite the original's."""
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
                       model_sha256: str | None, run_id: str | None,
                       task_run: str | None = None) -> records.SupervisionEventRecord | None:
    """Record an agent trial's ``trials`` row and, when the supervisor stopped it, its ``supervision_events`` row in one
    transaction (``store_url`` None: ``settings.store_url()``; trials ending together share one:
    :func:`tasks.common.shared_trial_writer`), returning once committed; the event, or None. Raises InputError: the
    store refuses the row (a trial with neither reward nor exception), before anything is queued; StoreUnavailableError
    and the store's other errors: the transaction that held the row failed (nothing of it was written)."""
    event = agent.supervision_event(record, job_id, task_run)
    row = records.TrialRecord.from_trial(record, job_id, model_sha256, run_id)
    records.check_outcome(row)  # one bad row must never fail the other callers' shared transaction
    shared_trial_writer(store_url or settings.store_url()).record((row, event))
    if event is not None:
        run_logger().warning("supervisor stopped %s: %s (%s)", record.instance_id, event.kind, record.exception_message)
    return event


@task(cache_policy=NO_CACHE)
def harbor_export_inputs(freeze_name: str, split: str, source: TaskSource,
                         default_generated: Path) -> tuple[Path, list[Task]]:
    """The verified manifest of freeze ``freeze_name`` and the Harbor task of every instance of ``split`` (tests from
    the store, patch/image/command from the task rows ``source``, generated rows' default file ``default_generated``;
    ``source.images="registry"``: each generated row's pushed registry copy is the image). Raises InputError: the
    freeze is not recorded or fails verification, the split is unknown or empty, the task rows cannot be read
    (:meth:`forgeflow.curation.task_rows.TaskSource.load`); PreflightError: tasks that cannot be exported (listed)."""
    store = shared_store(settings.store_url())
    manifest, ids = frozen_split(store, freeze_name, split)
    loaded = source.load(default_generated, "harbor-export")
    return manifest.path, harbor_tasks.harbor_tasks(store, ids, loaded)


@task(cache_policy=NO_CACHE)
def write_harbor_export(manifest_path: Path, split: str, export_tasks: list[Task], out_dir: Path,
                        limits: harbor.HarborTaskLimits) -> harbor.HarborExport:
    """Write the Harbor export (atomic; the same export again is a no-op, another into ``out_dir`` an InputError)."""
    return harbor.export_split(manifest_path, split, export_tasks, out_dir, limits)


@task(cache_policy=NO_CACHE)
def import_harbor(job_dir: Path, job_id: str | None, freeze_name: str | None, split: str,
                  run_id: str | None) -> harbor_import.HarborImportSummary:
    """Import a Harbor job folder's trials (:func:`forgeflow.evaluation.harbor_import.import_harbor_job`: upserts keyed
    by Harbor's trial UUIDs). With ``freeze_name``, every trial must be of an instance of ``split``, and a ``jobs`` row
    (kind ``harbor``) lets ``compare`` pair the job with another of the same split. Raises InputError: ``job_dir`` does
    not exist (``params.job_dir``), an unknown freeze or split, not a Harbor job folder, a bad trial result (file and
    field named), a trial outside the split."""
    if not Path(job_dir).is_dir():
        raise InputError(f"harbor-import: params.job_dir {job_dir} does not exist (give <jobs dir>/<job name>)")
    store = shared_store(settings.store_url())
    ids = frozen_split(store, freeze_name, split)[1] if freeze_name is not None else None
    found = harbor_import.import_harbor_job(job_dir, store, job_id=job_id, instance_ids=ids, run_id=run_id,
                                            freeze_name=freeze_name, split=split if freeze_name is not None else None)
    if freeze_name is not None:
        store.record_job(records.JobRecord(job_id=found.job_id, kind=harbor_import.HARBOR_JOB_KIND,
                                           freeze_name=freeze_name, split=split, run_id=run_id,
                                           params={"job_dir": str(Path(job_dir).resolve())}))
    return found


@task(cache_policy=NO_CACHE)
def read_answers(path: Path) -> tuple[list[tuple[str, str, str]], str]:
    """The rows of an answers file and the file's sha256. Raises InputError: no file, or a bad row (its line and field
    named)."""
    items = judge.load_answer_rows(path)
    return items, sha256_file(path)


@task(cache_policy=NO_CACHE)
def record_judgments(items: list[tuple[str, str, str]], job_id: str, rel_tol: float, abs_tol: float,
                     run_id: str | None) -> list[records.JudgmentRecord]:
    """Judge the rows and record them as ``judgments`` in one transaction (the same job again updates them). Raises
    InputError: a bad tolerance (nothing recorded)."""
    return judge.judge_answers(items, shared_store(settings.store_url()), job_id=job_id, run_id=run_id,
                               rel_tol=rel_tol, abs_tol=abs_tol)


@task(cache_policy=NO_CACHE)
def job_trial_rows(job_id: str) -> list[JSONObject]:
    """One table row per trial of ``job_id``: instance_id, kind, reward, exception_type, exception_message,
    agent_s, verifier_s (seconds)."""
    trials = shared_store(settings.store_url()).trials_for(job_id=job_id)
    return [{"instance_id": t.instance_id, "kind": t.kind, "reward": t.reward, "exception_type": t.exception_type,
             "exception_message": t.exception_message, "agent_s": (t.timings or {}).get("agent_s"),
             "verifier_s": (t.timings or {}).get("verifier_s")} for t in trials]


def _stored_jobs_key(_context: TaskRunContext, parameters: Mapping[str, object]) -> str:
    """Cache key part of :func:`compare_stored_jobs`: a digest of both merged jobs as the store holds them and their
    tasks' repositories (a recovery job, a voided trial or a changed task row is a new key); a job it cannot
    read gives a key that never hits."""
    import hashlib
    import json
    import uuid

    store = shared_store(settings.store_url())
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
    """Compare two stored canary jobs (the markdown embeds ``plot_file``; ``files`` None), cached on what it reads from
    the store (:func:`_stored_jobs_key`) and on this source (a result cached before the interval models became
    ``ConfidenceInterval`` is not read). Raises InputError: as :func:`~forgeflow.evaluation.compare.compare_stored_jobs`
    (missing jobs, other splits)."""
    return compare.compare_stored_jobs(shared_store(settings.store_url()), job_a, job_b,
                                       merge_recovery=merge_recovery, seed=seed, plot_file=plot_file, gate=gate_policy)


@task(cache_policy=NO_CACHE, task_run_name="compare-{job_a}-vs-{job_b}")
def compare_stored(job_a: str, job_b: str, md_path: Path, merge_recovery: bool = True, seed: int = 0,
                   gate_policy: gate.GatePolicy | None = None) -> compare.StoredJobsComparison:
    """Compare two stored canary jobs (with the gate's decision under ``gate_policy``) and write the report at
    ``md_path``, its PNG beside it, and the ``compare-standalone`` artifact. Not cached. Raises InputError: as
    :func:`~forgeflow.evaluation.compare.compare_stored_jobs` (missing jobs, other splits)."""
    result = compare_stored_jobs.fn(job_a, job_b, merge_recovery, seed, gate_policy, md_path.with_suffix(".png").name)
    _write_stored_report(result, md_path)
    return result


def _write_stored_report(result: compare.StoredJobsComparison, md_path: Path) -> Path:
    png_path = md_path.with_suffix(".png")
    return _write_report(result, result.markdown, md_path, (result.job_a.job_id, result.job_b.job_id),
                         "compare-standalone", f"{result.job_a.label} vs {result.job_b.label}",
                         f"\nReport: `{md_path}`; plot: `{png_path}`\n")


def _write_report(result: compare.StoredJobsComparison, markdown: str, md_path: Path, labels: tuple[str, str],
                  artifact_key: str, description: str, artifact_tail: str = "") -> Path:
    """Draw ``result``'s plot at ``md_path`` with suffix ``.png``, write ``markdown`` (embedding it by file name)
    at ``md_path`` and publish it as the artifact ``artifact_key`` (the plot by file URI); the plot's path."""
    from forgeflow.common.fsutil import atomic_write_text
    from tasks.common import markdown_artifact

    png_path = md_path.with_suffix(".png")
    compare.render_plot(result.report_a, result.report_b, result.paired, png_path, *labels)
    atomic_write_text(md_path, markdown)
    artifact_md = markdown.replace(f"]({png_path.name})", f"]({png_path.resolve().as_uri()})")
    markdown_artifact(artifact_key, artifact_md + artifact_tail, description)
    return png_path


@task(cache_policy=NO_CACHE)
def write_stored_comparison(result: compare.StoredJobsComparison, md_path: Path) -> compare.StoredJobsComparison:
    """Write :func:`compare_stored_jobs`'s report at ``md_path``, the PNG beside it, and the ``compare-standalone``
    artifact, anew on every run; ``result`` with ``files`` set (both files with their digests)."""
    plot = _write_stored_report(result, md_path)
    return result.model_copy(update={"files": compare.ComparisonFiles(
        report_path=md_path, report_sha256=sha256_file(md_path), plot_path=plot, plot_sha256=sha256_file(plot))})


@task(cache_policy=NO_CACHE)
def check_promotion_jobs(baseline_job: str, candidate_job: str, gguf_sha256: str, state_path: Path) -> None:
    """Before any comparison: the candidate job canaried the GGUF being promoted and the baseline job the model serving
    now (when a serving state exists), so the gate compares what would be swapped. Raises InputError: a job is not in
    the store, or either digest differs (both named)."""
    from forgeflow.serving.bluegreen import read_state

    store = shared_store(settings.store_url())
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
    """``(base_url, model_sha256, model_alias)``: the serving state's active server (default
    ``$FORGEFLOW_HOME/serving/state.json``), or ``base_url`` + ``model_sha256``, refused when the state records another
    model live at that URL. ``model_alias`` overrides the state's (or the server default ``forgeflow``). Raises
    InputError: ``base_url`` without a 64-hex ``model_sha256``; ``model_sha256`` differs from the GGUF the state file
    records serving at that URL; no state file (without ``base_url``) or an invalid one; PreflightError: the recorded
    server is stopped (without ``base_url``)."""
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
    """``GET base_url/models`` answers with anything but 401/403. Raises PreflightError: no answer; InputError: 401/403:
    the endpoint wants a key (none was sent) or refuses the one sent."""
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
    """What a canary job runs on (:func:`canary_inputs`): one task per id in the split's order (sampled: fewer than
    the split); ``base_url`` without a trailing slash; ``model_sha256`` 64 hex."""

    model_config = ConfigDict(frozen=True)

    sampled: bool
    tasks: list[CanaryTask]
    rows_source: str
    base_url: str
    model_sha256: str
    model_alias: str


@task(cache_policy=NO_CACHE, task_run_name="canary-inputs-{freeze_name}-{split}")
def canary_inputs(freeze_name: str, split: str, sample: int | None, sample_seed: int, source: TaskSource,
                  endpoint: CanaryEndpoint, default_generated: Path, api_key: str | None = None) -> CanaryInputs:
    """What the ``canary`` flow checks before its first trial, in the order a user fixes it: the freeze and its split
    (sampled), the endpoint, the task rows, each task's accepted validation and image, the endpoint's answer. Raises
    InputError: an unknown freeze or split, an endpoint given wrongly or recorded serving another model
    (:func:`resolve_endpoint`), rows that cannot be read, a 401/403 from the endpoint; PreflightError: tasks that cannot
    run (listed), a stopped or silent endpoint."""
    store = shared_store(settings.store_url())
    _, ids = frozen_split(store, freeze_name, split)
    kept = sample_split(ids, sample, sample_seed)
    url, sha, alias = resolve_endpoint(endpoint)
    loaded = source.load(default_generated, "canary")
    tasks = canary_tasks(store, kept, loaded.rows, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers)
    check_reachable(url, api_key)
    return CanaryInputs(sampled=len(kept) < len(ids), tasks=tasks, rows_source=loaded.source,
                        base_url=url, model_sha256=sha, model_alias=alias)


@task(cache_policy=NO_CACHE, task_run_name="plan-recovery-{job_id}")
def plan_recovery(job_id: str, exception_types: Sequence[str] | None,
                  recovery_job_id: str | None) -> CanaryRecoveryPlan:
    """:func:`forgeflow.evaluation.canary.plan_canary_recovery` on the store (reads only). Raises as it does."""
    store = shared_store(settings.store_url())
    return plan_canary_recovery(store, job_id, list(exception_types) if exception_types else None,
                                recovery_job_id)


@task(cache_policy=NO_CACHE, task_run_name="merged-view-{job_id}")
def merged_view(job_id: str) -> MergedView:
    """Canary job ``job_id`` merged with its recovery jobs now: its label, recovery job ids and report."""
    return MergedView.of(compare.merged_job(shared_store(settings.store_url()), job_id))


@task(cache_policy=NO_CACHE)
def recovery_inputs(plan: CanaryRecoveryPlan, endpoint: CanaryEndpoint, candidates_path: Path | None,
                    generated_path: Path | None, default_generated: Path, dataset: DatasetSource | None,
                    test_commands: dict[str, str] | None, test_specs: dict[str, TestSpec],
                    api_key: str | None = None) -> tuple[CanaryInputs, TaskRows]:
    """What a ``canary-recover`` run re-runs, checked before its first trial: the endpoint serves the original job's
    model, the task rows, each task's accepted validation and image, the endpoint's answer. Raises InputError: the
    endpoint serves another model than the job's, rows that cannot be read, a 401/403; PreflightError: a task cannot run
    (listed), the endpoint does not answer."""
    original = plan.original
    url, sha, alias = resolve_endpoint(endpoint.model_copy(update={
        "model_sha256": endpoint.model_sha256 or original.model_sha256,
        "model_alias": endpoint.model_alias or original.params.get("model_alias")}))
    if sha != original.model_sha256:
        raise InputError(f"canary-recover: the endpoint serves model {sha}, but job {original.job_id!r} evaluated "
                         f"{original.model_sha256}: a recovery re-runs the same model")
    loaded = load_task_rows(candidates_path, generated_path, default_generated, test_commands,
                            stage="canary-recover", dataset=dataset, test_specs=test_specs)
    store = shared_store(settings.store_url())
    tasks = canary_tasks(store, plan.instance_ids, loaded.rows, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers)
    check_reachable(url, api_key)
    return CanaryInputs(sampled=False, tasks=tasks, rows_source=loaded.source,
                        base_url=url, model_sha256=sha, model_alias=alias), loaded


@task(cache_policy=NO_CACHE)
def write_job_report(markdown: str, report_path: Path, artifact_key: str, description: str) -> Path:
    """Write a canary job's markdown report at ``report_path`` and publish it as ``artifact_key``; the path."""
    from forgeflow.common.fsutil import atomic_write_text
    from tasks.common import markdown_artifact

    path = atomic_write_text(report_path, markdown)
    markdown_artifact(artifact_key, markdown, description)
    return path


@task(cache_policy=NO_CACHE, persist_result=False)
def endpoint_api_key(endpoint: CanaryEndpoint) -> str | None:
    """The canary endpoint's API key: its ``api_key_secret`` block's, else the serving state's external endpoint's, else
    None (``$FORGEFLOW_MODEL_API_KEY`` applies). Never persisted. Raises InputError: the Secret block does not exist or
    is empty."""
    from blocks.core import secret_token
    from forgeflow.common.settings import home_dir
    from forgeflow.serving import bluegreen

    name = endpoint.api_key_secret
    if name is None and endpoint.base_url is None:
        state = bluegreen.read_state(Path(endpoint.state_path or home_dir() / "serving" / "state.json"))
        name = state.api_key_secret if state is not None else None
    return secret_token(name, "canary endpoint api_key_secret").get_secret_value() if name else None
