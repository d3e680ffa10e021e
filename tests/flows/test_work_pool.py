"""The ``k8s`` work pools (deployments/work_pool.py): templates from prefect-kubernetes, judged by it.

No Kubernetes API server runs here: the Job a flow run would get is built by prefect-kubernetes's
``KubernetesWorkerJobConfiguration`` (``from_template_and_values`` + ``prepare_for_flow_run``, as
its worker does) and then deserialized with the official ``kubernetes`` client's models. Creating
and updating the pool runs against the session's real Prefect server.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments import work_pool
from deployments.cli import app
from forgeflow.common.errors import InputError
from forgeflow.sandbox import kubernetes_manifests

runner = CliRunner()
# Prefect's default Job template sets these on the pod spec, where V1PodSpec has no such fields
IMAGE = "registry.example.com/forgeflow/worker:0.1.0"


def _container_env(config) -> dict[str, str]:
    return {e["name"]: e["value"] for e in config.job_manifest["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("pool", [work_pool.POOL, work_pool.GPU_POOL])
def test_committed_templates_are_the_generators_output(pool: str) -> None:
    assert work_pool.TEMPLATE_FILES[pool].read_text() == work_pool.template_text(work_pool.base_job_template(pool)), \
        "regenerate with `python -m deployments.cli work-pool template --write-infra`"


@pytest.mark.parametrize("pool", [work_pool.POOL, work_pool.GPU_POOL])
def test_templates_keep_prefect_kubernetes_default_where_forgeflow_changes_nothing(pool: str) -> None:
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    ours = work_pool.base_job_template(pool)
    changed, added = work_pool._forgeflow_variables(pool, work_pool.RESULT_STORAGE_BLOCK)
    props = ours["variables"]["properties"]
    assert set(default["variables"]["properties"]) | set(added) == set(props)
    for name, schema in default["variables"]["properties"].items():
        expected = {**schema, **changed.get(name, {})}
        assert props[name] == expected, name
    assert ours["variables"]["definitions"] == default["variables"]["definitions"]
    assert {k: v for k, v in ours["job_configuration"].items() if k not in {"env", "job_manifest"}} == \
        {k: v for k, v in default["job_configuration"].items() if k not in {"env", "job_manifest"}}
    manifest, base = ours["job_configuration"]["job_manifest"], default["job_configuration"]["job_manifest"]
    assert manifest["metadata"] == base["metadata"]
    assert {k: v for k, v in manifest["spec"].items() if k != "template"} == \
        {k: v for k, v in base["spec"].items() if k != "template"}


@pytest.mark.parametrize("pool", [work_pool.POOL, work_pool.GPU_POOL])
def test_base_job_templates_render_to_valid_prefect_jobs(pool: str) -> None:
    template = json.loads(work_pool.TEMPLATE_FILES[pool].read_text())
    config = work_pool.validate_template(template, {"env": {"FORGEFLOW_HOME": "/data"}, "image": IMAGE},
                                         flow_run_name="lifecycle-brave-otter")
    manifest = config.job_manifest
    job = kubernetes_manifests.validate_manifest(manifest, work_pool.PREFECT_JOB_EXTRAS)
    assert type(job).__name__ == "V1Job"
    pod_spec = job.spec.template.spec
    assert job.metadata.namespace == "forgeflow" and config.namespace == "forgeflow"
    assert job.metadata.generate_name == "lifecycle-brave-otter-"  # the worker names the Job after the flow run
    assert job.metadata.labels["prefect.io/flow-run-name"] == "lifecycle-brave-otter"  # prepare_for_flow_run ran
    assert pod_spec.service_account_name == "forgeflow-worker"
    assert pod_spec.security_context.run_as_non_root is True and pod_spec.security_context.run_as_user == 1000
    (container,) = pod_spec.containers
    assert container.name == "prefect-job" and container.image == IMAGE
    assert container.security_context.allow_privilege_escalation is False
    assert container.security_context.capabilities.drop == ["ALL"]
    assert container.args == ["prefect", "flow-run", "execute"]
    env = _container_env(config)
    assert env["FORGEFLOW_HOME"] == "/data"  # the deployment's env merged with the template's
    assert env["PREFECT_RESULTS_PERSIST_BY_DEFAULT"] == "true"
    assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == work_pool.RESULT_STORAGE_BLOCK
    limits = container.resources.limits
    if pool == work_pool.GPU_POOL:
        assert limits["nvidia.com/gpu"] == "1" == container.resources.requests["nvidia.com/gpu"]
        assert any(t.key == "nvidia.com/gpu" for t in pod_spec.tolerations)
        assert pod_spec.node_selector == {"nvidia.com/gpu.present": "true"}
        assert limits["memory"] == "32Gi"
    else:
        assert "nvidia.com/gpu" not in limits and not pod_spec.tolerations and not pod_spec.node_selector
        assert (limits["cpu"], limits["memory"], container.resources.requests["cpu"]) == ("2", "4Gi", "1")


def test_job_variables_override_the_defaults() -> None:
    template = work_pool.base_job_template(work_pool.GPU_POOL)
    config = work_pool.validate_template(template, {
        "result_storage_block": "local-file-system/shared-results", "gpu_count": "4",
        "image_pull_secrets": [{"name": "regcred"}], "namespace": "research"})
    spec = config.job_manifest["spec"]["template"]["spec"]
    assert _container_env(config)["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "local-file-system/shared-results"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert config.job_manifest["metadata"]["namespace"] == "research"


@pytest.mark.parametrize(("values", "message"), [
    ({"gpu_count": "0"}, "gpu_count"),
    ({"result_storage_block": "no-block-type"}, "result_storage_block"),
    ({"image_pull_policy": "Sometimes"}, "image_pull_policy"),
])
def test_bad_job_variables_are_refused(values: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        work_pool.validate_template(work_pool.base_job_template(work_pool.GPU_POOL), values)


def test_prefect_kubernetes_refuses_a_template_it_cannot_run() -> None:
    template = work_pool.base_job_template()
    renamed = copy.deepcopy(template)
    renamed["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["name"] = "worker"
    with pytest.raises(InputError, match="prefect-job"):  # KubernetesWorkerJobConfiguration's own validator
        work_pool.validate_template(renamed)
    restarting = copy.deepcopy(template)
    restarting["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    with pytest.raises(InputError, match="restartPolicy"):
        work_pool.validate_template(restarting)
    misspelt = copy.deepcopy(template)  # the API server would drop the key and run the pod as root
    misspelt["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["securityContxt"] = {"runAsUser": 0}
    with pytest.raises(InputError, match=r"spec\.template\.spec\.securityContxt"):
        work_pool.validate_template(misspelt)
    undeclared = copy.deepcopy(template)
    undeclared["job_configuration"]["job_manifest"]["spec"]["activeDeadlineSeconds"] = "{{ deadline_s }}"
    with pytest.raises(InputError, match="deadline_s"):  # the Prefect server's check
        work_pool.validate_template(undeclared)


def test_unknown_pool_lists_the_known_ones() -> None:
    with pytest.raises(InputError, match="k8s-gpu"):
        work_pool.base_job_template("k8s-tpu")


def test_cli_template_writes_the_validated_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    out = tmp_path / "pool.json"
    result = runner.invoke(app, ["work-pool", "template", "--pool", "k8s-gpu", "--out", str(out),
                                 "--result-storage-block", "local-file-system/shared"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == work_pool.base_job_template(work_pool.GPU_POOL, "local-file-system/shared")
    result = runner.invoke(app, ["work-pool", "template", "--result-storage-block", "bad slug/x"])
    assert result.exit_code == 2 and "result_storage_block" in result.output
    result = runner.invoke(app, ["work-pool", "template", "--write-infra", "--result-storage-block", "a/b"])
    assert result.exit_code == 2 and "--write-infra" in result.output  # the committed files keep the default


def test_apply_creates_then_updates_the_pool_and_refuses_a_missing_block(
        prefect_harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.filesystems import LocalFileSystem

    suffix = uuid.uuid4().hex[:8]
    slug = f"local-file-system/results-{suffix}"
    name = f"k8s-{suffix}"
    with pytest.raises(InputError, match="no Prefect block"):
        work_pool.apply_work_pool(work_pool.POOL, name, slug)
    LocalFileSystem(basepath="/shared/prefect-results").save(f"results-{suffix}")
    assert work_pool.apply_work_pool(work_pool.GPU_POOL, name, slug) == "created"
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))  # what the CLI's prepare_env exports
    result = runner.invoke(app, ["work-pool", "apply", "--pool", "k8s", "--name", name, "--result-storage-block", slug])
    assert result.exit_code == 0 and "updated" in result.output, result.output
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(name)
        assert pool.type == "kubernetes"
        assert pool.base_job_template == work_pool.base_job_template(work_pool.POOL, slug)  # the update landed
        client.create_work_pool(WorkPoolCreate(name=f"proc-{suffix}", type="process"))
    with pytest.raises(InputError, match="type 'process'"):
        work_pool.apply_work_pool(work_pool.POOL, f"proc-{suffix}", slug)
