"""A small real curate run: task images of two pinned projects, NOP/Oracle in podman, until the
freeze-ready event; then again (nothing new), then recover one batch (dry run, then for real)."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PROJECTS = ("inflection", "toolz")  # two repos: splits are repository-disjoint


@pytest.fixture(scope="module")
def candidates_jsonl(tmp_path_factory) -> Path:
    """Two swesmith candidates per project as task images, built the way flows/lifecycle.py does."""
    from forgeflow.common.settings import apply_container_env
    from forgeflow.curation import bugs
    from forgeflow.registry import images, projects

    apply_container_env()
    work = tmp_path_factory.mktemp("curate-candidates")
    base = images.ensure_base_image()
    rows = []
    for name in PROJECTS:
        project = projects.get_project(name)
        checkout = projects.prepare_checkout(project, work / "checkouts" / name)
        env = images.build_env_image(project, checkout, base.name)
        for candidate in bugs.generate_candidates(name, checkout, project.source_path, 2, 0):
            task_image = images.build_task_image(env.name, candidate.instance_id, candidate.patch)
            # the claimed FAIL_TO_PASS of a generated bug is unknown before validation; curate records
            # the measured lists, so the claim here is the project's test folder
            rows.append({"instance_id": candidate.instance_id, "repo": name, "patch": candidate.patch,
                         "image": task_image.name, "FAIL_TO_PASS": [project.tests_path], "PASS_TO_PASS": []})
    path = work / "candidates.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read_events(name: str, since: datetime) -> list:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(EventFilter(event=EventNameFilter(name=[name]),
                                              occurred=EventOccurredFilter(since=since)), limit=50)
    return page.events


def test_curate_runs_until_freeze_ready_then_skips_processed_and_recovers(
        prefect_harness, candidates_jsonl: Path, tmp_path: Path, monkeypatch, flow_store_url: str) -> None:
    from prefect.events.worker import EventsWorker

    from flows.curate import FREEZE_READY_EVENT, CurateParams, curate, recover
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.recovery import RecoveryRequest
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    quotas = SplitQuotas(train=1, validation=0, test=1, min_repos=1, max_per_repo=3)
    started = datetime.now(UTC) - timedelta(seconds=5)

    source = TaskSource(candidates_path=candidates_jsonl)
    settings = CurateSettings(batch_size=2, concurrency=2, verifier_timeout_s=120, seed=0)
    first = curate(CurateParams(source=source, quotas=quotas, settings=settings))
    assert first.status == "freeze-ready" and first.batches and first.event_id
    assert first.counts["train"] >= 1 and first.counts["test"] >= 1

    store = Store()
    trials = store.trials_for(job_id="curate")
    per_task = Counter((t.instance_id, t.kind) for t in trials)
    assert len({t.trial_id for t in trials}) == len(trials) == first.trials_recorded  # each trial recorded once
    assert all(n <= 2 for (_, kind), n in per_task.items())  # up to 2 NOP and 2 Oracle runs each
    accepted = {t.instance_id for t in store.accepted_tasks()}
    # every accepted task ran its NOP (each FAIL_TO_PASS test failing every time) and its Oracle twice
    assert all(per_task[(iid, "oracle")] == per_task[(iid, "nop")] == 2 for iid in accepted)
    for task in store.accepted_tasks():  # what the canary and RL verifiers check a submission's run against
        graded = {*task.FAIL_TO_PASS, *task.PASS_TO_PASS}
        assert graded and graded <= set(task.known_tests) and task.known_tests == sorted(task.known_tests)
        oracle_s = [t.timings["verifier_s"] for t in trials if t.instance_id == task.instance_id and t.kind == "oracle"]
        assert len(oracle_s) == 2 and task.pristine_duration_s == max(oracle_s) > 0
    assert {t.batch_id for t in trials} == set(first.batches)
    assert len(store.accepted_tasks()) >= 2
    patches = {json.loads(line)["instance_id"]: json.loads(line)["patch"]
               for line in candidates_jsonl.read_text().splitlines()}
    assert {t.instance_id: t.patch for t in store.tasks()} == patches  # the freeze bundle takes them from here

    EventsWorker.drain_all()
    deadline = time.monotonic() + 60
    events = []
    while time.monotonic() < deadline:
        events = [e for e in _read_events(FREEZE_READY_EVENT, started) if str(e.id) == first.event_id]
        if events:
            break
        time.sleep(1)
    assert events, "the freeze-ready event was not found through the events API"
    assert events[0].resource.id.startswith("forgeflow.store.")
    assert events[0].payload["counts"] == first.counts
    # what the freeze-on-ready automation freezes with: this run's name, quotas, seed and candidates
    assert events[0].payload["freeze_name"] == first.freeze_name and first.freeze_name.startswith("curate-")
    assert events[0].payload["quotas"] == quotas.model_dump() and events[0].payload["seed"] == 0
    from forgeflow.curation.run_reads import candidate_set_ids  # the event names the run's candidates by reference
    assert candidate_set_ids(store.engine, events[0].payload["candidate_set"]) == sorted(
        json.loads(line)["instance_id"] for line in candidates_jsonl.read_text().splitlines())

    assert set(first.validated) == {t.instance_id for t in trials}  # what this run validated, nothing else
    # a caller that freezes itself (the lifecycle) asks for no event: ready, nothing validated, no event
    second = curate(CurateParams(source=source, quotas=quotas, settings=settings, emit_freeze_ready=False))
    assert second.status == "freeze-ready" and second.batches == [] and second.validated == []
    assert second.event_id is None
    assert len(store.trials_for(include_void=True)) == len(trials)  # processed candidates are skipped

    # recovery of a batch that had no infrastructure fault voids nothing: real outcomes stay
    dry = recover(RecoveryRequest(reason="test: nothing broke", batch_ids=first.batches[:1]))
    assert dry.dry_run and dry.void == [] and dry.requeue == [] and dry.kept
    done = recover(RecoveryRequest(reason="test: nothing broke", batch_ids=first.batches[:1], dry_run=False))
    assert done.voided == 0 and len(store.accepted_tasks()) >= 2


def test_candidates_that_cannot_fill_the_splits_are_refused_before_any_validation(
        prefect_harness, tmp_path: Path, monkeypatch, flow_store_url: str) -> None:
    """Two repositories cannot fill three repository-disjoint splits: curate says so at once, before
    it checks an image or runs a trial, and records nothing."""
    from flows.curate import CurateParams, curate
    from forgeflow.common.errors import InputError, PreflightError
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    patch = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    rows = [{"instance_id": f"{repo.replace('/', '__')}.bug{n}", "repo": repo, "patch": patch, "image": "localhost/none/such:1",
             "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "test_command": "pytest -rA"}
            for repo in ("team/alpha", "team/beta") for n in range(3)]
    path = tmp_path / "two-repos.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    store = Store()
    store.upgrade()
    before = len(store.tasks())
    quotas = SplitQuotas(train=1, validation=1, test=1, max_per_repo=3, min_repos=1)
    with pytest.raises(PreflightError, match=r"6 candidates from 2 repositories cannot meet the quotas .*"
                                             r"repository-disjoint splits .*need 3, at most 2 possible"):
        curate(CurateParams(source=TaskSource(candidates_path=path), quotas=quotas, settings=CurateSettings(batch_size=2, concurrency=1)))
    assert len(store.tasks()) == before  # nothing recorded, no trial run
    # only the given candidates count: one repository's three cannot fill two repository-disjoint splits
    alpha = tuple(row["instance_id"] for row in rows if row["repo"] == "team/alpha")
    with pytest.raises(PreflightError, match=r"3 candidates from 1 repositories cannot meet the quotas"):
        curate(CurateParams(source=TaskSource(candidates_path=path), instance_ids=alpha,
                            quotas=quotas.model_copy(update={"validation": 0})))
    with pytest.raises(InputError, match=r"params.instance_ids: 1 id\(s\) not among the candidates of .*"
                                         r"two-repos.jsonl: team__alpha.bug9"):
        curate(CurateParams(source=TaskSource(candidates_path=path), instance_ids=(*alpha, "team__alpha.bug9"),
                            quotas=quotas.model_copy(update={"validation": 0})))
    assert len(store.tasks()) == before


def test_a_sandbox_block_chooses_where_the_trials_run(prefect_harness, candidates_jsonl: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    """curate's trials run on the backend of the ``forgeflow-sandbox`` block it is given: a
    ``kubernetes`` block on a machine with no cluster configuration makes every validation an
    infrastructure error naming Kubernetes (never a rejection, never podman instead); a missing
    block or an unknown kind is refused before any trial."""
    from blocks.core import SandboxBackend
    from flows.curate import CurateParams, curate
    from forgeflow.common.errors import InputError
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'k8s-store.db'}")
    source = TaskSource(candidates_path=candidates_jsonl)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    quotas = SplitQuotas(train=1, validation=0, test=1, min_repos=1, max_per_repo=3)
    with pytest.raises(InputError, match="params.sandbox: sandbox block 'no-such-sandbox' does not exist"):
        curate(CurateParams(source=source, quotas=quotas, sandbox="no-such-sandbox"))
    # an unknown kind is refused where a block is made; one saved from the UI's form is refused where it is loaded
    SandboxBackend.model_construct(kind="firecracker").save("test-bad-kind-sandbox", overwrite=True)
    with pytest.raises(InputError, match="unknown sandbox backend 'firecracker'; valid kinds: kubernetes, podman"):
        curate(CurateParams(source=source, quotas=quotas, sandbox="test-bad-kind-sandbox"))
    store = Store()
    store.upgrade()
    assert store.trials_for(include_void=True) == []  # refused before any trial

    # a block name of its own: the block is part of the validations' cache key, so an earlier run of
    # this test in the same Prefect home cannot answer from its cache
    block = f"test-k8s-sandbox-{uuid.uuid4().hex[:8]}"
    SandboxBackend(kind="kubernetes", memory_mb=512, cpus=0.5).save(block, overwrite=True)
    out = curate(CurateParams(source=source, quotas=quotas, settings=CurateSettings(batch_size=4, concurrency=2, max_retries=0),
                 sandbox=block))
    assert out.status == "exhausted"
    tasks = store.tasks()
    assert tasks and all(t.status == "error" for t in tasks), [(t.instance_id, t.status) for t in tasks]
    assert all("no Kubernetes configuration" in t.reason for t in tasks), tasks[0].reason
    trials = store.trials_for(include_void=True)
    assert trials and all(t.exception_type == "SandboxError" and t.reward is None for t in trials)


def test_the_curate_flow_takes_typed_parameter_groups() -> None:
    """The flow's signature, read without running it: one ``params`` (:class:`flows.curate.CurateParams`) whose
    fields are the task source, quotas and settings as models, the freeze name and block names beside them."""
    import inspect

    from flows.curate import CurateParams, curate
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource

    parameters = inspect.signature(curate.fn).parameters
    assert list(parameters) == ["params"] and parameters["params"].default == CurateParams()
    assert list(CurateParams.model_fields) == ["source", "quotas", "settings", "freeze_name", "sandbox", "dispatcher",
                                               "instance_ids", "emit_freeze_ready"]
    defaults = CurateParams()
    assert defaults.source == TaskSource() and defaults.settings == CurateSettings()
    assert isinstance(defaults.quotas, SplitQuotas)
