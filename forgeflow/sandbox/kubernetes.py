"""Kubernetes: a pod per trial, its egress-deny NetworkPolicy, and pod statuses read as exceptions.

The scale-out twin of :class:`forgeflow.sandbox.podman.PodmanSandbox`: commands run through the API's exec
subresource; the pod is deleted after the trial (``activeDeadlineSeconds`` bounds a pod whose owner was
killed, :func:`delete_trial_pods` sweeps the rest). The pod (:func:`render_trial_pod`) has Guaranteed QoS,
no API token or service links, no host mounts, non-privileged, RuntimeDefault seccomp, podman's default
capabilities. Egress is denied by :func:`render_network_policy` (enforced only under a CNI that supports
NetworkPolicy: Calico, Cilium, ...).

Not run against a real cluster: tested through the official client against a loopback fake of the API
that runs each pod's container with podman (``tests/fakes/kubernetes_api.py``)."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from forgeflow.common import errors
from forgeflow.sandbox.base import OOM_EXIT_CODE, ExecResult, SandboxSpec
from forgeflow.sandbox.kubernetes_manifests import (
    _DNS_LABEL_RE,
    CONTAINER_NAME,
    TREE_CONTAINER_NAME,
    TRIAL_SELECTOR,
    KubernetesSandboxSpec,
    _pod_ready,
    _status_of,
    pod_status_to_exception,
    render_trial_pod,
)
from forgeflow.sandbox.tree import TREE_MAX_BYTES, TREE_TIMEOUT_S, TreeTooLargeError, tree_tar_argv

STDIN_FRAME_BYTES = 256 * 1024
"""Bytes of file content per stdin frame of :meth:`KubernetesSandbox.write_file`."""


@dataclass(frozen=True)
class _Streamed:
    """What one exec stream gave: the exit code (None: the stream ended without a status), the raw
    bytes of stdout and stderr, seconds, and whether stdout was cut at the caller's byte cap."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    duration_s: float
    truncated: bool = False


# --- the sandbox ---------------------------------------------------------------------------------
def _api_error(exc: Exception) -> tuple[int | None, str]:
    return getattr(exc, "status", None), str(getattr(exc, "reason", "") or exc)


@lru_cache(maxsize=8)
def _configuration(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return configuration
        except config.ConfigException:
            pass
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    except (config.ConfigException, FileNotFoundError, TypeError) as exc:
        where = f"kubeconfig {kubeconfig!r}" if kubeconfig else "in-cluster or kubeconfig"
        raise errors.SandboxError(f"no Kubernetes configuration ({where}"
                                  f"{f', context {context!r}' if context else ''}): {exc}") from exc
    return configuration


def new_core_api(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A ``CoreV1Api`` on an API client of its own: from ``kubeconfig`` (and ``context``) when given, else the
    in-cluster service account, else ``$KUBECONFIG`` / ``~/.kube/config``.

    One client per sandbox: ``kubernetes.stream.stream`` swaps the transport of its client while an exec runs
    (kubernetes-client/python#928).

    Raises:
        SandboxError: no configuration could be loaded (the kubeconfig and context named).
    """
    from kubernetes import client

    return client.CoreV1Api(client.ApiClient(configuration=_configuration(kubeconfig, context)))


class KubernetesSandbox:
    """A trial pod kept alive (``sleep infinity``) while commands run in it through the exec API.

    The same lifecycle and errors as :class:`forgeflow.sandbox.podman.PodmanSandbox`:
    ``start`` -> ``exec``/``write_file``* -> ``stop`` (also a context manager).

    Args:
        image: the task image reference.
        spec: a :class:`KubernetesSandboxSpec`, or a podman :class:`SandboxSpec` (its memory, CPU and
            network are kept), or None for the defaults (8Gi).
        name: the pod name (a DNS label, <= 63 chars, e.g. :func:`forgeflow.sandbox.trial.container_name`);
            default: :func:`pod_name` of the ids.
        api: a ``kubernetes.client.CoreV1Api``; default: one of its own from :func:`new_core_api`
            (``kubeconfig`` and ``context``) at :meth:`start`.
        instance_id, trial_id: the ids labelled on the pod (default: ``name``, else a fresh uuid).
        kubeconfig, context: the cluster, as a :class:`~forgeflow.sandbox.backends.SandboxTarget` names it (the
            kubernetes backend passes its target's): the kubeconfig file (None: in-cluster, else
            ``$KUBECONFIG`` / ``~/.kube/config``) and its context (None: its current context).
        tree_repo: an agent's pod: the repository (``/testbed``) on a volume shared with a sleeping
            ``tree`` sidecar, for :meth:`export_tree`; None (verifier pods): one container.

    Raises (from :meth:`start`/:meth:`exec`):
        ImageNotFoundError / RegistryUnavailableError: the image cannot be pulled.
        SandboxError: the pod could not be created, did not become ready in time, or was evicted.
        SandboxOOMError: a command was killed for memory (exit 137) or the container was OOMKilled.
        VerifierTimeoutError: a command exceeded ``timeout_s``.
    """

    start_timeout_s: float = 600.0
    """Seconds :meth:`start` waits for the container to become ready."""

    poll_interval_s: float = 1.0
    """Seconds between pod status reads while :meth:`start` waits."""

    def __init__(
        self,
        image: str,
        spec: KubernetesSandboxSpec | SandboxSpec | None = None,
        name: str | None = None,
        *,
        api: Any = None,
        instance_id: str | None = None,
        trial_id: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        tree_repo: str | None = None,
    ) -> None:
        if isinstance(spec, SandboxSpec):
            spec = KubernetesSandboxSpec.from_sandbox_spec(spec)
        self.spec = spec or KubernetesSandboxSpec()
        self.image = image
        fallback = name or f"ff-{uuid.uuid4().hex[:12]}"
        self.tree_repo = tree_repo
        self.manifest = render_trial_pod(instance_id or fallback, trial_id or fallback, image, self.spec,
                                         tree_repo=tree_repo)
        if name is not None:
            if len(name) > 63 or not _DNS_LABEL_RE.match(name):
                raise errors.InputError(f"pod name {name!r} is not a DNS label of <= 63 chars")
            self.manifest["metadata"]["name"] = name
        self.name: str = self.manifest["metadata"]["name"]
        self.namespace = self.spec.namespace
        self._api = api
        self.kubeconfig, self.context = kubeconfig, context
        self._created = False
        self._oom_kills_seen = 0
        self._api_lock = threading.RLock()
        """Held around every call on the API client: ``kubernetes.stream.stream`` swaps the client's
        ``call_api`` while an exec connects, so an exec from another thread (the agent's hang watchdog,
        :meth:`forgeflow.evaluation.sandbox_env.SandboxEnvironment.interrupt`) must not overlap a REST
        call or another connect on the same client."""

    def __enter__(self) -> "KubernetesSandbox":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = new_core_api(self.kubeconfig, self.context)
        return self._api

    def _read_status(self) -> dict:
        """The pod's status (camelCase); SandboxError when the pod is gone or the API fails."""
        try:
            with self._api_lock:
                pod = self.api.read_namespaced_pod_status(name=self.name, namespace=self.namespace)
        except Exception as exc:  # kubernetes.client.ApiException and urllib3 errors
            status, reason = _api_error(exc)
            if status == 404:
                raise errors.SandboxError(f"pod {self.name} is gone (deleted while the trial ran)") from exc
            if status is None or status >= 500 or status == 429:
                raise errors.TransientInfraError(f"could not read pod {self.name}: {reason}") from exc
            raise errors.SandboxError(f"could not read pod {self.name} (HTTP {status}): {reason}") from exc
        data = pod if isinstance(pod, dict) else self.api.api_client.sanitize_for_serialization(pod)
        return _status_of(data)

    def start(self) -> None:
        """Create the pod and wait until its container is ready; on failure delete it and raise."""
        api = self.api  # no configuration is a SandboxError of its own, not a transient create failure
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                with self._api_lock:
                    api.create_namespaced_pod(namespace=self.namespace, body=self.manifest)
                break
            except Exception as exc:  # kubernetes.client.ApiException and urllib3 errors
                status, reason = _api_error(exc)
                if status == 409 and time.monotonic() < deadline:  # left by a killed run of this trial
                    self._created = True
                    self.stop()
                    time.sleep(self.poll_interval_s)
                    continue
                if status is None or status >= 500 or status == 429:
                    raise errors.TransientInfraError(f"could not create pod {self.name}: {reason}") from exc
                raise errors.SandboxError(f"could not create pod {self.name} (HTTP {status}): {reason}") from exc
        self._created = True
        status: dict = {}
        while True:
            status = self._read_status()
            problem = pod_status_to_exception(status)
            if problem is not None:
                self.stop()
                raise problem
            if _pod_ready(status):
                return
            if time.monotonic() >= deadline:
                self.stop()
                conditions = "; ".join(
                    f"{c.get('type')}={c.get('status')} {c.get('reason') or ''} {c.get('message') or ''}".strip()
                    for c in status.get("conditions") or []
                )
                raise errors.SandboxError(
                    f"pod {self.name} not ready after {self.start_timeout_s:.0f} s "
                    f"(phase {status.get('phase')}; {conditions or 'no conditions'})"
                )
            time.sleep(self.poll_interval_s)

    def _argv(self, command: list[str] | str, workdir: str | None) -> list[str]:
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        if workdir:  # the exec API has no working directory: cd in a POSIX shell, then exec argv
            argv = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", workdir, *argv]
        return argv

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None,
             env: Mapping[str, str] | None = None) -> ExecResult:
        """Run ``command`` (argv, or one string for ``bash -c``) in the container through the exec API.

        A timeout closes the stream (the process dies with the pod in :meth:`stop`); ``env`` is passed as
        ``env K=V ... argv`` (the exec API has none).

        Raises:
            SandboxError: a non-zero exit while the pod was evicted, failed or deleted.
            SandboxOOMError: exit 137 *and* the kernel's evidence (``OOMKilled`` status, or a new ``oom_kill`` in
                the memory cgroup); exit 137 alone is the command's result.
            VerifierTimeoutError: the command exceeded ``timeout_s`` seconds.
        """
        argv = self._argv(command, workdir)
        if env:
            argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
        return self._exec(argv, timeout_s)

    def _exec(self, argv: list[str], timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """:meth:`exec` of ``argv``, with ``stdin`` sent on the stdin channel (the command must stop
        reading by itself: ``v4.channel.k8s.io`` cannot close a channel)."""
        got = self._stream(argv, timeout_s, stdin=stdin)
        if got.exit_code is None:
            self._raise_if_pod_broken()
            raise errors.SandboxError(f"exec in pod {self.name} ended without an exit status")
        if got.exit_code != 0:  # evicted, OOMKilled or deleted while it ran: the pod status says so
            self._raise_if_pod_broken()
        if got.exit_code == OOM_EXIT_CODE:
            evidence = self._oom_kill_evidence()
            if evidence is not None:
                raise errors.SandboxOOMError(
                    f"command {argv!r} in pod {self.name} was OOM-killed (exit 137, memory limit "
                    f"{self.spec.memory_mb} MiB; evidence: {evidence})"
                )
        return ExecResult.from_bytes(got.exit_code, got.stdout, got.stderr, got.duration_s)

    def _stream(self, argv: list[str], timeout_s: float, *, stdin: bytes | None = None,
                container: str = CONTAINER_NAME, max_stdout_bytes: int | None = None) -> _Streamed:
        """Run ``argv`` in ``container`` through the exec subresource and collect its raw output bytes.

        Raises:
            SandboxError: the exec could not start (the pod status is read first: evicted, gone).
            VerifierTimeoutError: ``timeout_s`` passed.
        """
        from kubernetes.stream import stream

        if not self._created:
            raise errors.SandboxError(f"sandbox {self.name} is not started")
        t0 = time.monotonic()
        try:
            with self._api_lock:  # the connect only: the stream itself has a websocket of its own
                resp = stream(
                    self.api.connect_get_namespaced_pod_exec, self.name, self.namespace,
                    command=argv, container=container, binary=True,
                    stdin=stdin is not None, stdout=True, stderr=True, tty=False, _preload_content=False,
                )
        except Exception as exc:
            self._raise_if_pod_broken()
            raise errors.SandboxError(f"exec in pod {self.name} (container {container}) failed: {exc}") from exc
        out: list[bytes] = []
        err: list[bytes] = []
        size, truncated, exit_code = 0, False, None
        try:
            for i in range(0, len(stdin or b""), STDIN_FRAME_BYTES):
                resp.write_stdin(stdin[i : i + STDIN_FRAME_BYTES])  # type: ignore[index]
            while resp.is_open() and not truncated:
                remaining = timeout_s - (time.monotonic() - t0)
                if remaining <= 0:
                    raise errors.VerifierTimeoutError(
                        f"command {argv!r} in pod {self.name} exceeded {timeout_s:.0f} s"
                    )
                resp.update(timeout=min(remaining, 1.0))
                if resp.peek_stdout():
                    out.append(resp.read_stdout())
                    size += len(out[-1])
                    truncated = max_stdout_bytes is not None and size > max_stdout_bytes
                if resp.peek_stderr():
                    err.append(resp.read_stderr())
            if not truncated:
                try:
                    exit_code = resp.returncode
                except (KeyError, IndexError, TypeError, ValueError, AttributeError):
                    exit_code = None  # a status without an exit code: the stream broke, not the command
        finally:
            resp.close()
        return _Streamed(exit_code, b"".join(out), b"".join(err), time.monotonic() - t0, truncated)

    def export_tree(self, max_bytes: int = TREE_MAX_BYTES, timeout_s: float = TREE_TIMEOUT_S) -> bytes:
        """The agent's tree as a tar archive, taken in the pod's ``tree`` sidecar where the agent has no hand
        (the twin of :func:`forgeflow.sandbox.tree.export_tree`).

        Raises:
            InputError: the pod was made without ``tree_repo`` (no sidecar).
            SandboxError: the pod is gone, evicted or failed, or the sidecar cannot run ``tar``.
            TreeTooLargeError: the tree is over ``max_bytes``, or ``tar`` took over ``timeout_s`` (the agent's outcome).
        """
        if self.tree_repo is None:
            raise errors.InputError(f"pod {self.name} has no tree sidecar (made without tree_repo)")
        self._raise_if_tree_broken()  # gone (404), evicted, failed: before any exec
        try:
            got = self._stream(tree_tar_argv(self.tree_repo), timeout_s, container=TREE_CONTAINER_NAME,
                               max_stdout_bytes=max_bytes)
        except errors.VerifierTimeoutError as exc:
            self._raise_if_tree_broken()
            raise TreeTooLargeError(f"the agent's tree {self.tree_repo} took over {timeout_s:.0f} s to archive "
                                    f"(pod {self.name} healthy)") from exc
        if got.truncated:
            raise TreeTooLargeError(f"the agent's tree {self.tree_repo} is over {max_bytes} bytes of tar")
        if got.exit_code not in (0, 1):  # 1: a file changed while read
            self._raise_if_tree_broken()
            raise errors.SandboxError(f"tar of the agent's tree in pod {self.name} (container "
                                      f"{TREE_CONTAINER_NAME}) exited {got.exit_code}: "
                                      f"{got.stderr.decode(errors='replace').strip()[-300:]}")
        return got.stdout

    def _oom_kill_evidence(self) -> str | None:
        """A new ``oom_kill`` count in the container's memory cgroup since the last check, or None."""
        probe = self.exec(["sh", "-c", "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control "
                           "2>/dev/null"], timeout_s=30)
        match = re.search(r"^oom_kill (\d+)$", probe.stdout, re.MULTILINE)
        if match is None:
            return None
        count, seen = int(match.group(1)), self._oom_kills_seen
        self._oom_kills_seen = count
        return f"memory cgroup oom_kill {seen} -> {count}" if count > seen else None

    def _raise_if_pod_broken(self) -> None:
        problem = pod_status_to_exception(self._read_status())
        if problem is not None:
            raise problem

    def _raise_if_tree_broken(self) -> None:
        """SandboxError when the pod is gone, evicted or past its deadline, or its tree sidecar is not
        running; the agent's own container may have ended (its tree is on the volume all the same)."""
        status = self._read_status()
        others = [cs for cs in status.get("containerStatuses") or [] if cs.get("name") != CONTAINER_NAME]
        problem = pod_status_to_exception({**status, "containerStatuses": others})
        if problem is not None:
            raise errors.SandboxError(f"the agent's tree in pod {self.name} cannot be taken: "
                                      f"{type(problem).__name__}: {problem}") from problem
        tree = next((cs for cs in others if cs.get("name") == TREE_CONTAINER_NAME), {})
        if "running" not in (tree.get("state") or {}):
            raise errors.SandboxError(f"the tree sidecar of pod {self.name} is not running: {tree.get('state')}")

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file inside the container in one exec: its bytes on stdin to ``head -c <size>``
        (``v4.channel.k8s.io`` has no end-of-stdin).

        Raises:
            SandboxError: the write failed (its stderr in the message) or the pod broke.
        """
        data = content.encode() if isinstance(content, str) else bytes(content)
        result = self._exec(["sh", "-c", 'head -c "$2" > "$1"', "sh", path, str(len(data))], timeout_s=120,
                            stdin=data)
        if result.exit_code != 0:
            raise errors.SandboxError(f"could not write {path} in pod {self.name}: {result.stderr.strip()}")

    def stop(self) -> None:
        """Delete the pod now (grace 0, idempotent; a pod already gone is fine)."""
        if not self._created:
            return
        try:
            with self._api_lock:
                self.api.delete_namespaced_pod(
                    name=self.name, namespace=self.namespace, grace_period_seconds=0, propagation_policy="Background"
                )
        except Exception as exc:
            status, reason = _api_error(exc)
            if status != 404:
                raise errors.SandboxError(f"could not delete pod {self.name}: {reason}") from exc
        self._created = False

    def stop_async(self) -> Callable[[], None]:
        """Delete the pod (one API call: the API server removes it in the background) and return a
        no-op waiter (the :class:`~forgeflow.sandbox.base.Sandbox` protocol)."""
        self.stop()
        return lambda: None


def delete_trial_pods(api: Any, namespace: str, extra_selector: dict[str, str] | None = None) -> list[str]:
    """Delete every forgeflow trial pod in ``namespace`` (``extra_selector`` narrows it); the names deleted, sorted."""
    selector = ",".join(f"{k}={v}" for k, v in {**TRIAL_SELECTOR, **(extra_selector or {})}.items())
    pods = api.list_namespaced_pod(namespace=namespace, label_selector=selector)
    names = sorted(p.metadata.name for p in pods.items)
    for name in names:
        try:
            api.delete_namespaced_pod(name=name, namespace=namespace, grace_period_seconds=0)
        except Exception as exc:
            if _api_error(exc)[0] != 404:
                raise errors.SandboxError(f"could not delete pod {name}: {exc}") from exc
    return names
