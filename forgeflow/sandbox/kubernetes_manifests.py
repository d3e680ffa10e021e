"""Kubernetes manifests of trials, validated with the official client's models, and pod statuses read as
exceptions (the sandbox that creates the pods is :mod:`forgeflow.sandbox.kubernetes`).

**The agent's pod** (``tree_repo`` given) takes the agent's submission where the agent has no hand: the
repository lives on an ``emptyDir`` filled from the image by an init container (``cp -a``) and is read-only
in a sleeping ``tree`` sidecar of the same pristine image, where ``tar`` runs after the agent. No trial pod
shares its process namespace: with ``shareProcessNamespace`` the agent's root could signal the sidecar and
write its root file system through ``/proc/<pid>/root`` (measured under podman with a shared PID namespace);
each container reaps its orphans with a shell as PID 1 (:data:`INIT_SCRIPT`). Requests == limits everywhere
(Guaranteed QoS). Capabilities beyond ``drop: [ALL]`` stay within the PodSecurity *baseline* profile: the init
container ``CHOWN DAC_OVERRIDE FOWNER FSETID``, the sidecar ``DAC_OVERRIDE`` on a read-only mount."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from forgeflow.common import errors
from forgeflow.common.names import sanitize_name
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.limits import SandboxLimits

CONTAINER_NAME = "sandbox"
"""Name of the container of a trial pod that runs the trial's commands (the exec target)."""

TREE_CONTAINER_NAME = "tree"
"""Name of an agent pod's second container: the pristine task image, sleeping; the agent's tree is read there."""

REPO_INIT_CONTAINER_NAME = "repo-init"
"""Name of an agent pod's init container that copies the repository from the image onto the shared volume."""

REPO_VOLUME_NAME = "repo"
"""Name of an agent pod's ``emptyDir`` volume holding the repository."""

REPO_STAGING_PATH = "/forgeflow-repo"
"""Where the init container mounts the repository volume (a path no task image uses)."""

INIT_SCRIPT = "while :; do sleep infinity & wait; done"
"""PID 1 of a trial pod's container (it has its own PID namespace): the shell reaps orphans in ``wait`` and
starts ``sleep`` again if something kills it; signals from inside the namespace do not reach an init
without handlers, so neither the agent nor code under test can end its own container."""

TREE_CPU_M = 100
"""CPU request and limit of the tree sidecar, millicores (``tar`` of a large tree at 10m would take minutes)."""

TREE_MEMORY_MB = 64
"""Memory request and limit of the tree sidecar, MiB (``sleep`` and one ``tar``)."""

TREE_EPHEMERAL_STORAGE_MB = 64
"""Ephemeral-storage request and limit of the tree sidecar, MiB (it writes nothing)."""

INIT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID")
"""Capabilities of the repository's init container: ``cp -a`` keeps any owner, mode and time."""

TREE_CAPABILITIES = ("DAC_OVERRIDE",)
"""Capabilities of the tree sidecar (its mount is read-only): it reads what the agent made unreadable."""


MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"


ROLE_LABEL = "forgeflow.dev/role"


INSTANCE_LABEL = "forgeflow.dev/instance"


TRIAL_LABEL = "forgeflow.dev/trial"


EGRESS_LABEL = "forgeflow.dev/egress"


FLOW_RUN_LABEL = "forgeflow.dev/flow-run"
"""Label of a trial pod naming the Prefect flow run that made it (the sweep of a cancelled run)."""


RESERVED_LABELS = frozenset({MANAGED_BY_LABEL, ROLE_LABEL, INSTANCE_LABEL, TRIAL_LABEL, EGRESS_LABEL})


NETWORK_POLICY_NAME = "forgeflow-trial-deny-egress"


LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
"""Label value grammar (Kubernetes docs, "Labels and Selectors"); length <= 63 checked apart."""


_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")

TRIAL_SELECTOR: dict[str, str] = {MANAGED_BY_LABEL: "forgeflow", ROLE_LABEL: "trial"}
"""Labels every trial pod carries (the selector of :func:`delete_trial_pods`)."""

EGRESS_DENY_SELECTOR: dict[str, str] = {ROLE_LABEL: "trial", EGRESS_LABEL: "deny"}
"""Labels of the trial pods whose egress the NetworkPolicy denies."""



def is_label_key(key: str) -> bool:
    """True if ``key`` is a valid label key: ``[prefix/]name``, prefix a DNS subdomain (<= 253 chars),
    name <= 63 chars of ``[A-Za-z0-9_.-]`` alphanumeric at both ends."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME_RE.match(name))


def is_label_value(value: str) -> bool:
    """True if ``value`` is a valid label value (<= 63 chars, :data:`LABEL_VALUE_RE`)."""
    return len(value) <= 63 and bool(LABEL_VALUE_RE.match(value))


def label_value(raw: str) -> str:
    """Sanitize ``raw`` to a label value (``[a-z0-9-]``, <= 63 chars, an 8-hex sha256 suffix when anything
    changed); a valid lowercase value is returned unchanged.

    Raises:
        InputError: ``raw`` is empty.
    """
    return sanitize_name(raw, 63)


class KubernetesSandboxSpec(SandboxLimits):
    """Where and how big a trial pod is: ``memory_mb`` and ``cpus``
    (:class:`~forgeflow.sandbox.limits.SandboxLimits`) are the pod's request and limit alike (CPUs
    rendered in millicores), as ``--memory`` / ``--cpus`` are a podman container's.

    The image is not part of the spec: it is per trial (the task image in its shard repository) and
    is passed as ``image_ref``, as for :class:`forgeflow.sandbox.podman.PodmanSandbox`.

    Attributes:
        namespace: namespace of the trial pods (a DNS label).
        ephemeral_storage_mb: ephemeral-storage request and limit in MiB (writable layer, logs).
        network: False labels the pod ``forgeflow.dev/egress=deny`` (the NetworkPolicy's selector).
        image_pull_secret: name of a ``kubernetes.io/dockerconfigjson`` Secret in ``namespace``
            (from the registry block), or None for a public/node-authenticated registry.
        automount_service_account_token: False (the default) keeps the API token out of the pod.
        active_deadline_s: seconds after which Kubernetes kills the pod (``DeadlineExceeded``):
            the backstop that ends a trial whose owner died.
        termination_grace_period_s: seconds between SIGTERM and SIGKILL on deletion.
        labels: extra labels (keys must be valid label keys; values are sanitized).
        capabilities: capabilities added back after ``drop: [ALL]`` (none by default, as in the
            podman sandbox: :attr:`SandboxSpec.capabilities <forgeflow.sandbox.base.SandboxSpec>`).
        host_users: False runs the pod in its own user namespace (``hostUsers: false``; Kubernetes
            1.33+ or the ``UserNamespacesSupport`` feature gate, and a runtime with idmapped mounts).
            True by default: a cluster without that support would not start the pod.
    """

    model_config = ConfigDict(frozen=True)

    namespace: str = Field(default="forgeflow", min_length=1, max_length=63)
    ephemeral_storage_mb: int = Field(default=10240, ge=64)
    network: bool = False
    image_pull_secret: str | None = Field(default=None, max_length=253)
    automount_service_account_token: bool = False
    active_deadline_s: int = Field(default=7200, ge=1)
    termination_grace_period_s: int = Field(default=5, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    capabilities: tuple[str, ...] = ()
    host_users: bool = True

    @field_validator("namespace")
    @classmethod
    def _namespace_is_dns_label(cls, value: str) -> str:
        if not _DNS_LABEL_RE.match(value):
            raise ValueError(f"namespace {value!r} is not a DNS label ([a-z0-9-], alphanumeric at both ends)")
        return value

    @field_validator("image_pull_secret")
    @classmethod
    def _secret_is_dns_subdomain(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_SUBDOMAIN_RE.match(value):
            raise ValueError(f"image_pull_secret {value!r} is not a valid Secret name (DNS subdomain)")
        return value

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not is_label_key(key):
                raise ValueError(f"label key {key!r} is not a valid Kubernetes label key")
            if key in RESERVED_LABELS:
                raise ValueError(f"label key {key!r} is reserved for forgeflow")
        return value

    @classmethod
    def from_sandbox_spec(cls, spec: SandboxSpec, **overrides: Any) -> "KubernetesSandboxSpec":
        """The Kubernetes spec with the memory, CPU, network and capabilities of a podman :class:`SandboxSpec`."""
        return cls(**spec.limits().model_dump(), network=spec.network,
                   **{"capabilities": spec.capabilities, **overrides})


def pod_name(instance_id: str, trial_id: str) -> str:
    """The pod name of a trial: ``ff-<instance id>-<trial id[:10]>`` sanitized to a DNS label
    (<= 63 chars; the digest suffix of :func:`~forgeflow.sandbox.trial.sanitize_name` covers the full ids)."""
    return sanitize_name(f"ff-{instance_id}-{trial_id[:10]}", 63)


def _check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise errors.InputError(f"{name} must be a non-empty string, got {value!r}")


def _security_context(capabilities: tuple[str, ...], read_only_root: bool = False) -> dict[str, Any]:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], **({"add": list(capabilities)} if capabilities else {})},
        **({"readOnlyRootFilesystem": True} if read_only_root else {}),
    }


def _tree_parts(image_ref: str, spec: KubernetesSandboxSpec, repo: str, quantities: dict[str, str]) -> dict[str, Any]:
    """The init container, sidecar and volume an agent's pod adds (see the module docstring)."""
    if not repo.startswith("/") or repo.rstrip("/") == "" or any(ch.isspace() for ch in repo) or ".." in repo:
        raise errors.InputError(f"tree_repo {repo!r} must be an absolute directory other than / (no spaces, no ..)")
    tiny = {"cpu": f"{TREE_CPU_M}m", "memory": f"{TREE_MEMORY_MB}Mi",
            "ephemeral-storage": f"{TREE_EPHEMERAL_STORAGE_MB}Mi"}
    return {
        "initContainers": [{
            "name": REPO_INIT_CONTAINER_NAME, "image": image_ref, "imagePullPolicy": "IfNotPresent",
            "command": ["cp", "-a", f"{repo.rstrip('/')}/.", f"{REPO_STAGING_PATH}/"],
            "resources": {"requests": dict(quantities), "limits": dict(quantities)},
            "securityContext": _security_context(INIT_CAPABILITIES),
            "volumeMounts": [{"name": REPO_VOLUME_NAME, "mountPath": REPO_STAGING_PATH}],
        }],
        "sidecar": {
            "name": TREE_CONTAINER_NAME, "image": image_ref, "imagePullPolicy": "IfNotPresent",
            "command": ["sleep", "infinity"],
            "resources": {"requests": dict(tiny), "limits": dict(tiny)},
            "securityContext": _security_context(TREE_CAPABILITIES, read_only_root=True),
            "volumeMounts": [{"name": REPO_VOLUME_NAME, "mountPath": repo, "readOnly": True}],
        },
        "volumes": [{"name": REPO_VOLUME_NAME, "emptyDir": {"sizeLimit": f"{spec.ephemeral_storage_mb}Mi"}}],
    }


def render_trial_pod(instance_id: str, trial_id: str, image_ref: str, spec: KubernetesSandboxSpec,
                     tree_repo: str | None = None) -> dict:
    """Render the Pod manifest of one trial, a JSON-able dict in the API's camelCase form.

    Args:
        tree_repo: an agent's pod: the repository moves onto a volume shared with a ``tree`` sidecar
            (module docstring); None (verifier pods): one container, no volume.

    Raises:
        InputError: an empty id or image reference, or one containing whitespace; a ``tree_repo`` that is
            not an absolute directory other than ``/``.
    """
    _check_id("instance_id", instance_id)
    _check_id("trial_id", trial_id)
    _check_id("image_ref", image_ref)
    if any(ch.isspace() for ch in image_ref):
        raise errors.InputError(f"image_ref {image_ref!r} must not contain whitespace")
    labels = {
        **{key: label_value(value) if value else "" for key, value in spec.labels.items()},
        **TRIAL_SELECTOR,
        INSTANCE_LABEL: label_value(instance_id),
        TRIAL_LABEL: label_value(trial_id),
    }
    if not spec.network:
        labels[EGRESS_LABEL] = "deny"
    quantities = {
        "cpu": f"{max(1, round(spec.cpus * 1000))}m",
        "memory": f"{spec.memory_mb}Mi",
        "ephemeral-storage": f"{spec.ephemeral_storage_mb}Mi",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": spec.automount_service_account_token,
        "enableServiceLinks": False,
        "shareProcessNamespace": False,  # see the module docstring
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "activeDeadlineSeconds": spec.active_deadline_s,
        "terminationGracePeriodSeconds": spec.termination_grace_period_s,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        **({} if spec.host_users else {"hostUsers": False}),
        "containers": [
            {
                "name": CONTAINER_NAME,
                "image": image_ref,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", INIT_SCRIPT],
                "resources": {"requests": dict(quantities), "limits": dict(quantities)},
                "securityContext": _security_context(tuple(spec.capabilities)),
            }
        ],
    }
    if tree_repo is not None:
        tree = _tree_parts(image_ref, spec, tree_repo, quantities)
        main = pod_spec["containers"][0]
        main["volumeMounts"] = [{"name": REPO_VOLUME_NAME, "mountPath": tree_repo}]
        pod_spec["containers"].append(tree["sidecar"])
        pod_spec["initContainers"] = tree["initContainers"]
        pod_spec["volumes"] = tree["volumes"]
    if spec.image_pull_secret:
        pod_spec["imagePullSecrets"] = [{"name": spec.image_pull_secret}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(instance_id, trial_id),
            "namespace": spec.namespace,
            "labels": labels,
            "annotations": {
                "forgeflow.dev/instance-id": instance_id,
                "forgeflow.dev/trial-id": trial_id,
                "forgeflow.dev/image": image_ref,
            },
        },
        "spec": pod_spec,
    }


def render_network_policy(namespace: str, selector_labels: dict[str, str] | None = None) -> dict:
    """Render a NetworkPolicy that denies all egress (DNS included) of the selected pods; ingress is not
    restricted (the exec stream reaches the pod through the kubelet).

    Raises:
        InputError: an empty selector (it would cut every pod of the namespace) or an invalid label or namespace.
    """
    selector = dict(EGRESS_DENY_SELECTOR if selector_labels is None else selector_labels)
    if not selector:
        raise errors.InputError("selector_labels must not be empty: an empty podSelector selects every pod")
    for key, value in selector.items():
        if not is_label_key(key) or not is_label_value(value):
            raise errors.InputError(f"selector label {key!r}={value!r} is not a valid Kubernetes label")
    if not _DNS_LABEL_RE.match(namespace or ""):
        raise errors.InputError(f"namespace {namespace!r} is not a DNS label")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NETWORK_POLICY_NAME, "namespace": namespace, "labels": {MANAGED_BY_LABEL: "forgeflow"}},
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Egress"], "egress": []},
    }


# --- pod status -> exception ---------------------------------------------------------------------
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})


CONTAINER_BROKEN_REASONS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff",
     "PreCreateHookError", "PostStartHookError", "ContainerCannotRun"}
)


_REGISTRY_UNREACHABLE = re.compile(
    r"connection refused|i/o timeout|no such host|dial tcp|TLS handshake timeout|"
    r"503 Service Unavailable|502 Bad Gateway|429 Too Many Requests|toomanyrequests",
    re.IGNORECASE,
)


def _status_of(pod_status: dict) -> dict:
    if not isinstance(pod_status, dict):
        raise errors.InputError(f"pod_status must be a dict (a Pod or its .status), got {type(pod_status).__name__}")
    status = pod_status.get("status")
    return status if isinstance(status, dict) else pod_status


def pod_status_to_exception(pod_status: dict) -> errors.InfraError | None:
    """Read a pod's status (camelCase, a whole Pod or its ``status``) as an exception, or None while Pending
    without such a reason or Running; the message carries the kubelet's reason and message.

    ``DeadlineExceeded``: VerifierTimeoutError; ``Evicted``: SandboxError; ``OOMKilled`` (now or last state):
    SandboxOOMError; a pull failing for an unreachable or throttling registry: RegistryUnavailableError;
    ``ErrImagePull`` / ``ImagePullBackOff`` / ``InvalidImageName``: ImageNotFoundError; container-creation
    failures, a ``Failed`` or ``Succeeded`` pod, or a terminated container of a ``Running`` pod: SandboxError.

    Raises:
        InputError: ``pod_status`` is not a dict.
    """
    status = _status_of(pod_status)
    phase = status.get("phase")
    reason = status.get("reason") or ""
    message = status.get("message") or ""
    if reason == "DeadlineExceeded":
        return errors.VerifierTimeoutError(f"pod exceeded its active deadline (DeadlineExceeded): {message}")
    if reason == "Evicted":
        return errors.SandboxError(f"pod was evicted: {message}")
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for cs in containers:
        for state_key in ("state", "lastState"):
            terminated = (cs.get(state_key) or {}).get("terminated") or {}
            if terminated.get("reason") == "OOMKilled":
                return errors.SandboxOOMError(
                    f"container {cs.get('name')!r} was OOMKilled (exit {terminated.get('exitCode')})"
                )
    for cs in containers:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        w_reason, w_message = waiting.get("reason") or "", waiting.get("message") or ""
        if w_reason in IMAGE_PULL_REASONS:
            if _REGISTRY_UNREACHABLE.search(w_message):
                return errors.RegistryUnavailableError(f"{w_reason} for {cs.get('image')!r}: {w_message}")
            return errors.ImageNotFoundError(f"{w_reason} for {cs.get('image')!r}: {w_message}")
        if w_reason in CONTAINER_BROKEN_REASONS:
            return errors.SandboxError(f"container {cs.get('name')!r} cannot run ({w_reason}): {w_message}")
    if phase == "Failed":
        failed_init = [f"{cs.get('name')!r} exited {t.get('exitCode')} ({t.get('reason')}): {t.get('message') or ''}"
                       for cs in status.get("initContainerStatuses") or []
                       if (t := (cs.get("state") or {}).get("terminated") or {}) and t.get("exitCode")]
        return errors.SandboxError(f"pod failed ({reason or 'no reason'}): {message}"
                                   + "".join(f"; init container {f}" for f in failed_init))
    if phase == "Succeeded":
        return errors.SandboxError("pod succeeded: its sleep infinity ended, the sandbox is gone")
    if phase == "Running":  # a pod of two containers runs on when one ends: each must sleep forever
        for cs in status.get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated")
            if terminated:
                return errors.SandboxError(f"container {cs.get('name')!r} of the running pod terminated "
                                           f"(exit {terminated.get('exitCode')}, {terminated.get('reason')})")
    return None


def _pod_ready(status: dict) -> bool:
    """Running, and every container (the trial's, an agent pod's tree sidecar) ready."""
    if status.get("phase") != "Running":
        return False
    statuses = status.get("containerStatuses") or []
    return any(cs.get("name") == CONTAINER_NAME for cs in statuses) and all(cs.get("ready") for cs in statuses)


_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool}


def _unknown_fields(data: Any, type_name: str, path: str, allowed: frozenset[str]) -> list[str]:
    """Paths in ``data`` that the model ``type_name`` (an ``openapi_types`` string) does not declare, or mistyped."""
    import kubernetes.client.models as models

    if data is None or path in allowed:
        return []
    for prefix in ("Optional[",):
        if type_name.startswith(prefix):
            return _unknown_fields(data, type_name[len(prefix):-1], path, allowed)
    if type_name.startswith(("List[", "list[")):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {type(data).__name__}"]
        inner = type_name[5:-1]
        return [p for i, item in enumerate(data) for p in _unknown_fields(item, inner, f"{path}[{i}]", allowed)]
    if type_name.startswith(("Dict[", "dict(")):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping, got {type(data).__name__}"]
        inner = type_name[5:-1].split(", ", 1)[1]
        return [p for k, v in data.items() for p in _unknown_fields(v, inner, f"{path}.{k}", allowed)]
    if type_name in _PRIMITIVES:
        expected = _PRIMITIVES[type_name]
        if not isinstance(data, expected) or (type_name != "bool" and isinstance(data, bool)):
            return [f"{path}: expected {type_name}, got {type(data).__name__}"]
        return []
    klass = getattr(models, type_name, None)
    if klass is None or not hasattr(klass, "attribute_map"):  # object, datetime, bytes: not checked
        return []
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name}), got {type(data).__name__}"]
    by_json_key = {json_key: attr for attr, json_key in klass.attribute_map.items()}
    out: list[str] = []
    for key, value in data.items():
        sub = f"{path}.{key}" if path else key
        if key not in by_json_key:
            if sub not in allowed:
                out.append(f"{sub}: unknown field of {type_name}")
            continue
        out.extend(_unknown_fields(value, klass.openapi_types[by_json_key[key]], sub, allowed))
    return out


def validate_manifest(manifest: dict, allowed_extra_paths: frozenset[str] = frozenset()) -> Any:
    """Deserialize ``manifest`` into the ``kubernetes`` client's model of its kind and check it: a shipped
    (apiVersion, kind), every key declared with the right JSON type (a typo would be dropped silently by the API
    server), required fields set. ``allowed_extra_paths`` are tolerated (Prefect's worker needs
    ``spec.template.spec.parallelism``/``completions``).

    Raises:
        InputError: unknown kind, unknown fields, wrong types or missing required fields, all listed.
    """
    from kubernetes.client import ApiClient

    if not isinstance(manifest, dict):
        raise errors.InputError(f"a manifest must be a mapping, got {type(manifest).__name__}")
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    model = MODEL_OF_KIND.get(key)  # type: ignore[arg-type]
    if model is None:
        raise errors.InputError(f"manifest kind {key!r} is not one of {sorted(MODEL_OF_KIND)}")
    problems = _unknown_fields(manifest, model, "", allowed_extra_paths)
    if problems:
        raise errors.InputError(f"{key[1]} manifest is invalid: " + "; ".join(problems))
    try:
        return ApiClient()._ApiClient__deserialize(manifest, model)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise errors.InputError(f"{key[1]} manifest is invalid: {exc}") from exc


# --- manifest validation with the official client's models ---------------------------------------
MODEL_OF_KIND: dict[tuple[str, str], str] = {
    ("v1", "Pod"): "V1Pod",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Namespace"): "V1Namespace",
    ("batch/v1", "Job"): "V1Job",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
