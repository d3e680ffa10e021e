"""A loopback fake of the Kubernetes API (core/v1 pods) that runs each pod's container with podman.

This is a fake of the API, not a cluster: no scheduler, no kubelet, no CNI (NetworkPolicies are not
enforced; every container runs with ``--network none``, which is what forgeflow's trial pods ask for).
It serves exactly what forgeflow's Kubernetes sandbox calls through the official ``kubernetes``
client, with the shapes the real API server answers:

* ``POST /api/v1/namespaces/{ns}/pods`` — create (409 ``AlreadyExists``); in the background, as a
  kubelet would: each ``emptyDir`` volume becomes a podman named volume (empty: ``nocopy``), the
  ``initContainers`` run one after another to completion (``podman run``), then every container
  starts (``podman run -d``: the image pulled, memory/CPU limits from its ``resources.limits``, its
  ``command``/``args``, its ``volumeMounts`` (``readOnly`` kept), ``readOnlyRootFilesystem`` as
  ``--read-only``; with ``shareProcessNamespace`` the later containers join the first one's PID
  namespace, else each has its own); the pod ``Pending`` until they run. A failed pull becomes
  ``waiting: ErrImagePull`` with podman's message, as the kubelet reports it; an init container that
  exits non-zero fails the pod (``restartPolicy: Never``), its status ``terminated`` with the exit code.
  Capabilities and the rest of ``securityContext`` are not applied (podman's defaults).
* ``GET .../pods/{name}`` and ``.../pods/{name}/status`` — the status read from ``podman inspect``,
  one ``containerStatuses`` entry per container (``initContainerStatuses`` too): ``Running`` with
  ready containers, or ``terminated`` (``OOMKilled`` when podman says the container was OOM-killed);
  the pod ``Running`` while any container runs, else ``Failed``/``Succeeded``.
* ``DELETE .../pods/{name}`` — ``podman rm -f`` of its containers, then its volumes (404
  ``NotFound`` for an unknown pod).
* ``GET .../pods?labelSelector=k=v,...`` — equality selectors.
* ``GET .../pods/{name}/exec?command=...`` — a websocket speaking ``v4.channel.k8s.io``: binary
  frames whose first byte is the channel (1 stdout, 2 stderr, 3 the status), the status a
  ``metav1.Status`` (``Success``, or ``Failure`` with ``NonZeroExitCode`` and the exit code as the
  ``ExitCode`` cause); the command runs through ``podman exec`` in the container the ``container``
  parameter names (default: the first). A container that is not running answers the upgrade with
  400, an unknown one too, as the API server does.
* ``POST /fake/evict/{ns}/{name}`` (not Kubernetes: the test's handle on the kubelet) — kill the
  container and mark the pod ``Failed``/``Evicted`` with a node-pressure message.
* ``GET /fake/calls`` (not Kubernetes: the test's record of what was asked) — every pod create,
  exec and delete the fake answered, in order: ``{"verb", "namespace", "name"}`` plus the exec's
  ``command`` (argv), ``container`` and ``stdin`` flag, and the created pod's ``labels``.

Run: ``python -m tests.fakes.kubernetes_api --port N --label L``; every container and volume it creates
carries the podman label ``forgeflow-k8s-fake=L`` and is removed when the process gets SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
from datetime import datetime, timezone
from typing import Any

from aiohttp import WSMsgType, web

from forgeflow.common.settings import tool_env
from forgeflow.sandbox.podman import conmon_cwd

V4_CHANNEL = "v4.channel.k8s.io"
GO_MAX_HEADER_BYTES = 1 << 20
"""Go's ``http.DefaultMaxHeaderBytes``: what the API server reads of a request line and headers."""
FAKE_LABEL = "forgeflow-k8s-fake"

_UNREACHABLE = re.compile(r"connection refused|no such host|i/o timeout|dial tcp", re.IGNORECASE)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


def _error(code: int, reason: str, message: str, details: dict | None = None) -> web.Response:
    return web.json_response(_status_body(code, reason, message, details), status=code)


def _memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``8Gi``, ``512Mi``, ``1G``, bytes) in bytes."""
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 1000**2, "G": 1000**3}
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMG])?", str(quantity))
    if match is None:
        raise ValueError(f"memory quantity {quantity!r}")
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def _cpus(quantity: str) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


class Pod:
    """One pod: its manifest, its podman containers and volumes, and what the fake kubelet did to it."""

    def __init__(self, manifest: dict, base: str) -> None:
        self.manifest = manifest
        spec = manifest["spec"]
        self.specs: list[dict] = list(spec["containers"])
        self.init_specs: list[dict] = list(spec.get("initContainers") or [])
        self.containers = {c["name"]: base if i == 0 else f"{base}--{c['name']}"[:250]
                           for i, c in enumerate(self.specs)}
        """Container name -> podman container (the first keeps the pod's base name)."""
        self.init_containers = {c["name"]: f"{base}--init-{c['name']}"[:250] for c in self.init_specs}
        self.volumes = {v["name"]: f"{base}--vol-{v['name']}"[:250] for v in spec.get("volumes") or []}
        self.started = asyncio.Event()
        self.waiting: dict | None = {"reason": "ContainerCreating"}
        self.init_terminated: dict[str, dict] = {}  # init container -> its terminated state
        self.override: dict | None = None  # the status after an eviction
        self.start_task: asyncio.Task | None = None

    @property
    def container(self) -> str:
        """The first container's podman name."""
        return self.containers[self.specs[0]["name"]]

    def all_containers(self) -> list[str]:
        return [*self.init_containers.values(), *self.containers.values()]


class FakeKubernetes:
    """The fake API server's state and handlers (one per process)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.pods: dict[tuple[str, str], Pod] = {}
        self.env = tool_env()
        self.calls: list[dict[str, Any]] = []

    async def _podman(self, *args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec("podman", *args, env=self.env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, cwd=conmon_cwd())
        out, err = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    # --- pods ---------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        try:
            body = await request.json()
            name = body["metadata"]["name"]
            assert body["spec"]["containers"][0]["name"]
            pod = Pod(body, f"k8sfake-{self.label}-{ns}-{name}"[:250])
        except (ValueError, KeyError, IndexError, TypeError, AssertionError) as exc:
            return _error(422, "Invalid", f"Pod is invalid: {exc}")
        if (ns, name) in self.pods:
            return _error(409, "AlreadyExists", f'pods "{name}" already exists',
                          {"name": name, "kind": "pods"})
        body.setdefault("metadata", {}).update(namespace=ns, uid=f"fake-{name}", creationTimestamp=_now())
        self.calls.append({"verb": "create", "namespace": ns, "name": name,
                           "labels": dict(body["metadata"].get("labels") or {})})
        self.pods[(ns, name)] = pod
        pod.start_task = asyncio.create_task(self._start(pod))
        return web.json_response(self._pod_json(ns, name, pod, await self._inspect(pod)), status=201)

    def _run_args(self, pod: Pod, spec: dict, podman_name: str) -> list[str]:
        """``podman run`` options and image + argv of one container spec (no ``-d``)."""
        limits = (spec.get("resources") or {}).get("limits") or {}
        args = ["--name", podman_name, "--label", f"{FAKE_LABEL}={self.label}", "--network", "none"]
        if "memory" in limits:
            args += ["--memory", str(_memory_bytes(limits["memory"]))]
        if "cpu" in limits:
            args += ["--cpus", str(_cpus(limits["cpu"]))]
        if (spec.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            args += ["--read-only"]
        for mount in spec.get("volumeMounts") or []:
            options = "ro,nocopy" if mount.get("readOnly") else "nocopy"  # an emptyDir starts empty
            args += ["-v", f"{pod.volumes[mount['name']]}:{mount['mountPath']}:{options}"]
        first = pod.container
        if pod.manifest["spec"].get("shareProcessNamespace") and podman_name != first and podman_name in \
                pod.containers.values():
            args += ["--pid", f"container:{first}"]
        command = list(spec.get("command") or [])
        if command:
            args += ["--entrypoint", command[0]]
        return [*args, spec["image"], *command[1:], *(spec.get("args") or [])]

    @staticmethod
    def _waiting_for(err: str) -> dict:
        if _UNREACHABLE.search(err) or "manifest unknown" in err or "not found" in err or "pull" in err:
            return {"reason": "ErrImagePull", "message": err.strip()[-400:]}
        return {"reason": "CreateContainerError", "message": err.strip()[-400:]}

    async def _start(self, pod: Pod) -> None:
        try:
            for vol_name, volume in pod.volumes.items():
                vol = next(v for v in pod.manifest["spec"]["volumes"] if v["name"] == vol_name)
                if "emptyDir" not in vol:
                    pod.waiting = {"reason": "CreateContainerConfigError",
                                   "message": f"the fake supports emptyDir volumes only, not {sorted(vol)}"}
                    return
                code, _, err = await self._podman("volume", "create", "--label", f"{FAKE_LABEL}={self.label}", volume)
                if code != 0:
                    pod.waiting = {"reason": "CreateContainerConfigError", "message": err.strip()[-400:]}
                    return
            for spec in pod.init_specs:  # one after another, each to completion
                podman_name = pod.init_containers[spec["name"]]
                code, _, err = await self._podman("run", *self._run_args(pod, spec, podman_name))
                await self._podman("rm", "-f", "-t", "0", podman_name)
                if code == 125:  # podman's own failure: the pull or the container's creation
                    pod.waiting = self._waiting_for(err)
                    return
                pod.init_terminated[spec["name"]] = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                                     "message": err.strip()[-400:]}
                if code != 0:  # restartPolicy Never: the pod failed
                    pod.waiting = None
                    return
            for spec in pod.specs:
                code, _, err = await self._podman("run", "-d", *self._run_args(pod, spec, pod.containers[spec["name"]]))
                if code != 0:
                    pod.waiting = self._waiting_for(err)
                    return
            pod.waiting = None
        finally:
            pod.started.set()

    async def _inspect(self, pod: Pod) -> dict[str, dict] | None:
        """Each started container's podman ``State`` by container name; None before they all started."""
        if not pod.started.is_set() or pod.waiting is not None or len(pod.init_terminated) < len(pod.init_specs) \
                or any(t["exitCode"] for t in pod.init_terminated.values()):
            return None
        _, out, _ = await self._podman("inspect", "--type", "container", *pod.containers.values())
        try:  # a container removed behind the fake's back is missing from the list (podman exits 125)
            by_podman = {item["Name"]: item["State"] for item in json.loads(out or "[]")}
        except (ValueError, KeyError, TypeError):
            return None
        return {name: by_podman[podman] for name, podman in pod.containers.items() if podman in by_podman}

    def _pod_json(self, ns: str, name: str, pod: Pod, states: dict[str, dict] | None) -> dict:
        statuses = []
        for spec in pod.specs:
            cs: dict[str, Any] = {"name": spec["name"], "image": spec["image"], "ready": False, "restartCount": 0,
                                  "imageID": "", "state": {}}
            state = (states or {}).get(spec["name"])
            if pod.override is not None:
                cs["state"] = {"terminated": {"exitCode": 137, "reason": "Error"}}
            elif state is None:
                cs["state"] = {"waiting": dict(pod.waiting or {"reason": "ContainerCreating"})}
            elif state.get("Running"):
                cs.update(ready=True, started=True, state={"running": {"startedAt": _now()}})
            else:
                code = int(state.get("ExitCode") or 0)
                reason = "OOMKilled" if state.get("OOMKilled") else ("Completed" if code == 0 else "Error")
                cs["state"] = {"terminated": {"exitCode": code, "reason": reason}}
            statuses.append(cs)
        status: dict[str, Any] = {"phase": "Pending", "conditions": [], "containerStatuses": statuses}
        if pod.init_specs:
            status["initContainerStatuses"] = [
                {"name": spec["name"], "image": spec["image"], "ready": False, "restartCount": 0, "imageID": "",
                 "state": {"terminated": pod.init_terminated[spec["name"]]} if spec["name"] in pod.init_terminated
                 else {"waiting": {"reason": "PodInitializing"}}} for spec in pod.init_specs]
        terminated = [cs["state"]["terminated"] for cs in statuses if "terminated" in cs["state"]]
        if pod.override is not None:
            status.update(pod.override)
        elif any(t["exitCode"] for t in pod.init_terminated.values()):
            status["phase"] = "Failed"
        elif states is not None and any("running" in cs["state"] for cs in statuses):
            status["phase"] = "Running"
            if all(cs["ready"] for cs in statuses):
                status["conditions"] = [{"type": "Ready", "status": "True"}]
        elif states is not None and terminated and len(terminated) == len(statuses):
            status["phase"] = "Failed" if any(t["exitCode"] for t in terminated) else "Succeeded"
        return {**pod.manifest, "kind": "Pod", "apiVersion": "v1", "status": status}

    def _pod(self, request: web.Request) -> tuple[str, str, Pod | None]:
        ns, name = request.match_info["ns"], request.match_info["name"]
        return ns, name, self.pods.get((ns, name))

    async def read(self, request: web.Request) -> web.Response:
        ns, name, pod = self._pod(request)
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        return web.json_response(self._pod_json(ns, name, pod, await self._inspect(pod)))

    async def _remove(self, pods: list[Pod]) -> None:
        containers = [c for pod in pods for c in pod.all_containers()]
        if containers:  # --ignore: an init container is gone already (one missing name would stop the rest)
            await self._podman("rm", "-f", "--ignore", "-t", "0", *containers)
        volumes = [v for pod in pods for v in pod.volumes.values()]
        if volumes:
            await self._podman("volume", "rm", "-f", *volumes)

    async def delete(self, request: web.Request) -> web.Response:
        ns, name, pod = self._pod(request)
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        del self.pods[(ns, name)]
        self.calls.append({"verb": "delete", "namespace": ns, "name": name})
        if pod.start_task is not None:
            await pod.start_task  # a container being started is removed once it exists
        await self._remove([pod])
        return web.json_response(self._pod_json(ns, name, pod, None))

    async def list(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        wanted = dict(part.split("=", 1) for part in request.query.get("labelSelector", "").split(",") if part)
        items = []
        for (pod_ns, name), pod in list(self.pods.items()):
            labels = pod.manifest.get("metadata", {}).get("labels") or {}
            if pod_ns == ns and all(labels.get(k) == v for k, v in wanted.items()):
                items.append(self._pod_json(pod_ns, name, pod, await self._inspect(pod)))
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    # --- exec over v4.channel.k8s.io ---------------------------------------------------------
    async def exec(self, request: web.Request) -> web.StreamResponse:
        ns, name, pod = self._pod(request)
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found')
        container = request.query.get("container") or pod.specs[0]["name"]
        if container not in pod.containers:
            return _error(400, "BadRequest", f"container {container} is not valid for pod {name}")
        state = (await self._inspect(pod) or {}).get(container)
        if pod.override is not None or not (state or {}).get("Running"):
            return _error(400, "BadRequest", f"container {container} is not running in pod {name}")
        argv = request.query.getall("command", [])
        if not argv:
            return _error(400, "BadRequest", "you must specify at least 1 command")
        ws = web.WebSocketResponse(protocols=(V4_CHANNEL,))
        await ws.prepare(request)
        with_stdin = request.query.get("stdin") in ("true", "1", "True")
        self.calls.append({"verb": "exec", "namespace": ns, "name": name, "command": list(argv), "stdin": with_stdin,
                           "container": container})
        proc = await asyncio.create_subprocess_exec("podman", "exec", *(["-i"] if with_stdin else []),
                                                    pod.containers[container],
                                                    *argv, env=self.env, cwd=conmon_cwd(),  # conmon's oom file
                                                    stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        async def pump(stream: asyncio.StreamReader, channel: int) -> None:
            while chunk := await stream.read(65536):
                await ws.send_bytes(bytes([channel]) + chunk)

        async def closed_by_client() -> None:  # and channel 0 (stdin) into the command
            async for msg in ws:
                if msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                    break
                data = msg.data.encode() if msg.type == WSMsgType.TEXT else msg.data
                if with_stdin and data[:1] == b"\x00" and proc.stdin is not None:
                    try:
                        proc.stdin.write(data[1:])
                        await proc.stdin.drain()
                    except (BrokenPipeError, ConnectionResetError):
                        pass

        watcher = asyncio.create_task(closed_by_client())
        pumps = asyncio.gather(pump(proc.stdout, 1), pump(proc.stderr, 2))
        done, _ = await asyncio.wait({pumps, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if pumps not in done:  # the client hung up (its timeout): the command is left to the pod's end
            proc.kill()
            await proc.wait()
            return ws
        code = await proc.wait()
        if code == 0:
            status = {"metadata": {}, "status": "Success"}
        else:
            status = {"metadata": {}, "status": "Failure", "message": f"command terminated with non-zero exit "
                      f"code: exit status {code}", "reason": "NonZeroExitCode",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        await ws.send_bytes(bytes([3]) + json.dumps(status).encode())
        watcher.cancel()
        await ws.close()
        return ws

    # --- the fake kubelet --------------------------------------------------------------------
    async def evict(self, request: web.Request) -> web.Response:
        ns, name, pod = self._pod(request)
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found')
        pod.override = {"phase": "Failed", "reason": "Evicted",
                        "message": "The node was low on resource: memory. Threshold quantity: 100Mi."}
        await self._podman("kill", *pod.containers.values())
        return web.json_response({"evicted": name})

    async def recorded_calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.calls)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def cleanup(self, app: web.Application) -> None:
        if self.pods:  # the pods still held when the fake stops
            await self._remove(list(self.pods.values()))


def make_app(label: str) -> web.Application:
    """The aiohttp application of the fake (routes above)."""
    fake = FakeKubernetes(label)
    app = web.Application()
    base = "/api/v1/namespaces/{ns}/pods"
    app.router.add_post(base, fake.create)
    app.router.add_get(base, fake.list)
    app.router.add_get(base + "/{name}", fake.read)
    app.router.add_get(base + "/{name}/status", fake.read)
    app.router.add_delete(base + "/{name}", fake.delete)
    app.router.add_get(base + "/{name}/exec", fake.exec)
    app.router.add_post(base + "/{name}/exec", fake.exec)
    app.router.add_post("/fake/evict/{ns}/{name}", fake.evict)
    app.router.add_get("/fake/calls", fake.recorded_calls)
    app.router.add_get("/healthz", fake.healthz)
    app.on_cleanup.append(fake.cleanup)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    # the API server is a Go net/http server: request line + headers up to DefaultMaxHeaderBytes (1 MiB),
    # where aiohttp's default is 8 KiB (an exec's command travels in the URL's query)
    web.run_app(make_app(args.label), host="127.0.0.1", port=args.port, print=None, handle_signals=True,
                max_line_size=GO_MAX_HEADER_BYTES, max_field_size=GO_MAX_HEADER_BYTES)


if __name__ == "__main__":
    main()
