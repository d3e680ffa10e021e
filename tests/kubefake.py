"""Start the loopback fake of the Kubernetes API (tests/fakes/kubernetes_api.py: a fake of the API that
runs pods with podman, not a cluster: init containers, several containers, emptyDir volumes as podman
volumes) on a free port, write a kubeconfig for it, stop it by PID.

The official ``kubernetes`` client is pointed at it through that kubeconfig, so every call forgeflow
makes (create, read status, exec over the websocket, delete, list by label) goes through the
client's real code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from forgeflow.common.settings import tool_env
from tests.fakes.kubernetes_api import FAKE_LABEL
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FakeKubernetesAPI:
    """A running fake: its URL, the kubeconfig that points at it, its PID and container label."""

    url: str
    kubeconfig: Path
    pid: int
    label: str

    def pods(self, namespace: str = "forgeflow", selector: str = "") -> list[dict]:
        """The pods the fake holds (``GET .../pods?labelSelector=``)."""
        response = httpx.get(f"{self.url}/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
        response.raise_for_status()
        return response.json()["items"]

    def calls(self) -> list[dict]:
        """Every pod create, exec and delete the fake answered, in order (``GET /fake/calls``:
        ``verb``, ``namespace``, ``name``; an exec's ``command`` argv and ``stdin``; a create's ``labels``)."""
        response = httpx.get(f"{self.url}/fake/calls", timeout=30)
        response.raise_for_status()
        return response.json()

    def evict(self, name: str, namespace: str = "forgeflow") -> None:
        """Evict a pod as the kubelet does under node pressure (its container killed, ``Evicted``)."""
        httpx.post(f"{self.url}/fake/evict/{namespace}/{name}", timeout=60).raise_for_status()

    def containers(self) -> list[str]:
        """Names of the podman containers this fake started that still exist."""
        out = subprocess.run(["podman", "ps", "-a", "--filter", f"label={FAKE_LABEL}={self.label}",
                              "--format", "{{.Names}}"], capture_output=True, text=True, env=tool_env(), check=True)
        return out.stdout.split()

    def volumes(self) -> list[str]:
        """Names of the podman volumes (a pod's ``emptyDir``) this fake made that still exist."""
        out = subprocess.run(["podman", "volume", "ls", "--filter", f"label={FAKE_LABEL}={self.label}",
                              "--format", "{{.Name}}"], capture_output=True, text=True, env=tool_env(), check=True)
        return out.stdout.split()


def write_kubeconfig(path: Path, url: str, namespace: str = "forgeflow") -> Path:
    """A kubeconfig with one context ``fake`` (server ``url``, a bearer token the fake ignores)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
        "users:\n- name: fake\n  user:\n    token: fake-token\n"
        f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n"
        "current-context: fake\n"
    )
    return path


@contextmanager
def kubernetes_api(tmp_path: Path) -> Iterator[FakeKubernetesAPI]:
    """Run the fake for the block: started on a free port, stopped by PID (SIGTERM, then SIGKILL),
    and every container and volume it made removed."""
    port, label = free_port(), uuid.uuid4().hex[:10]
    log = (tmp_path / f"kubefake-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.kubernetes_api", "--port", str(port),
                             "--label", label], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    fake = FakeKubernetesAPI(url, write_kubeconfig(tmp_path / f"kubeconfig-{port}", url), proc.pid, label)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the fake Kubernetes API exited: {Path(log.name).read_text()}"
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the fake Kubernetes API did not answer in 60 s"
            time.sleep(0.2)
        yield fake
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        leftover = fake.containers()
        if leftover:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *leftover], capture_output=True, env=tool_env())
        volumes = fake.volumes()
        if volumes:
            subprocess.run(["podman", "volume", "rm", "-f", *volumes], capture_output=True, env=tool_env())
