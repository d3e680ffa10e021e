"""Kubernetes scale-out, tested without an API server.

No Kubernetes API server can run on this machine (no kind/k3s, no container runtime for one, no
network). So every manifest forgeflow renders and every file in ``infra/k8s/`` is deserialized with
the official ``kubernetes`` client's models (``forgeflow.sandbox.kubernetes_manifests.validate_manifest``: unknown fields,
JSON types and required fields), the pod-status -> exception mapping is tested on recorded pod
statuses (``tests/core/data/k8s/pod_*.json``, in the shape ``kubectl get pod -o json`` prints), and
:class:`forgeflow.sandbox.kubernetes.KubernetesSandbox` is driven through a small recording stand-in for
``CoreV1Api`` (what it would create, read and delete). Exec through the API is not exercised here.
The work-pool templates are made and judged by prefect-kubernetes itself: tests/flows/test_work_pool.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from forgeflow.common import errors
from forgeflow.sandbox import kubernetes as k8s
from forgeflow.sandbox import kubernetes_manifests
from forgeflow.sandbox.base import SandboxSpec

REPO = Path(__file__).resolve().parents[3]
K8S_DIR = REPO / "infra" / "k8s"
DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
IMAGE = "registry.example.com/forgeflow/task-03:lane1-0123456789ab"
TRIAL = "0123456789abcdef0123456789abcdef"
# two 66-character SWE-smith-style task ids that share their first 65 characters
LONG_A = "boltons__boltons.3bfcfdd0.func_pm_remove_cond__x7h2k9q4w1e5r8t3y6" + "a"
LONG_B = "boltons__boltons.3bfcfdd0.func_pm_remove_cond__x7h2k9q4w1e5r8t3y6" + "b"
LABEL_VALUE = re.compile(r"^[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pod status is read again at once (the recorded statuses change on every read)."""
    monkeypatch.setattr(k8s.KubernetesSandbox, "poll_interval_s", 0)


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# --- labels and names ----------------------------------------------------------------------------
def test_66_character_task_ids_become_distinct_valid_label_values() -> None:
    assert len(LONG_A) == len(LONG_B) == 66
    a, b = kubernetes_manifests.label_value(LONG_A), kubernetes_manifests.label_value(LONG_B)
    for value in (a, b):
        assert len(value) <= 63 and LABEL_VALUE.match(value), value
    assert a != b
    assert kubernetes_manifests.label_value(LONG_A) == a  # deterministic
    assert kubernetes_manifests.label_value("abc123") == "abc123"  # a valid value is kept


def test_pod_names_and_labels_are_unique_per_trial() -> None:
    spec = kubernetes_manifests.KubernetesSandboxSpec()
    pods = [
        kubernetes_manifests.render_trial_pod(LONG_A, TRIAL, IMAGE, spec),
        kubernetes_manifests.render_trial_pod(LONG_B, TRIAL, IMAGE, spec),
        kubernetes_manifests.render_trial_pod(LONG_A, "f" * 32, IMAGE, spec),
    ]
    names = {p["metadata"]["name"] for p in pods}
    assert len(names) == 3
    assert len({p["metadata"]["labels"][kubernetes_manifests.INSTANCE_LABEL] for p in pods}) == 2
    assert len({p["metadata"]["labels"][kubernetes_manifests.TRIAL_LABEL] for p in pods}) == 2
    for pod in pods:
        assert len(pod["metadata"]["name"]) <= 63 and DNS_LABEL.match(pod["metadata"]["name"])
        for key, value in pod["metadata"]["labels"].items():
            assert kubernetes_manifests.is_label_key(key) and len(value) <= 63 and LABEL_VALUE.match(value), (key, value)
    # the raw ids survive in annotations
    assert pods[0]["metadata"]["annotations"]["forgeflow.dev/instance-id"] == LONG_A


# --- the trial pod -------------------------------------------------------------------------------
def test_trial_pod_validates_as_v1pod_and_is_locked_down() -> None:
    spec = kubernetes_manifests.KubernetesSandboxSpec(image_pull_secret="forgeflow-registry", labels={"team": "RL Evals"})
    manifest = kubernetes_manifests.render_trial_pod(LONG_A, TRIAL, IMAGE, spec)
    pod = kubernetes_manifests.validate_manifest(manifest)
    assert type(pod).__name__ == "V1Pod"
    ps = pod.spec
    assert ps.automount_service_account_token is False
    assert ps.share_process_namespace is False  # nothing in the pod reaches another container's processes
    assert ps.restart_policy == "Never"
    assert not ps.volumes and not ps.host_network and not ps.host_pid and not ps.host_ipc
    assert ps.enable_service_links is False
    assert ps.active_deadline_seconds == 7200
    assert [s.name for s in ps.image_pull_secrets] == ["forgeflow-registry"]
    (container,) = ps.containers
    assert container.image == IMAGE and container.command == ["sh", "-c", kubernetes_manifests.INIT_SCRIPT]
    assert not container.volume_mounts
    assert container.resources.limits["memory"] == "2048Mi" == container.resources.requests["memory"]  # SandboxLimits
    assert container.resources.limits["cpu"] == "1000m"
    sc = container.security_context
    assert sc.privileged is False and sc.allow_privilege_escalation is False
    assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add  # no capability, as the podman sandbox
    assert ps.host_users is None  # the host's user namespace unless asked (a cluster may lack support)
    assert pod.metadata.labels["team"] == kubernetes_manifests.label_value("RL Evals")
    assert pod.metadata.labels[kubernetes_manifests.EGRESS_LABEL] == "deny"


def test_an_agent_pod_shares_its_repository_with_a_tree_sidecar_the_agent_cannot_reach() -> None:
    spec = kubernetes_manifests.KubernetesSandboxSpec(memory_mb=2048, cpus=0.5)
    pod = kubernetes_manifests.validate_manifest(
        kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, spec, tree_repo="/testbed"))
    ps = pod.spec
    assert ps.share_process_namespace is False  # else the agent's root reaches the sidecar through /proc
    (volume,) = ps.volumes
    assert volume.empty_dir.size_limit == "10240Mi" and volume.host_path is None
    (init,) = ps.init_containers
    assert init.image == IMAGE and init.command == ["cp", "-a", "/testbed/.", "/forgeflow-repo/"]
    assert [(m.name, m.mount_path) for m in init.volume_mounts] == [(volume.name, "/forgeflow-repo")]
    main, tree = ps.containers
    assert main.name == "sandbox" and main.command == ["sh", "-c", "while :; do sleep infinity & wait; done"]
    assert [(m.name, m.mount_path, m.read_only) for m in main.volume_mounts] == [(volume.name, "/testbed", None)]
    assert tree.name == "tree" and tree.image == IMAGE and tree.command == ["sleep", "infinity"]
    assert [(m.name, m.mount_path, m.read_only) for m in tree.volume_mounts] == [(volume.name, "/testbed", True)]
    for container in (init, main, tree):  # Guaranteed QoS: requests == limits everywhere
        assert container.resources.requests == container.resources.limits
        sc = container.security_context
        assert sc.privileged is False and sc.allow_privilege_escalation is False and sc.capabilities.drop == ["ALL"]
    assert init.resources.limits == main.resources.limits == {"cpu": "500m", "memory": "2048Mi",
                                                              "ephemeral-storage": "10240Mi"}
    assert tree.resources.limits == {"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "64Mi"}
    assert tree.security_context.capabilities.add == ["DAC_OVERRIDE"] and tree.security_context.read_only_root_filesystem
    assert not main.security_context.capabilities.add and not main.security_context.read_only_root_filesystem
    # a verifier's pod (no tree_repo) stays one container, no volume, its own process namespace
    plain = kubernetes_manifests.validate_manifest(kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, spec)).spec
    assert plain.share_process_namespace is False and len(plain.containers) == 1
    assert not plain.volumes and not plain.init_containers and plain.containers[0].command == main.command
    for bad in ("", "testbed", "/", "/a b", "/x/../y"):
        with pytest.raises(errors.InputError, match="tree_repo"):
            kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, spec, tree_repo=bad)
    with pytest.raises(errors.InputError, match="no tree sidecar"):
        k8s.KubernetesSandbox(IMAGE, spec, "ff-plain", api=object()).export_tree()


def test_a_pod_with_a_sidecar_is_ready_and_healthy_only_with_both_containers_running() -> None:
    running = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    ended = {"terminated": {"exitCode": 137, "reason": "Error"}}

    def status(tree_state: dict, tree_ready: bool) -> dict:
        return {"phase": "Running", "containerStatuses": [
            {"name": "sandbox", "ready": True, "state": running},
            {"name": "tree", "ready": tree_ready, "state": tree_state}]}

    assert kubernetes_manifests._pod_ready(status(running, True))
    assert not kubernetes_manifests._pod_ready(status({"waiting": {"reason": "ContainerCreating"}}, False))
    assert kubernetes_manifests.pod_status_to_exception(status(running, True)) is None
    problem = kubernetes_manifests.pod_status_to_exception(status(ended, False))
    assert type(problem) is errors.SandboxError and "'tree' of the running pod terminated (exit 137" in str(problem)
    failed_init = {"phase": "Failed", "initContainerStatuses": [
        {"name": "repo-init", "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                       "message": "cp: cannot stat '/testbed/.'"}}}]}
    problem = kubernetes_manifests.pod_status_to_exception(failed_init)
    assert type(problem) is errors.SandboxError and "init container 'repo-init' exited 1" in str(problem)


def test_capabilities_and_a_user_namespace_are_parameters() -> None:
    spec = kubernetes_manifests.KubernetesSandboxSpec.from_sandbox_spec(SandboxSpec(capabilities=("CHOWN",)),
                                                                         host_users=False)
    pod = kubernetes_manifests.validate_manifest(kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, spec))
    assert pod.spec.host_users is False
    sc = pod.spec.containers[0].security_context
    assert sc.capabilities.drop == ["ALL"] and sc.capabilities.add == ["CHOWN"]
    assert sc.allow_privilege_escalation is False


def test_memory_cpu_and_network_are_parameters() -> None:
    spec = kubernetes_manifests.KubernetesSandboxSpec(memory_mb=2048, cpus=0.5, network=True)
    pod = kubernetes_manifests.validate_manifest(kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, spec))
    assert pod.spec.containers[0].resources.limits["memory"] == "2048Mi"
    assert pod.spec.containers[0].resources.limits["cpu"] == "500m"
    assert kubernetes_manifests.EGRESS_LABEL not in pod.metadata.labels  # network=True: not selected by the deny policy
    assert not pod.spec.image_pull_secrets
    converted = kubernetes_manifests.KubernetesSandboxSpec.from_sandbox_spec(SandboxSpec(memory_mb=3000, cpus=2))
    assert (converted.memory_mb, converted.cpus, converted.network) == (3000, 2, False)


@pytest.mark.parametrize(
    "kwargs",
    [{"namespace": "Forge_Flow"}, {"labels": {"bad key!": "x"}}, {"labels": {kubernetes_manifests.ROLE_LABEL: "x"}},
     {"image_pull_secret": "Not A Secret"}, {"memory_mb": 0}],
)
def test_bad_spec_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        kubernetes_manifests.KubernetesSandboxSpec(**kwargs)


@pytest.mark.parametrize("args", [("", TRIAL, IMAGE), ("a", "", IMAGE), ("a", TRIAL, ""), ("a", TRIAL, "img ref")])
def test_bad_ids_or_image_are_rejected(args: tuple) -> None:
    with pytest.raises(errors.InputError):
        kubernetes_manifests.render_trial_pod(*args, kubernetes_manifests.KubernetesSandboxSpec())


# --- network policy ------------------------------------------------------------------------------
def test_network_policy_denies_egress_of_trial_pods_only() -> None:
    policy = kubernetes_manifests.validate_manifest(kubernetes_manifests.render_network_policy("forgeflow"))
    assert type(policy).__name__ == "V1NetworkPolicy"
    assert policy.spec.policy_types == ["Egress"] and policy.spec.egress == []
    selector = policy.spec.pod_selector.match_labels
    closed = kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, kubernetes_manifests.KubernetesSandboxSpec())["metadata"]["labels"]
    opened = kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, kubernetes_manifests.KubernetesSandboxSpec(network=True))["metadata"]["labels"]
    assert selector.items() <= closed.items()
    assert not selector.items() <= opened.items()
    with pytest.raises(errors.InputError, match="empty"):
        kubernetes_manifests.render_network_policy("forgeflow", {})


# --- manifest validation -------------------------------------------------------------------------
def test_validate_manifest_catches_typos_wrong_types_and_missing_required_fields() -> None:
    manifest = kubernetes_manifests.render_trial_pod("a", TRIAL, IMAGE, kubernetes_manifests.KubernetesSandboxSpec())
    manifest["spec"]["automountServiceAcountToken"] = True
    manifest["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 1
    with pytest.raises(errors.InputError) as info:
        kubernetes_manifests.validate_manifest(manifest)
    assert "automountServiceAcountToken" in str(info.value) and "limits.cpu" in str(info.value)
    nameless = {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"image": IMAGE}]}}
    with pytest.raises(errors.InputError, match="name"):
        kubernetes_manifests.validate_manifest(nameless)
    with pytest.raises(errors.InputError, match="kind"):
        kubernetes_manifests.validate_manifest({"apiVersion": "v1", "kind": "Secret"})


# --- recorded pod statuses -----------------------------------------------------------------------
STATUS_CASES = [
    ("pod_running.json", None),
    ("pod_pending_unschedulable.json", None),
    ("pod_oomkilled.json", errors.SandboxOOMError),
    ("pod_evicted.json", errors.SandboxError),
    ("pod_image_pull_backoff.json", errors.ImageNotFoundError),
    ("pod_err_image_pull.json", errors.ImageNotFoundError),
    ("pod_err_image_pull_unreachable.json", errors.RegistryUnavailableError),
    ("pod_create_container_config_error.json", errors.SandboxError),
    ("pod_deadline_exceeded.json", errors.VerifierTimeoutError),
]


@pytest.mark.parametrize(("fixture", "expected"), STATUS_CASES)
def test_recorded_pod_status_maps_to_the_right_exception(fixture: str, expected: type | None) -> None:
    recorded = json.loads((DATA / fixture).read_text())
    kubernetes_manifests.validate_manifest(recorded)  # the fixture is a real V1Pod, field for field
    for given in (recorded, recorded["status"]):  # a whole Pod or its status
        exc = kubernetes_manifests.pod_status_to_exception(given)
        if expected is None:
            assert exc is None
        else:
            assert type(exc) is expected, exc
            assert isinstance(exc, errors.InfraError) and str(exc)
    if expected is errors.RegistryUnavailableError:
        assert errors.is_transient(exc)
    if fixture == "pod_evicted.json":
        assert "ephemeral local storage" in str(exc)


def test_pod_status_must_be_a_dict() -> None:
    with pytest.raises(errors.InputError):
        kubernetes_manifests.pod_status_to_exception("Running")  # type: ignore[arg-type]


# --- infra/k8s -----------------------------------------------------------------------------------
def test_every_infra_yaml_document_validates() -> None:
    kinds = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in load_yaml_docs(path):
            model = kubernetes_manifests.validate_manifest(doc)
            assert model.metadata.name and model.metadata.namespace == "forgeflow", path
            kinds.append(doc["kind"])
    assert {"ServiceAccount", "Role", "RoleBinding", "Pod", "NetworkPolicy"} <= set(kinds)


def test_rbac_lets_the_worker_run_trials_and_jobs_but_nothing_else() -> None:
    docs = {d["kind"]: kubernetes_manifests.validate_manifest(d) for d in load_yaml_docs(K8S_DIR / "rbac.yaml")}
    sa, role, binding = docs["ServiceAccount"], docs["Role"], docs["RoleBinding"]
    grants = {(g, r, v) for rule in role.rules for g in rule.api_groups for r in rule.resources for v in rule.verbs}
    for need in [("", "pods", "create"), ("", "pods", "delete"), ("", "pods/exec", "create"),
                 ("", "pods/status", "get"), ("batch", "jobs", "create"), ("batch", "jobs", "watch"),
                 ("", "events", "list")]:
        assert need in grants, need
    assert not any(r in {"secrets", "*"} or v == "*" for _, r, v in grants)
    assert binding.role_ref.kind == "Role" and binding.role_ref.name == role.metadata.name
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [("ServiceAccount", sa.metadata.name, "forgeflow")]
    template = json.loads((K8S_DIR / "base-job-template.json").read_text())
    assert template["variables"]["properties"]["service_account_name"]["default"] == sa.metadata.name


def test_sandbox_pod_and_network_policy_files_match_the_renderers() -> None:
    (pod,) = load_yaml_docs(K8S_DIR / "sandbox-pod.yaml")
    assert pod == kubernetes_manifests.render_trial_pod(
        "boltons__boltons.3bfcfdd0.func_pm_remove_cond__example", TRIAL, IMAGE,
        kubernetes_manifests.KubernetesSandboxSpec(image_pull_secret="forgeflow-registry"),
    )
    (policy,) = load_yaml_docs(K8S_DIR / "network-policy.yaml")
    assert policy == kubernetes_manifests.render_network_policy("forgeflow")


def test_worker_dockerfile_pins_the_installed_prefect_and_copies_existing_paths() -> None:
    text = (K8S_DIR / "worker.Dockerfile").read_text()
    assert f"ARG PREFECT_VERSION={importlib.metadata.version('prefect')}" in text
    pinned = re.search(r'"prefect-kubernetes==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"ARG PREFECT_KUBERNETES_VERSION={pinned}" in text.splitlines()
    assert importlib.metadata.version("prefect-kubernetes") == pinned
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for part in source.split():
            assert (REPO / part).exists(), part
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and not users[-1].startswith(("root", "0"))
    assert json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1)) == [
        "prefect", "worker", "start", "--pool", "k8s", "--type", "kubernetes"]


def _dockerfile_runs(text: str) -> list[str]:
    """The shell command of each RUN instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line[len("RUN "):] for line in joined.splitlines() if line.startswith("RUN ")]


def test_worker_image_installs_skopeo_and_no_podman() -> None:
    runs = _dockerfile_runs((K8S_DIR / "worker.Dockerfile").read_text())
    installed = set()
    for run in runs:
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                installed |= {w for w in words[2:] if not w.startswith("-")}
    assert "skopeo" in installed  # the registry flows shell out to it (forgeflow/registry/skopeo.py)
    assert not installed & {"podman", "buildah", "docker.io", "containerd"}  # trials run as pods
    assert any(re.search(r"\bskopeo --version\b", run) for run in runs)


def test_worker_image_has_the_fsspec_driver_of_the_shared_result_storage() -> None:
    """The flow-run pods share Prefect's result storage through a RemoteFileSystem block on s3:// (README):
    the image installs s3fs at the release of the fsspec installed with forgeflow (s3fs pins fsspec to its own
    release) and its build checks that fsspec finds the s3 filesystem."""
    text = (K8S_DIR / "worker.Dockerfile").read_text()
    assert f"ARG S3FS_VERSION={importlib.metadata.version('fsspec')}" in text.splitlines()
    runs = _dockerfile_runs(text)
    assert any('"s3fs==${S3FS_VERSION}"' in run and "pip install" in run for run in runs)
    assert any("__import__('fsspec').get_filesystem_class('s3')" in run for run in runs)


def test_worker_image_import_check_imports_modules_that_exist() -> None:
    runs = _dockerfile_runs((K8S_DIR / "worker.Dockerfile").read_text())
    checks = [m for run in runs for m in re.findall(r'python -c "import ([^"]+)"', run)]
    assert checks, "the image build checks no import"
    modules = [name.strip() for check in checks for name in check.split(",")]
    assert {"forgeflow.sandbox.kubernetes", "prefect_kubernetes"} <= set(modules)
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
        if module.split(".")[0] in {"forgeflow", "deployments", "tasks", "flows", "blocks"}:
            assert Path(importlib.util.find_spec(module).origin).is_relative_to(REPO), module  # this checkout's


# --- the sandbox, through a recording stand-in for CoreV1Api (no API server can run here) ---------
class RecordingCoreV1Api:
    """Records create/read/delete calls; read_namespaced_pod_status replays recorded pod statuses
    as real ``V1Pod`` objects, the way the client returns them."""

    def __init__(self, statuses: list[str]) -> None:
        self.api_client = ApiClient()
        self.statuses = list(statuses)
        self.calls: list[tuple[str, dict]] = []
        self.pods: dict[str, dict] = {}

    def create_namespaced_pod(self, namespace: str, body: dict) -> None:
        self.calls.append(("create", {"namespace": namespace, "body": body}))
        self.pods[body["metadata"]["name"]] = body

    def read_namespaced_pod_status(self, name: str, namespace: str):
        self.calls.append(("read", {"name": name, "namespace": namespace}))
        recorded = json.loads((DATA / self.statuses.pop(0)).read_text())
        return self.api_client._ApiClient__deserialize(recorded, "V1Pod")

    def delete_namespaced_pod(self, name: str, namespace: str, **kwargs: object) -> None:
        self.calls.append(("delete", {"name": name, "namespace": namespace, **kwargs}))
        if self.pods.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")

    def list_namespaced_pod(self, namespace: str, label_selector: str):
        self.calls.append(("list", {"namespace": namespace, "label_selector": label_selector}))
        items = [self.api_client._ApiClient__deserialize(p, "V1Pod") for p in self.pods.values()]
        return type("PodList", (), {"items": items})()


def test_sandbox_creates_the_rendered_pod_and_deletes_it_on_stop() -> None:
    api = RecordingCoreV1Api(["pod_pending_unschedulable.json", "pod_running.json"])
    box = k8s.KubernetesSandbox(IMAGE, SandboxSpec(memory_mb=4096), "ff-nop-task-1", api=api,
                                instance_id=LONG_A, trial_id=TRIAL)
    with box:
        kind, create = api.calls[0]
        assert kind == "create" and create["namespace"] == "forgeflow"
        assert create["body"]["metadata"]["name"] == "ff-nop-task-1"
        assert create["body"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "4096Mi"
        kubernetes_manifests.validate_manifest(create["body"])
        assert [c[0] for c in api.calls] == ["create", "read", "read"]
    assert api.calls[-1] == ("delete", {"name": "ff-nop-task-1", "namespace": "forgeflow",
                                        "grace_period_seconds": 0, "propagation_policy": "Background"})
    box.stop()  # idempotent: no second delete
    assert [c[0] for c in api.calls].count("delete") == 1


def test_sandbox_deletes_the_pod_when_the_trial_is_cancelled() -> None:
    api = RecordingCoreV1Api(["pod_running.json"])
    with pytest.raises(KeyboardInterrupt):
        with k8s.KubernetesSandbox(IMAGE, api=api, trial_id=TRIAL, instance_id="a") as box:
            raise KeyboardInterrupt  # what a cancelled flow run raises into the trial
    assert api.calls[-1][0] == "delete" and api.calls[-1][1]["name"] == box.name
    assert not api.pods


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [("pod_image_pull_backoff.json", errors.ImageNotFoundError), ("pod_oomkilled.json", errors.SandboxOOMError),
     ("pod_evicted.json", errors.SandboxError)],
)
def test_sandbox_start_raises_from_pod_status_and_deletes_the_pod(fixture: str, expected: type) -> None:
    api = RecordingCoreV1Api([fixture])
    box = k8s.KubernetesSandbox(IMAGE, api=api, instance_id="a", trial_id=TRIAL)
    with pytest.raises(expected):
        box.start()
    assert api.calls[-1][0] == "delete" and not api.pods


def test_sandbox_start_times_out_on_an_unschedulable_pod() -> None:
    api = RecordingCoreV1Api(["pod_pending_unschedulable.json"])
    box = k8s.KubernetesSandbox(IMAGE, api=api, instance_id="a", trial_id=TRIAL)
    box.start_timeout_s = 0
    with pytest.raises(errors.SandboxError, match="Insufficient memory"):
        box.start()
    assert not api.pods
    with pytest.raises(errors.SandboxError, match="not started"):
        box.exec("true", timeout_s=5)


def test_delete_trial_pods_sweeps_by_label() -> None:
    api = RecordingCoreV1Api(["pod_running.json", "pod_running.json"])
    for trial in ("t1", "t2"):
        k8s.KubernetesSandbox(IMAGE, api=api, instance_id="a", trial_id=trial).start()
    names = k8s.delete_trial_pods(api, "forgeflow")
    assert len(names) == 2 and not api.pods
    assert ("list", {"namespace": "forgeflow",
                     "label_selector": "app.kubernetes.io/managed-by=forgeflow,forgeflow.dev/role=trial"}) in api.calls


def test_kubernetes_backend_is_registered() -> None:
    from forgeflow.sandbox.backends import get_backend

    backend = get_backend("kubernetes")
    box = backend(IMAGE, SandboxSpec(), "ff-x", api=RecordingCoreV1Api([]))
    assert isinstance(box, k8s.KubernetesSandbox)


def test_kubernetes_backend_connects_where_its_target_says() -> None:
    """The target's kubeconfig and context are the sandbox's; its waits are the class's defaults."""
    from forgeflow.sandbox.backends import SandboxTarget, get_backend

    target = SandboxTarget(kind="kubernetes", kubeconfig="/etc/kube/config", context="lab")
    box = get_backend(target)(IMAGE, SandboxSpec(), "ff-x")
    assert (box.kubeconfig, box.context) == ("/etc/kube/config", "lab")
    assert box.start_timeout_s == 600.0 and box.poll_interval_s == 0  # the class's wait; this module's poll
    in_cluster = get_backend(SandboxTarget(kind="kubernetes"))(IMAGE, SandboxSpec(), "ff-x")
    assert (in_cluster.kubeconfig, in_cluster.context) == (None, None)
