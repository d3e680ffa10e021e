"""The Kubernetes sandbox through the official ``kubernetes`` client against a loopback fake of the
Kubernetes API (tests/fakes/kubernetes_api.py). It is a fake of the API, not a cluster: it implements
create / read status / delete / list pods and exec over the websocket ``v4.channel.k8s.io``
protocol by running each pod's container with podman. The client's own code (kubeconfig loading, the
REST calls, ``kubernetes.stream``'s websocket and channel demultiplexing, the exit-code status) is
what runs.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.registry.images import BASE_IMAGE_TAG, ensure_base_image
from forgeflow.registry.server import RegistryServer
from forgeflow.sandbox.backends import SandboxTarget, get_backend
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.kubernetes import KubernetesSandbox, delete_trial_pods, new_core_api
from forgeflow.sandbox.verifier import run_tests
from tests.kubefake import kubernetes_api

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _poll_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KubernetesSandbox, "poll_interval_s", 0.2)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    ensure_base_image()
    with kubernetes_api(tmp_path_factory.mktemp("kube")) as api:
        yield api
    assert not api.containers(), "the fake left containers behind"


def _sandbox(fake, name: str, memory_mb: int = 256, **labels: str):
    target = SandboxTarget(kind="kubernetes", kubeconfig=str(fake.kubeconfig), labels=labels)
    return get_backend(target)(BASE_IMAGE_TAG, SandboxSpec(memory_mb=memory_mb), name)


def test_a_trial_pod_runs_commands_through_exec_and_is_deleted(fake) -> None:
    sandbox = _sandbox(fake, "ff-exec-basics")
    with sandbox:
        (pod,) = fake.pods(selector="forgeflow.dev/role=trial")
        assert pod["metadata"]["name"] == "ff-exec-basics" and pod["status"]["phase"] == "Running"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["memory"] == "256Mi"

        result = sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert sandbox.exec(["pwd"], timeout_s=30, workdir="/tmp").stdout == "/tmp\n"
        assert sandbox.exec("echo $A-$B", timeout_s=30, env={"A": "x y", "B": "1"}).stdout == "x y-1\n"
        assert sandbox.exec("python3 -c 'import urllib.request as u; u.urlopen(\"http://1.1.1.1\", timeout=3)'",
                            timeout_s=30).exit_code != 0  # no network in a trial pod

        content = "".join(f"line {i} é\n" for i in range(12_000))  # ~130 KB: three write chunks
        sandbox.write_file("/tmp/big.txt", content)
        assert sandbox.exec("sha256sum < /tmp/big.txt", timeout_s=30).stdout.split()[0] == \
            __import__("hashlib").sha256(content.encode()).hexdigest()

        with pytest.raises(errors.VerifierTimeoutError, match="exceeded 2 s"):
            sandbox.exec("sleep 30", timeout_s=2)
    assert fake.pods() == []


def test_exit_137_is_a_result_and_an_oom_kill_is_an_exception(fake) -> None:
    with _sandbox(fake, "ff-oom", memory_mb=64) as sandbox:
        # a command that exits 137 by itself is its own result: no OOM without the kernel's evidence
        assert sandbox.exec("exit 137", timeout_s=30).exit_code == 137
        with pytest.raises(errors.SandboxOOMError, match="oom_kill 0 -> 1"):
            sandbox.exec("python3 -c 'x = bytearray(400 * 1024 * 1024)'", timeout_s=60)
    assert fake.pods() == []


def test_an_evicted_pod_makes_the_running_command_an_exception_not_a_result(fake) -> None:
    with _sandbox(fake, "ff-evicted") as sandbox:
        threading.Timer(1.5, fake.evict, args=("ff-evicted",)).start()
        with pytest.raises(errors.SandboxError, match="evicted: The node was low on resource: memory"):
            sandbox.exec("sleep 20; echo done", timeout_s=60)
    assert fake.pods() == []


def test_image_pull_failures_are_the_right_exceptions_and_the_pod_is_deleted(fake, tmp_path: Path) -> None:
    target = SandboxTarget(kind="kubernetes", kubeconfig=str(fake.kubeconfig))

    def start(image: str) -> None:
        get_backend(target)(image, SandboxSpec(memory_mb=64), "ff-pull").start()

    # no registry answers: transient (the kubelet's "dial tcp ... connection refused")
    with pytest.raises(errors.RegistryUnavailableError, match="ErrImagePull.*connection refused"):
        start("localhost/forgeflow/no-such-image:1")
    # a registry that answers but lacks the tag: the image is not found
    port = next(p for p in range(5715, 5731) if _port_free(p))  # registries.conf: 5701-5730 insecure
    registry = RegistryServer("kube-pull", port, tmp_path / "registry")
    registry.start()
    try:
        with pytest.raises(errors.ImageNotFoundError, match="ErrImagePull"):
            start(f"127.0.0.1:{port}/task-01:missing")
    finally:
        registry.stop()
    assert fake.pods() == []


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_leftover_pod_of_the_same_trial_is_replaced(fake) -> None:
    first = _sandbox(fake, "ff-leftover")
    first.start()  # a killed run's pod, never stopped
    first.exec("touch /tmp/old", timeout_s=30)
    with _sandbox(fake, "ff-leftover") as second:
        assert second.exec("test -e /tmp/old", timeout_s=30).exit_code == 1  # a fresh pod
    assert fake.pods() == []


def test_concurrent_trials_each_exec_while_others_create_and_delete(fake) -> None:
    """Four threads at once: every exec, create and status read lands (each sandbox has its own
    API client: the client's stream swaps the transport of the client it is given)."""
    results: dict[int, str] = {}
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            for round_ in range(3):
                with _sandbox(fake, f"ff-concurrent-{i}-{round_}") as sandbox:
                    for _ in range(3):  # a failing command reads the pod status: REST between the execs
                        assert sandbox.exec(f"echo {i}; exit 1", timeout_s=30).exit_code == 1
                    results[i] = sandbox.exec(f"echo {i}", timeout_s=30).stdout
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert results == {i: f"{i}\n" for i in range(4)}
    assert fake.pods() == []


def test_the_sweep_deletes_a_runs_pods_by_label_and_only_those(fake) -> None:
    mine = [_sandbox(fake, f"ff-sweep-{i}", **{"forgeflow.dev/flow-run": "run-a"}) for i in range(2)]
    other = _sandbox(fake, "ff-sweep-other", **{"forgeflow.dev/flow-run": "run-b"})
    for sandbox in (*mine, other):
        sandbox.start()
    api = new_core_api(str(fake.kubeconfig))
    assert delete_trial_pods(api, "forgeflow", {"forgeflow.dev/flow-run": "run-a"}) == ["ff-sweep-0", "ff-sweep-1"]
    assert [p["metadata"]["name"] for p in fake.pods()] == ["ff-sweep-other"]
    with pytest.raises(errors.SandboxError, match="is not running|is gone"):
        mine[0].exec("true", timeout_s=10)
    other.stop()
    assert fake.pods() == []


def test_a_verifier_run_grades_in_a_pod(fake) -> None:
    with _sandbox(fake, "ff-verify") as sandbox:
        sandbox.exec("mkdir -p /testbed && cd /testbed && printf 'def test_a():\\n    assert 1\\n"
                     "def test_b():\\n    assert 0\\n' > test_x.py", timeout_s=30)
        run = run_tests(sandbox, "python3 -m pytest -q test_x.py", 60)
    assert run.tests == {"test_x.py::test_a": "PASSED", "test_x.py::test_b": "FAILED"}


def test_no_kubeconfig_is_a_sandbox_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(errors.SandboxError, match="kubeconfig '/nonexistent/kubeconfig'"):
        new_core_api("/nonexistent/kubeconfig")
