"""The standalone ``canary`` flow in real flow runs (session Prefect harness): a freeze recorded in
the store, the generated-candidates file, real podman sandboxes, mini-swe-agent and the verifier.

The model is the scripted OpenAI-compatible loopback server of ``tests/integration/
test_agent_supervision.py`` (a real tiny model cannot be made to fix the bug on demand); the rest
is real. Checks: one ``jobs`` row (kind canary, freeze, split, model sha256) with its trials, the
job-report artifact, the concurrency guard (default 4, ``verified`` 10) refusing before any work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from pydantic import ValidationError  # noqa: E402
from test_agent import BUG_PATCH, F2P, P2P, TEST_COMMAND, task_image  # noqa: E402,F401 - fixture
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402

from forgeflow.common.errors import InputError, PreflightError  # noqa: E402
from forgeflow.curation.task_rows import TaskSource  # noqa: E402
from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIX = "sed -i 's/a - b/a + b/' calc.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MODEL_SHA = "d" * 64
AGENT = {"step_limit": 5, "agent_timeout_s": 120, "memory_mb": 512}
# two repositories, two tasks each: the freeze puts one repository in train and the other in test
TASKS = {f"calc{r}.func_pm_op_swap__0000000{i}": f"calc{r}" for r, i in (("a", 1), ("a", 2), ("b", 3), ("b", 4))}


def _at(url: str, model_sha256: str | None = MODEL_SHA) -> CanaryEndpoint:
    """The endpoint ``url`` serving ``model_sha256``."""
    return CanaryEndpoint(base_url=url, model_sha256=model_sha256)


def _settings(agent: dict = AGENT, **settings) -> CanaryRunSettings:
    """The run settings of these tests: ``agent``'s limits, a verifier timeout of 120 s."""
    return CanaryRunSettings(agent_config=agent, verifier_timeout_s=120.0, **settings)


@pytest.fixture()
def recorded_freeze(task_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A store with four accepted tasks frozen as ``canary-test``, and their candidates file."""
    from forgeflow.curation import freeze
    from forgeflow.curation.generated import GeneratedTask, write_generated
    from forgeflow.ledger.records import FreezeRecord, TaskRecord
    from forgeflow.ledger.store import Store
    from forgeflow.registry import images

    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    store = Store()
    store.upgrade()
    for instance_id, repo in TASKS.items():
        store.record_task(TaskRecord(instance_id=instance_id, repo=repo, image_ref=task_image, status="accepted",
                                     FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P))
    quotas = freeze.SplitQuotas(train=1, validation=0, test=1, max_per_repo=2, min_repos=2)
    selection = freeze.select_splits([freeze.TaskRef(instance_id=i, repo=r) for i, r in TASKS.items()], quotas, 0)
    manifest = freeze.write_freeze("canary-test", selection, quotas, 0, tmp_path / "freezes")
    store.record_freeze(FreezeRecord(name=manifest.name, semantic_sha256=manifest.semantic_sha256,
                                     file_sha256=manifest.file_sha256, manifest_path=str(manifest.path),
                                     counts=manifest.counts))
    image_id = images.image_id(task_image)
    generated = write_generated(tmp_path / "candidates.jsonl", [
        GeneratedTask(instance_id=i, repo=r, patch=BUG_PATCH, modifier="func_pm_op_swap", file_path="calc.py",
                      func_name="add", image=task_image, image_id=image_id, test_command=TEST_COMMAND)
        for i, r in TASKS.items()])
    return store, manifest, generated


def test_canary_records_a_job_with_its_trials_and_publishes_the_job_report(prefect_harness, recorded_freeze,
                                                                            tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.canary import REPORT_ARTIFACT_KEY, CanaryParams, canary
    from forgeflow.evaluation.canary import sample_split

    store, manifest, generated = recorded_freeze
    test_ids = manifest.splits["test"]
    assert len(test_ids) == 2
    common = dict(freeze_name="canary-test", source=TaskSource(generated_path=generated), out_dir=tmp_path / "canary")
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        result = canary(CanaryParams(endpoint=_at(url), run=_settings(concurrency=2), **common))
    assert len(bodies) == 2, "one agent run (one model call) per test task"
    job_id = f"canary-canary-test-test-{MODEL_SHA[:12]}"
    assert result.job_id == job_id
    assert (result.report.requested, result.report.scored, result.report.reward_1) == (2, 2, 2)
    job = store.get_job(job_id)
    assert (job.kind, job.freeze_name, job.split, job.model_sha256) == ("canary", "canary-test", "test", MODEL_SHA)
    assert job.params["concurrency"] == 2 and job.params["profile"] == "default"
    trials = store.trials_for(job_id=job_id)
    assert sorted(t.instance_id for t in trials) == sorted(test_ids)
    assert all(t.kind == "agent" and t.reward == 1.0 and t.model_sha256 == MODEL_SHA for t in trials)
    report = result.report_path.read_text()
    assert "| 2 | 2 | 0 | 2 | 0 | 100.0% | 100.0% |" in report  # requested, scored, exceptions, reward 1/0, rates
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[REPORT_ARTIFACT_KEY])))
    assert any(job_id in (a.data or "") and "| 2 | 2 | 0 | 2 | 0 |" in a.data for a in artifacts)

    # the guard: 5 at once is above the default profile's 4, refused where the run's params are parsed (the
    # field named), so before any work; an unknown profile is refused by the flow, naming params.run.concurrency
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        with pytest.raises(ValidationError, match=r"concurrency\n  Value error, canary concurrency 5 is above the "
                                                  r"limit 4 of profile 'default'; profile 'verified' allows up to 10"):
            _settings(concurrency=5)
        with pytest.raises(ValidationError, match=r"concurrency 11 is above the limit 10 of profile 'verified'"):
            _settings(concurrency=11, profile="verified")
        with pytest.raises(InputError, match=r"params.run.concurrency: canary profile 'fast' is unknown"):
            canary(CanaryParams(endpoint=_at(url), run=_settings(profile="fast"), job_id="refused", **common))
        assert bodies == [] and store.get_job("refused") is None
        # the verified profile allows 5 (a new job: its own trajectories folder, so the trials run again)
        again = canary(CanaryParams(endpoint=_at(url), run=_settings(concurrency=5, profile="verified"), job_id="verified-5",
                       **common))
    assert len(bodies) == 2 and again.report.reward_1 == 2
    assert store.get_job("verified-5").params["profile"] == "verified"

    # a seeded sample of the split: one task, the one sample_split draws, under its own job id
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        sampled = canary(CanaryParams(endpoint=_at(url), run=_settings(sample=1, sample_seed=7), **common))
    assert sampled.job_id == f"{job_id}-s1x7" and len(bodies) == 1
    assert [t.instance_id for t in sampled.trials] == sample_split(test_ids, 1, 7)
    assert store.get_job(sampled.job_id).params["sample"] == 1


def test_canary_on_the_users_candidates_gives_the_agent_each_rows_problem_statement(
        prefect_harness, recorded_freeze, task_image: str, tmp_path: Path) -> None:
    """The candidates JSONL a team curated (SWE-bench-style rows with their own issue text and test
    command, no generated file): the agent is prompted with the row's problem statement."""
    import json

    from flows.canary import CanaryParams, canary

    store, manifest, _ = recorded_freeze
    rows = [{"instance_id": i, "repo": r, "patch": BUG_PATCH, "image": task_image, "FAIL_TO_PASS": F2P,
             "PASS_TO_PASS": P2P, "test_command": TEST_COMMAND,
             "problem_statement": f"Issue {n}: calc.add returns the difference of its arguments, not their sum."}
            for n, (i, r) in enumerate(TASKS.items())]
    path = tmp_path / "team-candidates.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        result = canary(CanaryParams(freeze_name="canary-test", endpoint=_at(url), source=TaskSource(candidates_path=path),
                        job_id="team-rows", out_dir=tmp_path / "canary", run=_settings()))
    assert result.report.reward_1 == 2
    prompts = [" ".join(m["content"] for m in body["messages"] if m["role"] == "user") for body in bodies]
    statements = {row["instance_id"]: row["problem_statement"] for row in rows}
    for instance_id in manifest.splits["test"]:
        assert sum(statements[instance_id] in prompt for prompt in prompts) == 1, instance_id
    assert store.get_job("team-rows").params["candidates_path"] == str(path)


def test_canary_refuses_unknown_freeze_split_and_missing_endpoint(prefect_harness, recorded_freeze,
                                                                  tmp_path: Path) -> None:
    from flows.canary import CanaryParams, canary

    _, _, generated = recorded_freeze
    rows, dead = TaskSource(generated_path=generated), _at("http://127.0.0.1:9/v1")
    with pytest.raises(InputError, match="freeze 'nope' is not recorded in the store"):
        canary(CanaryParams(freeze_name="nope", endpoint=dead, source=rows))
    with pytest.raises(InputError, match=r"has no split 'dev'; its splits: \["):
        canary(CanaryParams(freeze_name="canary-test", split="dev", endpoint=dead, source=rows))
    with pytest.raises(InputError, match="no serving state at .*state.json"):
        canary(CanaryParams(freeze_name="canary-test", source=rows))
    with pytest.raises(InputError, match="needs params.endpoint.model_sha256"):
        canary(CanaryParams(freeze_name="canary-test", endpoint=_at("http://127.0.0.1:9/v1", None), source=rows))
    with pytest.raises(PreflightError, match=r"the model endpoint http://127.0.0.1:9/v1 does not answer"):
        canary(CanaryParams(freeze_name="canary-test", endpoint=dead, source=rows))
    # a serving state that records another model at that URL: refused before the endpoint is asked
    from forgeflow.common.fsutil import atomic_write_json
    from forgeflow.serving.bluegreen import ServingState

    state_path = atomic_write_json(tmp_path / "serving" / "state.json", ServingState(
        generation=1, active_port=9, gguf_path=tmp_path / "other.gguf", gguf_sha256="e" * 64, pid=4242,
        base_url="http://127.0.0.1:9/v1").model_dump(mode="json"))
    with pytest.raises(InputError, match=f"model_sha256 {MODEL_SHA} differs from the GGUF {'e' * 64}"):
        canary(CanaryParams(freeze_name="canary-test", source=rows, endpoint=CanaryEndpoint(
            state_path=state_path, base_url="http://127.0.0.1:9/v1", model_sha256=MODEL_SHA)))


def test_canary_runs_its_verifier_on_the_sandbox_block(prefect_harness, recorded_freeze, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``sandbox`` names a ``forgeflow-sandbox`` block: its backend runs the agent's container and the
    verifier; the job records the limits its trials ran with: the agent config's own memory (set), the
    block's CPUs (left none; docs/verifier.md, "Sandbox limits"). With ``kind: kubernetes`` and no cluster
    reachable from here (no kubeconfig), every trial's first container (the agent's) fails to start:
    each trial is a SandboxError exception with no reward, never a 0."""
    from blocks.core import SandboxBackend
    from flows.canary import CanaryParams, canary

    store, _, generated = recorded_freeze
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    SandboxBackend(kind="podman", memory_mb=768, cpus=0.5).save("canary-small", overwrite=True)
    SandboxBackend(kind="kubernetes").save("canary-cluster", overwrite=True)
    common = dict(freeze_name="canary-test", source=TaskSource(generated_path=generated), out_dir=tmp_path / "canary",
                  run=_settings({"step_limit": 5, "agent_timeout_s": 120, "memory_mb": 512}))
    with pytest.raises(InputError, match="params.sandbox: sandbox block 'nope' does not exist"):
        canary(CanaryParams(endpoint=_at("http://127.0.0.1:9/v1"), sandbox="nope", **common))
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, _):
        small = canary(CanaryParams(endpoint=_at(url), sandbox="canary-small", job_id="small", **common))
        cluster = canary(CanaryParams(endpoint=_at(url), sandbox="canary-cluster", job_id="cluster", **common))
    assert small.report.reward_1 == 2
    recorded = store.get_job("small").params["agent_config"]
    assert (recorded["verifier_backend"], recorded["memory_mb"], recorded["cpus"]) == ("podman", 512, 0.5)
    assert store.get_job("cluster").params["agent_config"]["verifier_backend"]["kind"] == "kubernetes"
    assert [(t.exception_type, t.reward) for t in cluster.trials] == [("SandboxError", None)] * 2
    assert cluster.report.reward_0 == 0


def test_canary_verifies_in_pods_through_the_kubernetes_api(prefect_harness, recorded_freeze, tmp_path: Path) -> None:
    """The canary with a ``kubernetes`` sandbox block pointed at a loopback fake of the Kubernetes API
    (tests/fakes/kubernetes_api.py: a fake of the API that runs pods with podman, not a cluster):
    each verifier runs in a pod created, exec'd and deleted through the official client, with the
    same rewards as on podman, and no pod is left."""
    from blocks.core import SandboxBackend
    from flows.canary import CanaryParams, canary
    from tests.kubefake import kubernetes_api

    store, _, generated = recorded_freeze
    with kubernetes_api(tmp_path) as fake, scripted_endpoint(lambda i: text_answer(FIX)) as (url, _):
        SandboxBackend(kind="kubernetes", memory_mb=768, kubeconfig=str(fake.kubeconfig)).save(
            "canary-fake-cluster", overwrite=True)
        result = canary(CanaryParams(freeze_name="canary-test", endpoint=_at(url), source=TaskSource(generated_path=generated),
                        out_dir=tmp_path / "canary", sandbox="canary-fake-cluster", job_id="pods",
                        run=_settings({"step_limit": 5, "agent_timeout_s": 120})))
        assert fake.pods() == [] and fake.containers() == []
    assert [(t.exception_type, t.reward) for t in result.trials] == [(None, 1.0)] * 2
    assert result.report.reward_1 == 2
    recorded = store.get_job("pods").params["agent_config"]["verifier_backend"]
    assert (recorded["kind"], recorded["namespace"], recorded["kubeconfig"]) == \
        ("kubernetes", "forgeflow", str(fake.kubeconfig))


def test_canary_runs_the_agents_commands_in_pods_through_the_kubernetes_api(prefect_harness, recorded_freeze,
                                                                            tmp_path: Path) -> None:
    """The ``kubernetes`` sandbox block runs the agent's own container as a pod too, not only the
    verifier's. The Kubernetes side is the loopback fake of the API (tests/fakes/kubernetes_api.py):
    a fake of the API that runs each pod's container with podman, not a cluster; every call goes
    through the official client. What the fake recorded: per trial one agent pod (created, exec'd:
    the process listing, ``git rev-parse``, the scripted model's fix, ``tar`` in its ``tree`` sidecar) and one verifier
    pod, both labelled with the flow run (the cancel sweep finds them), every pod deleted; the
    trials score 1 because the fix made in the agent's pod is the submission."""
    import json

    from blocks.core import SandboxBackend
    from flows.canary import CanaryParams, canary
    from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL
    from tests.kubefake import kubernetes_api

    store, _, generated = recorded_freeze
    with kubernetes_api(tmp_path) as fake, scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        SandboxBackend(kind="kubernetes", memory_mb=768, kubeconfig=str(fake.kubeconfig)).save(
            "canary-agent-pods", overwrite=True)
        result = canary(CanaryParams(freeze_name="canary-test", endpoint=_at(url), source=TaskSource(generated_path=generated),
                        out_dir=tmp_path / "canary", sandbox="canary-agent-pods", job_id="agent-pods",
                        run=_settings({"step_limit": 5, "agent_timeout_s": 120}, concurrency=2)))
        calls = fake.calls()
        assert fake.pods() == [] and fake.containers() == []
    assert len(bodies) == 2, "one model call per trial"
    assert [(t.exception_type, t.reward) for t in result.trials] == [(None, 1.0)] * 2
    created = {c["name"]: c["labels"] for c in calls if c["verb"] == "create"}
    agent_pods = sorted(n for n in created if n.startswith("ff-agentenv-"))
    verifier_pods = sorted(n for n in created if n.startswith("ff-agent-") and n not in agent_pods)
    assert len(agent_pods) == 2 and len(verifier_pods) == 2 and len(created) == 4, sorted(created)
    job = store.get_job("agent-pods")
    assert all(labels[FLOW_RUN_LABEL] == job.run_id for labels in created.values())
    assert sorted(c["name"] for c in calls if c["verb"] == "delete") == sorted(created), "every pod deleted"
    for pod in agent_pods:
        argvs = [" ".join(c["command"]) for c in calls if c["verb"] == "exec" and c["name"] == pod]
        assert any("sed -i 's/a - b/a + b/' calc.py" in a for a in argvs), f"the model's command ran in {pod}"
        # the submission: the tree taken by tar in the pod's pristine "tree" sidecar, never the agent's git
        assert not any(" diff " in a for a in argvs), argvs
        assert [c["container"] for c in calls if c["verb"] == "exec" and c["name"] == pod
                and c["command"][0] == "tar"] == ["tree"]
        order = [(c["verb"], c["name"]) for c in calls]
        assert order.index(("create", pod)) < order.index(("delete", pod))
    for pod in verifier_pods:  # the agent's tree is sent to the verifier's own pod (stdin), put in place there
        # and what changed read from git's own listing
        execs = [c for c in calls if c["verb"] == "exec" and c["name"] == pod]
        assert any(c["stdin"] for c in execs)
        assert any("tar -x" in a and "diff-tree -r -z --no-renames --raw" in a for a in (" ".join(c["command"])
                                                                                         for c in execs))
    recorded = job.params["agent_config"]
    assert recorded["sandbox_backend"]["kind"] == recorded["verifier_backend"]["kind"] == "kubernetes"
    trajectories = sorted(Path(job.params["trajectories_dir"]).glob("*.traj.json"))
    assert len(trajectories) == 2
    for path in trajectories:
        environment = json.loads(path.read_text())["info"]["config"]["environment"]
        assert environment["backend"] == "kubernetes" and environment["name"] in agent_pods


def test_canary_sends_the_key_of_an_endpoint_that_needs_one_and_records_it_nowhere(
        prefect_harness, recorded_freeze, tmp_path: Path) -> None:
    """An endpoint started with an API key (as vLLM or llama-server with --api-key): without a key the canary is
    refused before any trial; with the endpoint's Secret block (given, or recorded by the serve flow in the serving
    state of an external endpoint) every trial's model calls carry it and the key lands in no record."""
    import json
    import os

    from prefect.blocks.system import Secret

    from flows.canary import CanaryParams, canary
    from forgeflow.common.fsutil import atomic_write_json
    from forgeflow.serving.bluegreen import ServingState

    key = "sk-team-" + "7f3a" * 6
    Secret(value=key).save("canary-endpoint-key", overwrite=True)
    store, _, generated = recorded_freeze
    common = {"freeze_name": "canary-test", "run": _settings(), "source": TaskSource(generated_path=generated),
              "out_dir": tmp_path / "out"}
    with scripted_endpoint(lambda i: text_answer(FIX), api_key=key) as (url, bodies):
        with pytest.raises(InputError, match=r"answered HTTP 401 to a request without a key: give params.endpoint.api_key_secret"):
            canary(CanaryParams(endpoint=_at(url), job_id="no-key", **common))
        assert bodies == [] and store.get_job("no-key") is None  # refused before any trial
        given = canary(CanaryParams(endpoint=CanaryEndpoint(base_url=url, model_sha256=MODEL_SHA,
                                               api_key_secret="canary-endpoint-key"), job_id="given-key", **common))
        # the serve flow's record of an external endpoint names the key's Secret block: the canary's default
        state_path = tmp_path / "serving" / "state.json"
        atomic_write_json(state_path, ServingState(
            generation=1, active_port=int(url.split(":")[-1].split("/")[0]), gguf_path=generated,
            gguf_sha256=MODEL_SHA, model_alias="scripted", base_url=url, external=True,
            api_key_secret="canary-endpoint-key").model_dump(mode="json"))
        recorded = canary(CanaryParams(endpoint=CanaryEndpoint(state_path=state_path), job_id="state-key", **common))
    for result in (given, recorded):
        assert (result.report.requested, result.report.scored, result.report.reward_1) == (2, 2, 2)
    assert len(bodies) == 4 and "FORGEFLOW_MODEL_API_KEY" not in os.environ  # restored after each run
    for job_id in ("given-key", "state-key"):
        assert key not in json.dumps(store.get_job(job_id).params)
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path
