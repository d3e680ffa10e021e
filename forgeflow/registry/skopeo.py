"""A small typed wrapper over skopeo, run with :func:`subprocess.run` (an argument list, no shell).

Digests are the registry's truth: :meth:`Skopeo.inspect_digest` hashes the manifest bytes exactly
as served (``inspect --raw``), which is what a pull by digest checks. Pushing from
``containers-storage`` recompresses layers, so the pushed digest differs from the local image id
(measured with skopeo 1.9): callers pass ``preserve_digests=False`` there and record the returned digest."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from forgeflow.common.errors import (
    ForgeflowError,
    ImageNotFoundError,
    InfraError,
    InputError,
    RegistryError,
    RegistryUnavailableError,
    ToolMissingError,
)
from forgeflow.common.fsutil import sha256_bytes
from forgeflow.common.settings import tool_env
from forgeflow.registry.auth import scrub, secrets_of

SKOPEO_BINARY = "skopeo"
KILL_GRACE_S = 30.0
"""Seconds a skopeo command may run past its own ``--command-timeout`` before it is killed."""

INDEX_MEDIA_TYPES = frozenset(
    {
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)
"""Media types of multi-arch indexes (manifest lists)."""

_NOT_FOUND = re.compile(
    r"manifest unknown|name unknown|not found|status code from registry 404|"
    r"does not resolve to an image|image not known|no such image|identifier is not an image",
    re.IGNORECASE,
)
_UNAUTHORIZED = re.compile(
    r"\b401\b|unauthorized|authentication required|denied|invalid username/password",
    re.IGNORECASE,
)
_UNAVAILABLE = re.compile(
    r"connection refused|connection reset|no route to host|i/o timeout|timeout|"
    r"deadline exceeded|too many requests|toomanyrequests|unexpected EOF|"
    r"server misbehaving|temporary failure|service unavailable|bad gateway|"
    # an HTTP status 429 or 5xx as skopeo words it ("received unexpected HTTP status: 503 ...",
    # "invalid status code from registry 502 (Bad Gateway)", "... task-06: 500 (Internal Server Error)"),
    # not any 3 digits (a port, a tag)
    r"(?:status|code)\D{0,20}\b(?:429|5\d\d)\b|\b(?:429|5\d\d) \(?(?:Too Many|Internal Server|Bad Gateway|"
    r"Service Unavailable|Gateway Time)",
    re.IGNORECASE,
)
_TRANSPORTS = ("docker://", "containers-storage:", "oci:", "oci-archive:", "dir:", "docker-archive:")


def classify_error(ref: str, stderr: str) -> InfraError:
    """Map skopeo's stderr for an operation on ``ref`` to a forgeflow exception (returned, not raised)."""
    detail = _last_message(stderr)
    if _UNAUTHORIZED.search(stderr):
        return RegistryError(f"registry refused access to {ref}: {detail}")
    if _NOT_FOUND.search(stderr):
        return ImageNotFoundError(f"image {ref} not found: {detail}")
    if _UNAVAILABLE.search(stderr):
        return RegistryUnavailableError(f"registry unavailable for {ref}: {detail}")
    return RegistryError(f"skopeo failed on {ref}: {detail}")


def _last_message(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "(no stderr)"
    last = lines[-1]
    match = re.search(r'msg="(.*)"\s*$', last)
    return match.group(1).replace('\\"', '"') if match else last


def with_digest(ref: str, digest: str) -> str:
    """``docker://host/repo:tag`` -> ``docker://host/repo@<digest>`` (only for docker refs).

    Raises:
        InputError: ``ref`` is not a ``docker://`` reference.
    """
    if not ref.startswith("docker://"):
        raise InputError(f"{ref!r} is not a docker:// reference; cannot address it by digest")
    name = ref.removeprefix("docker://")
    name = name.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name.rsplit(":", 1)[0]
    return f"docker://{name}@{digest}"


def _check_ref(ref: str) -> str:
    if not ref.startswith(_TRANSPORTS):
        raise InputError(
            f"image reference {ref!r} has no skopeo transport; expected one of {list(_TRANSPORTS)}"
        )
    return ref


def _go_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


class Skopeo:
    """skopeo with forgeflow's environment (insecure loopback registries) and error mapping.

    Args:
        retry_times: skopeo's own ``--retry-times`` for transient registry errors (0-10).
        command_timeout_s: Wall-clock limit of one skopeo command (``--command-timeout``).

    Raises:
        InputError: ``retry_times`` out of range or the authfile is missing.
    """

    def __init__(
        self,
        authfile: Path | None = None,
        retry_times: int = 3,
        command_timeout_s: float = 600.0,
    ) -> None:
        if not 0 <= retry_times <= 10:
            raise InputError(f"retry_times {retry_times} is outside 0-10")
        if authfile is not None and not Path(authfile).is_file():
            raise InputError(f"authfile {authfile} does not exist")
        if command_timeout_s <= 0:
            raise InputError(f"command_timeout_s must be positive, got {command_timeout_s}")
        self.authfile = Path(authfile) if authfile else None
        self.retry_times = retry_times
        self.command_timeout_s = command_timeout_s

    # --- running ----------------------------------------------------------------------------
    def _run(self, ref: str, *args: str) -> bytes:
        """Run ``skopeo <args>`` and return stdout bytes; map failures via :func:`classify_error`.

        The limit is skopeo's ``--command-timeout``; a skopeo outliving it by :data:`KILL_GRACE_S` is killed.
        ``subprocess.run`` (vfork), not the ``sh`` package (fork): measured on 2 cores, ``/bin/true`` costs
        0.6-0.7 ms against 20-27 ms from a flow-run-sized process; ``python -m benchmarks.registry`` measures both.

        Raises:
            ToolMissingError: skopeo is not on PATH.
            ImageNotFoundError, RegistryError, RegistryUnavailableError: see :func:`classify_error`.
        """
        try:
            done = subprocess.run(
                self.argv(*args), env=tool_env(), stdin=subprocess.DEVNULL, capture_output=True,
                timeout=self.command_timeout_s + KILL_GRACE_S, check=False,
            )
        except subprocess.TimeoutExpired:
            raise RegistryUnavailableError(
                f"registry unavailable for {ref}: skopeo ran past its {self.command_timeout_s:g} s "
                "command timeout and was killed"
            ) from None
        if done.returncode != 0:
            stderr = done.stderr.decode("utf-8", errors="replace")
            if self.authfile is not None:  # never let a credential reach an exception or a log
                stderr = scrub(stderr, secrets_of(self.authfile))
            raise classify_error(ref, stderr)
        return done.stdout

    def argv(self, *args: str) -> list[str]:
        """The full command line of ``skopeo <args>``: the binary's path and the command timeout.

        Raises:
            ToolMissingError: skopeo is not on PATH.
        """
        binary = shutil.which(SKOPEO_BINARY)
        if binary is None:
            raise ToolMissingError(f"{SKOPEO_BINARY} not found on PATH (apt install skopeo)")
        # in milliseconds: whole seconds would turn 0.5 into "0s", which skopeo takes as no limit
        return [binary, f"--command-timeout={max(1, round(self.command_timeout_s * 1000))}ms", *args]

    def _auth(self, *flags: str) -> list[str]:
        if self.authfile is None:
            return []
        return [f"{flag}={self.authfile}" for flag in flags]

    # --- operations -------------------------------------------------------------------------
    def copy(
        self,
        src: str,
        dst: str,
        *,
        all_images: bool = True,
        preserve_digests: bool = True,
        src_tls_verify: bool = False,
        dest_tls_verify: bool = False,
    ) -> str:
        """Copy an image (or a whole index with ``all_images``); returns the digest written at ``dst``.

        Raises:
            ImageNotFoundError: ``src`` does not exist.
            RegistryError: access denied, or skopeo failed otherwise (e.g. a digest would change).
            RegistryUnavailableError: a registry is unreachable, overloaded or timed out.
            ToolMissingError: skopeo is not installed.
        """
        _check_ref(src)
        _check_ref(dst)
        handle, name = tempfile.mkstemp(prefix="forgeflow-skopeo-", suffix=".digest")
        os.close(handle)
        digestfile = Path(name)
        try:
            args = ["copy", "--quiet", f"--retry-times={self.retry_times}"]
            args += [f"--digestfile={digestfile}"]
            args += [f"--src-tls-verify={str(src_tls_verify).lower()}"]
            args += [f"--dest-tls-verify={str(dest_tls_verify).lower()}"]
            args += self._auth("--src-authfile", "--dest-authfile")
            if all_images:
                args.append("--all")
            if preserve_digests:
                args.append("--preserve-digests")
            self._run(f"{src} -> {dst}", *args, src, dst)
            digest = digestfile.read_text().strip()
        finally:
            digestfile.unlink(missing_ok=True)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise RegistryError(f"skopeo copy {src} -> {dst} wrote no digest (got {digest!r})")
        return digest

    def raw_manifest(self, ref: str, tls_verify: bool = False) -> bytes:
        """The manifest (or index) bytes exactly as served (``inspect --raw``).

        Raises:
            ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError.
        """
        _check_ref(ref)
        args = ["inspect", "--raw", f"--retry-times={self.retry_times}"]
        if ref.startswith("docker://"):
            args.append(f"--tls-verify={str(tls_verify).lower()}")
        args += self._auth("--authfile")
        return self._run(ref, *args, ref)

    def inspect_digest(self, ref: str, tls_verify: bool = False) -> str:
        """``sha256:<64 hex>`` of the manifest/index bytes as the registry serves them.

        Raises:
            ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError.
        """
        return "sha256:" + sha256_bytes(self.raw_manifest(ref, tls_verify))

    def inspect_raw(self, ref: str, tls_verify: bool = False) -> dict[str, Any]:
        """The parsed raw manifest or index (``mediaType``, ``layers`` or ``manifests``, ...).

        Raises:
            ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError.
        """
        return self.inspect_manifest(ref, tls_verify)[1]

    def inspect_manifest(self, ref: str, tls_verify: bool = False) -> tuple[str, dict[str, Any]]:
        """``(digest, parsed manifest or index)`` from ONE ``inspect --raw`` (digest as :meth:`inspect_digest`).

        Raises:
            RegistryError: the manifest is not JSON.
            ImageNotFoundError, RegistryUnavailableError, ToolMissingError.
        """
        raw = self.raw_manifest(ref, tls_verify)
        try:
            manifest = json.loads(raw)
        except json.JSONDecodeError as err:
            raise RegistryError(f"manifest of {ref} is not JSON: {err}") from err
        return "sha256:" + sha256_bytes(raw), manifest

    def _single_manifest(self, ref: str, tls_verify: bool, arch: str | None) -> dict[str, Any]:
        manifest = self.inspect_raw(ref, tls_verify)
        if not _is_index(manifest):
            return manifest
        want = arch or _go_arch()
        for entry in manifest.get("manifests", []):
            entry_platform = entry.get("platform", {})
            if entry_platform.get("os", "linux") == "linux" and entry_platform.get(
                "architecture"
            ) == want:
                return self.inspect_raw(with_digest(ref, entry["digest"]), tls_verify)
        raise ImageNotFoundError(f"index {ref} has no linux/{want} manifest")

    def layers(self, ref: str, tls_verify: bool = False, arch: str | None = None) -> list[str]:
        """Layer digests of the single-arch manifest, base layer first.

        Raises:
            ImageNotFoundError: no such image, or no manifest for the platform.
            RegistryError: the manifest is a schema-1 manifest or unreadable.
            RegistryUnavailableError, ToolMissingError.
        """
        manifest = self._single_manifest(ref, tls_verify, arch)
        if "layers" not in manifest:
            raise RegistryError(f"manifest of {ref} has no 'layers' (schema 1?)")
        return [layer["digest"] for layer in manifest["layers"]]

    def size_bytes(self, ref: str, tls_verify: bool = False, manifest: dict[str, Any] | None = None) -> int:
        """Sum of the (compressed) layer sizes in bytes, as a copy would transfer them.

        Raises:
            ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError.
        """
        if manifest is None:
            manifest = self.inspect_raw(ref, tls_verify)
        if _is_index(manifest):
            return sum(
                self.size_bytes(with_digest(ref, entry["digest"]), tls_verify)
                for entry in manifest.get("manifests", [])
            )
        if "layers" not in manifest:
            raise RegistryError(f"manifest of {ref} has no 'layers' (schema 1?)")
        return sum(int(layer.get("size", 0)) for layer in manifest["layers"])

    def list_tags(self, repo_ref: str, tls_verify: bool = False) -> list[str]:
        """Tags of a repository, sorted.

        Raises:
            InputError: not a ``docker://`` reference.
            ImageNotFoundError: the repository does not exist.
            RegistryError, RegistryUnavailableError, ToolMissingError.
        """
        if not repo_ref.startswith("docker://"):
            raise InputError(f"list_tags needs a docker:// repository reference, got {repo_ref!r}")
        args = ["list-tags", f"--retry-times={self.retry_times}"]
        args += [f"--tls-verify={str(tls_verify).lower()}"]
        args += self._auth("--authfile")
        out = self._run(repo_ref, *args, repo_ref)
        try:
            return sorted(json.loads(out).get("Tags") or [])
        except json.JSONDecodeError as err:
            raise RegistryError(f"list-tags of {repo_ref} is not JSON: {err}") from err


def _is_index(manifest: dict[str, Any]) -> bool:
    return manifest.get("mediaType") in INDEX_MEDIA_TYPES or (
        "manifests" in manifest and "layers" not in manifest
    )


def digest_or_none(skopeo: Skopeo, ref: str, *, any_error: bool = False) -> str | None:
    """The digest ``ref`` serves (``skopeo inspect``), or None when it is missing.

    Args:
        any_error: also None when the registry cannot say now (any forgeflow error, e.g. a 5xx
            after retries); by default only a missing image gives None.

    Raises:
        RegistryError, RegistryUnavailableError: the registry failed (unless ``any_error``).
    """
    try:
        return skopeo.inspect_digest(ref)
    except ImageNotFoundError:
        return None
    except ForgeflowError:
        if any_error:
            return None
        raise
