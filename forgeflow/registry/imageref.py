"""Image reference grammar: registry addresses, repository namespaces and image names (pure, no I/O).

The grammar is the OCI distribution spec's (repository path components and tags) and the docker
reference grammar's rule for telling a registry host from a path component
(https://github.com/distribution/reference/blob/main/reference.go, ``splitDockerDomain``): the
first ``/``-separated component of a name is a registry host when it contains ``.`` or ``:`` or is
``localhost``. So ``env/six:1.17.0`` is relative to a registry, while ``127.0.0.1:5702/env/six:1.17.0``
and ``localhost/forgeflow/task:x`` name a registry host."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError

PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*"
"""One repository path component (OCI distribution spec)."""

REPOSITORY_PATTERN = re.compile(rf"{PATH_COMPONENT}(?:/{PATH_COMPONENT})*")
"""A repository path, ``/``-separated components (match with ``fullmatch``)."""

TAG_PATTERN = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
"""A tag (OCI distribution spec: ``[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}``)."""

DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")
"""A manifest digest as forgeflow accepts it in a name: ``sha256:<64 lowercase hex>``."""

NAME_MAX_CHARS = 255
"""Longest repository name (host and path) the docker reference grammar allows."""

_HOSTNAME = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_ADDRESS_HINT = "host[:port] without a scheme or path, e.g. 127.0.0.1:5702 or registry.example.com"


def check_address(address: str, what: str = "address") -> str:
    """Check a registry address (``host[:port]``, port 1-65535, no scheme, no path) and return it.

    Raises:
        InputError: empty, a scheme, a path, a bad host or port (``what`` and the value named).
    """
    if not isinstance(address, str) or not address:
        raise InputError(f"{what} is empty: give {_ADDRESS_HINT}")
    if "://" in address:
        raise InputError(f"{what} {address!r} has a scheme: give {_ADDRESS_HINT}")
    if "/" in address:
        raise InputError(f"{what} {address!r} has a path: give {_ADDRESS_HINT} (a repository prefix goes in namespace)")
    host, port = address, None
    if address.startswith("["):
        end = address.find("]")
        host, rest = address[: end + 1], address[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise InputError(f"{what} {address!r} is not {_ADDRESS_HINT}")
            port = rest[1:]
        host_ok = bool(_IPV6.fullmatch(host))
    else:
        if ":" in address:
            host, port = address.rsplit(":", 1)
        host_ok = bool(_HOSTNAME.fullmatch(host))
    if not host_ok:
        raise InputError(f"{what} {address!r} is not {_ADDRESS_HINT}")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(f"{what} {address!r}: port {port!r} is not a number in 1-65535")
    return address


def check_namespace(namespace: str, what: str = "namespace") -> str:
    """Check a repository namespace (a path prefix inside a registry; ``""``: none); returned without ``/`` ends.

    Raises:
        InputError: not a repository path (``../x``, upper case, empty components), naming ``what``.
    """
    if not isinstance(namespace, str):
        raise InputError(f"{what} must be a string, got {namespace!r}")
    stripped = namespace.strip("/")
    if stripped and not REPOSITORY_PATTERN.fullmatch(stripped):
        raise InputError(
            f"{what} {namespace!r} is not a repository path: lower-case components "
            "[a-z0-9] separated by '.', '_', '__' or '-', joined by '/' (e.g. 'mirror/team')"
        )
    return stripped


class ImageName(BaseModel):
    """A parsed image name."""

    model_config = ConfigDict(frozen=True)

    host: str | None = Field(
        description="The registry host the name starts with (127.0.0.1:5702), None for a name relative to a "
                    "registry.")
    repository: str = Field(description="Repository path (env/six).")
    tag: str | None = Field(description="The tag (1.17.0), or None.")
    digest: str | None = Field(description="sha256:<64 hex> pinning the manifest, or None.")

    @property
    def relative(self) -> str:
        """The name without its host: ``repo:tag``, ``repo:tag@sha256:...`` or ``repo@sha256:...``."""
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


_EXPECTED = "'repo:tag' relative to the registry (e.g. 'env/six:1.17.0'; optionally '@sha256:<64 hex>')"


def has_host(name: str) -> bool:
    """True when ``name``'s first ``/`` component names a registry host (contains ``.`` or ``:``,
    or is ``localhost``), as the docker reference grammar decides."""
    first, sep, _ = name.partition("/")
    return bool(sep) and ("." in first or ":" in first or first == "localhost")


def parse_name(name: str, what: str = "image") -> ImageName:
    """Parse and validate ``[host/]repository[:tag][@sha256:<hex>]`` (at least one of tag and digest).

    Raises:
        InputError: neither tag nor digest, or a malformed digest, tag, repository or host (value named).
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"{what} is empty: expected {_EXPECTED}")
    rest, digest = name, None
    if "@" in name:
        rest, digest = name.split("@", 1)
        if not DIGEST_PATTERN.fullmatch(digest):
            raise InputError(f"{what} {name!r}: digest {digest!r} is not 'sha256:<64 lowercase hex>'")
    host = None
    if has_host(rest):
        host, rest = rest.split("/", 1)
        check_address(host, f"{what} {name!r}: registry host")
    repository, tag = rest, None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        repository, tag = rest.rsplit(":", 1)
        if not TAG_PATTERN.fullmatch(tag):
            raise InputError(f"{what} {name!r}: tag {tag!r} is not [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}")
    if not REPOSITORY_PATTERN.fullmatch(repository):
        raise InputError(
            f"{what} {name!r}: repository {repository!r} is not a repository path (lower-case "
            f"components [a-z0-9] separated by '.', '_', '__' or '-', joined by '/'); expected {_EXPECTED}"
        )
    if len((host + "/" if host else "") + repository) > NAME_MAX_CHARS:
        raise InputError(f"{what} {name!r}: the repository name is longer than {NAME_MAX_CHARS} characters")
    if tag is None and digest is None:
        raise InputError(f"{what} {name!r} has no tag: expected {_EXPECTED}")
    return ImageName(host=host, repository=repository, tag=tag, digest=digest)


def relative_name(name: str, registries: Sequence[tuple[str, str]], what: str = "image") -> ImageName:
    """``name`` (``[host[:port]/]repo:tag[@sha256:<hex>]``) with ``host`` None, relative to the namespace.

    Raises:
        InputError: a malformed name, a host none of ``registries``, or a path outside the namespace.
    """
    parsed = parse_name(name, what)
    if parsed.host is None:
        return parsed
    for address, namespace in registries:
        if parsed.host.lower() != address.lower():
            continue
        namespace = namespace.strip("/")
        if not namespace:
            return parsed.model_copy(update={"host": None})
        if parsed.repository.startswith(namespace + "/"):
            return parsed.model_copy(update={"host": None, "repository": parsed.repository[len(namespace) + 1:]})
        raise InputError(
            f"{what} {name!r} lies outside the namespace {namespace!r} of registry {address}: "
            f"expected {_EXPECTED} or '{address}/{namespace}/repo:tag'"
        )
    known = " or ".join(repr(address) for address, _ in registries)
    raise InputError(
        f"{what} {name!r} names registry host {parsed.host!r}, which is not {known}: "
        f"expected {_EXPECTED}, or a full reference in {known}"
    )
