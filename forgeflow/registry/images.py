"""Container images for real projects: the Debian base image, environment images and task images.

base (a debootstrap bookworm ``minbase`` rootfs with python3, pytest, git: 57 s, ~166 MB on 2 cores, cached
per machine), env (base + a project's pristine checkout at ``/testbed``), task (env + one bug, git history
re-initialised). Tags derive from input digests, so a rebuild of the same inputs is an existence check."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import (
    ImageBuildError,
    ImageNotFoundError,
    InputError,
    PatchApplyError,
    ToolMissingError,
)
from forgeflow.common.fsutil import (
    atomic_write_text,
    file_lock,
    sha256_bytes,
    sha256_file,
    sha256_json,
)
from forgeflow.common.settings import cache_dir, tool_env
from forgeflow.registry.projects import (
    GIT_IDENTITY_ENV,
    Project,
    git_commit_all,
)
from forgeflow.registry.skopeo import Skopeo

BASE_IMAGE_TAG = "localhost/forgeflow/base:bookworm"
"""The default tag of the imported base image."""

DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pytest", "git", "patch")
"""Packages added to the minbase variant (git and patch: trials apply patches with them)."""

SOURCE_DATE_EPOCH = 1_700_000_000
"""Fixed mtime ceiling (2023-11-14T22:13:20Z) used for the rootfs tarball and git commits, so the
tarball and commits are reproducible for the same inputs."""

_DEBOOTSTRAP_TIMEOUT_S = 1800
_PODMAN_TIMEOUT_S = 900
_CLEAN_PATHS = (
    "var/cache/apt",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/log",
    "var/cache/debconf/templates.dat-old",
    "var/cache/debconf/config.dat-old",
)


class ImageRef(BaseModel):
    """A local container image."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1, description="the tag it is known by (localhost/forgeflow/...:...).")
    image_id: str = Field(pattern=r"^[0-9a-f]{64}$",
                          description="podman's image id (64 hex characters, the config digest without sha256:).")


# --- helpers -----------------------------------------------------------------------------------
def _require_tool(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ToolMissingError(f"{tool} is not installed (needed to build forgeflow images)")
    return path


def _podman(
    *args: str, timeout_s: float = _PODMAN_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess[str]:
    _require_tool("podman")
    try:
        proc = subprocess.run(
            ["podman", *args], env=tool_env(), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise ImageBuildError(f"podman {' '.join(args[:2])} timed out after {timeout_s} s") from exc
    if check and proc.returncode != 0:
        raise ImageBuildError(
            f"podman {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return proc


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """Return the Debian mirror URL configured for ``bookworm`` on this machine.

    Raises:
        InputError: no apt source serves ``bookworm``.
    """
    files = [sources_dir / "sources.list"]
    files += sorted((sources_dir / "sources.list.d").glob("*.sources"))
    files += sorted((sources_dir / "sources.list.d").glob("*.list"))
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                line = line.strip()
                if line.startswith("#") or not line:
                    continue
                one_line = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
                if one_line and one_line.group(2) == DEBIAN_SUITE:
                    return one_line.group(1).rstrip("/")
                key, sep, value = line.partition(":")
                if sep and " " not in key:
                    fields[key.strip().lower()] = value.strip()
            if DEBIAN_SUITE in fields.get("suites", "").split() and "deb" in fields.get("types", "").split():
                uris = fields.get("uris", "").split()
                if uris:
                    return uris[0].rstrip("/")
    raise InputError(f"no apt source under {sources_dir} serves the {DEBIAN_SUITE!r} suite")


# --- base rootfs and image ---------------------------------------------------------------------
def base_rootfs_path() -> Path:
    """Path of the cached base rootfs tarball (it may not exist yet)."""
    return cache_dir() / "base" / f"debian-{DEBIAN_SUITE}-minbase.tar"


def _verify_sidecar(tarball: Path) -> bool:
    sidecar = tarball.with_name(tarball.name + ".sha256")
    if not (tarball.is_file() and sidecar.is_file()):
        return False
    expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    return expected == sha256_file(tarball)


def ensure_base_rootfs() -> Path:
    """Build (once per machine) the Debian bookworm minbase rootfs tarball (~170-200 MB) and return its path.

    Raises:
        ToolMissingError: debootstrap or tar is missing.
        ImageBuildError: debootstrap or tar failed (the message carries the tail of its log).
    """
    tarball = base_rootfs_path()
    if _verify_sidecar(tarball):
        return tarball
    with file_lock(tarball.parent / ".build.lock"):
        if _verify_sidecar(tarball):
            return tarball
        _require_tool("debootstrap")
        _require_tool("tar")
        mirror = debian_mirror()
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=tarball.parent))
        try:
            rootfs = work / "rootfs"
            cmd = [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                DEBIAN_SUITE,
                str(rootfs),
                mirror,
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_DEBOOTSTRAP_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                raise ImageBuildError(f"debootstrap timed out after {_DEBOOTSTRAP_TIMEOUT_S} s") from exc
            if proc.returncode != 0:
                log = (rootfs / "debootstrap" / "debootstrap.log")
                tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
                raise ImageBuildError(
                    f"debootstrap from {mirror} failed (exit {proc.returncode}): "
                    f"{proc.stderr.strip()[-1500:]} {tail}"
                )
            for rel in _CLEAN_PATHS:
                target = rootfs / rel
                if target.is_dir() and not target.is_symlink():
                    for child in target.iterdir():
                        if child.is_dir() and not child.is_symlink():
                            shutil.rmtree(child)
                        else:
                            child.unlink()
                elif target.exists():
                    target.unlink()
            out = work / tarball.name
            tar_cmd = [
                "tar",
                "--sort=name",
                "--numeric-owner",
                f"--mtime=@{SOURCE_DATE_EPOCH}",
                "--clamp-mtime",
                "--xattrs",
                "-C",
                str(rootfs),
                "-cf",
                str(out),
                ".",
            ]
            proc = subprocess.run(tar_cmd, capture_output=True, text=True, timeout=_DEBOOTSTRAP_TIMEOUT_S)
            if proc.returncode != 0:
                raise ImageBuildError(f"tar of the base rootfs failed: {proc.stderr.strip()[-2000:]}")
            digest = sha256_file(out)
            os.replace(out, tarball)
            atomic_write_text(tarball.with_name(tarball.name + ".sha256"), f"{digest}  {tarball.name}\n")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return tarball


def image_exists(ref: str) -> bool:
    """Return True if ``ref`` (a tag or image id) exists in local podman storage.

    Raises:
        ToolMissingError: podman is not installed.
    """
    return _podman("image", "exists", ref, check=False, timeout_s=60).returncode == 0


def registry_repo(ref: str) -> tuple[str, str] | None:
    """``host[:port]/repo:tag`` -> (``host[:port]/repo``, tag); None for a local name (no registry host, or
    ``localhost/...``) or a digest reference."""
    first, _, rest = ref.partition("/")
    if not rest or "@" in ref or first == "localhost" or not ("." in first or ":" in first):
        return None
    repo, sep, tag = rest.rpartition(":")
    return (f"{first}/{repo}", tag) if sep and "/" not in tag else None


def available(refs: Iterable[str]) -> list[str]:
    """Which of ``refs`` exist: one ``skopeo list-tags`` per registry repository, one ``podman image exists``
    per local name (a registry ref needs no local copy).

    Raises:
        RegistryUnavailableError: a registry does not answer.
        ToolMissingError: skopeo or podman is missing.
    """
    by_repo: dict[str, set[str]] = {}
    local: list[str] = []
    for ref in set(refs):
        split = registry_repo(ref)
        if split is None:
            local.append(ref)
        else:
            by_repo.setdefault(split[0], set()).add(split[1])
    found = [ref for ref in local if image_exists(ref)]
    skopeo = Skopeo()
    for repo, tags in by_repo.items():
        try:
            present = set(skopeo.list_tags(f"docker://{repo}"))
        except ImageNotFoundError:
            present = set()
        found.extend(f"{repo}:{tag}" for tag in tags & present)
    return sorted(found)


def image_id(ref: str) -> str:
    """Return the full image id (64 hex characters) of the local image ``ref``.

    Raises:
        ImageNotFoundError: ``ref`` is not in local storage.
    """
    proc = _podman("image", "inspect", "--format", "{{.Id}}", ref, check=False, timeout_s=60)
    if proc.returncode != 0:
        raise ImageNotFoundError(f"image {ref!r} is not in local podman storage: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[0].removeprefix("sha256:")


def _ref(tag: str) -> ImageRef:
    return ImageRef(name=tag, image_id=image_id(tag))


def ensure_base_image(tag: str = BASE_IMAGE_TAG) -> ImageRef:
    """Return the base image, importing the cached rootfs with ``podman import`` if ``tag`` is missing.

    Raises:
        ImageBuildError: the rootfs could not be built or imported.
    """
    if image_exists(tag):
        return _ref(tag)
    tarball = ensure_base_rootfs()
    with file_lock(cache_dir() / "base" / ".import.lock"):
        if not image_exists(tag):
            _podman(
                "import",
                "--change", "CMD [\"/bin/bash\"]",
                "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--change", "ENV LANG=C.UTF-8",
                str(tarball),
                tag,
            )
    return _ref(tag)


# --- environment and task images ----------------------------------------------------------------
INPUTS_LABEL = "io.forgeflow.inputs-sha256"
"""Image label holding the sha256 of everything a build depended on (checked before a rebuild)."""

_TAG_CHARS = re.compile(r"[^a-z0-9_.-]+")


def _safe_tag_part(text: str, max_chars: int) -> str:
    cleaned = _TAG_CHARS.sub("-", text.lower()).strip("-.") or "x"
    return cleaned[:max_chars].rstrip("-.")


def _label(ref: str, key: str) -> str | None:
    proc = _podman("image", "inspect", "--format", "{{json .Labels}}", ref, check=False, timeout_s=60)
    if proc.returncode != 0:
        return None
    labels = json.loads(proc.stdout.strip().splitlines()[0] or "null") or {}
    return labels.get(key)


def _existing(tag: str, inputs_sha256: str) -> ImageRef | None:
    """The image under ``tag`` if it exists and was built from the same inputs."""
    if image_exists(tag) and _label(tag, INPUTS_LABEL) == inputs_sha256:
        return _ref(tag)
    return None


def _build(context: Path, containerfile: str, tag: str, labels: dict[str, str]) -> ImageRef:
    with tempfile.TemporaryDirectory(prefix="forgeflow-build-") as tmp:
        cfile = Path(tmp) / "Containerfile"
        cfile.write_text(containerfile)
        # --timestamp: the image's created time and every file's mtime in its layers are fixed, so the
        # same inputs give the same image id (and registry digest) on every machine and in every home
        args = ["build", "--pull=never", "--network=none", f"--timestamp={SOURCE_DATE_EPOCH}", "-f", str(cfile),
                "-t", tag]
        for key, value in sorted(labels.items()):
            args += ["--label", f"{key}={value}"]
        _podman(*args, str(context))
    return _ref(tag)


def _git_head(root: Path) -> str:
    proc = subprocess.run(
        ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise InputError(f"checkout {root} is not a git repository: {proc.stderr.strip()}")
    if proc.stdout.strip():
        raise InputError(f"checkout {root} has uncommitted changes:\n{proc.stdout[:1000]}")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=60
    )
    if head.returncode != 0:
        raise InputError(f"checkout {root} has no commit: {head.stderr.strip()}")
    return head.stdout.strip()


def build_env_image(
    project: Project, checkout_dir: Path, base_image: str, tag: str | None = None
) -> ImageRef:
    """Build the environment image of ``project``: ``base_image`` + the pristine checkout at ``/testbed``.

    Args:
        tag: the tag to give the image (default derived from the inputs digest).

    Raises:
        InputError: ``checkout_dir`` is not a clean git checkout at ``project.pristine_commit``.
        ImageNotFoundError: ``base_image`` is not in local storage.
        ImageBuildError: ``podman build`` failed.
    """
    checkout_dir = Path(checkout_dir).resolve()
    head = _git_head(checkout_dir)
    if head != project.pristine_commit:
        raise InputError(
            f"checkout {checkout_dir} is at commit {head}, expected {project.name}'s pristine "
            f"commit {project.pristine_commit} (use forgeflow.registry.projects.prepare_checkout)"
        )
    base_id = image_id(base_image)
    image_fields = project.model_dump(include={"name", "version", "sha256", "pythonpath"})
    inputs = sha256_json({"kind": "env", "base": base_id, "project": image_fields, "head": head})
    name, version = _safe_tag_part(project.name, 60), _safe_tag_part(project.version, 40)
    tag = tag or f"localhost/forgeflow/env-{name}:{version}-{inputs[:12]}"
    existing = _existing(tag, inputs)
    if existing is not None:
        return existing
    containerfile = (
        f"FROM {base_id}\n"
        "COPY . /testbed\n"
        "WORKDIR /testbed\n"
        f"ENV PYTHONPATH={project.pythonpath} PYTHONDONTWRITEBYTECODE=1\n"
        "RUN git config --global --add safe.directory /testbed\n"
    )
    labels = {
        INPUTS_LABEL: inputs,
        "io.forgeflow.project": project.name,
        "io.forgeflow.project-version": project.version,
        "io.forgeflow.pristine-commit": head,
    }
    return _build(checkout_dir, containerfile, tag, labels)


def build_task_image(env_image: str, instance_id: str, bug_patch: str, tag: str | None = None) -> ImageRef:
    """Build a task image: ``env_image`` with ``bug_patch`` applied to ``/testbed`` and fresh history.

    Args:
        tag: the tag to give the image (default derived from the inputs digest).

    Raises:
        PatchApplyError: the patch is empty or does not apply (the message names ``instance_id``
            and carries git's error).
        ImageNotFoundError: ``env_image`` is not in local storage.
        ImageBuildError: ``podman`` failed.
    """
    if not instance_id:
        raise InputError("instance_id must not be empty")
    env_id = image_id(env_image)
    inputs = sha256_json(
        {"kind": "task", "env": env_id, "instance_id": instance_id, "patch": sha256_bytes(bug_patch.encode())}
    )
    tag = tag or f"localhost/forgeflow/task:{_safe_tag_part(instance_id, 110)}-{inputs[:12]}"
    existing = _existing(tag, inputs)
    if existing is not None:
        return existing
    if not bug_patch.strip():
        raise PatchApplyError(f"task {instance_id}: the bug patch is empty")
    with tempfile.TemporaryDirectory(prefix="forgeflow-task-") as tmp:
        work = Path(tmp)
        container = _podman("create", env_id, "true", timeout_s=120).stdout.strip()
        try:
            _podman("cp", f"{container}:/testbed", str(work / "testbed"), timeout_s=300)
        finally:
            _podman("rm", "-f", container, check=False, timeout_s=120)
        testbed = work / "testbed"
        patch_file = work / "bug.patch"
        patch_file.write_text(bug_patch if bug_patch.endswith("\n") else bug_patch + "\n")
        env = dict(os.environ)
        env.update(GIT_IDENTITY_ENV)
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch_file)],
            cwd=testbed, env=env, capture_output=True, text=True, timeout=120,
        )
        if proc.returncode != 0:
            raise PatchApplyError(
                f"task {instance_id}: the bug patch does not apply to {env_image}: "
                f"{proc.stderr.strip()[:1500]}"
            )
        shutil.rmtree(testbed / ".git")
        git_commit_all(testbed, "task")
        containerfile = (
            f"FROM {env_id}\n"
            "RUN rm -rf /testbed\n"
            "COPY testbed /testbed\n"
        )
        labels = {INPUTS_LABEL: inputs, "io.forgeflow.instance-id": instance_id}
        # The context holds only the bugged tree; the patch file is excluded.
        patch_file.unlink()
        return _build(work, containerfile, tag, labels)
