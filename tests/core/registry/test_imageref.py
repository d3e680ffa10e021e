"""forgeflow.registry.imageref: registry addresses, namespaces and image names (OCI / docker reference grammar)."""

from __future__ import annotations

import pytest

from forgeflow.common.errors import InputError
from forgeflow.registry.imageref import (
    check_address,
    check_namespace,
    has_host,
    parse_name,
    relative_name,
)

DIGEST = "sha256:" + "0123456789abcdef" * 4
REGISTRIES = [("127.0.0.1:5702", ""), ("127.0.0.1:5701", "")]


@pytest.mark.parametrize("address", ["127.0.0.1:5702", "localhost", "registry.example.com:443", "[::1]:5000",
                                     "myregistry-1.azurecr.io"])
def test_good_addresses(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize("address,why", [
    ("http://127.0.0.1:5702", "has a scheme"), ("127.0.0.1:99999", "port '99999'"), ("127.0.0.1:0", "port '0'"),
    ("127.0.0.1:5702/x", "has a path"), ("", "is empty"), ("a b", "is not host"), ("127.0.0.1:", "port ''")])
def test_bad_addresses_are_named(address: str, why: str) -> None:
    with pytest.raises(InputError, match=rf"target\.address .*{why}" if address else "target.address is empty"):
        check_address(address, "target.address")


def test_namespaces() -> None:
    assert check_namespace("") == "" and check_namespace("/mirror/team/") == "mirror/team"
    for bad in ["../x", "Mirror", "a//b", "a-", "x y"]:
        with pytest.raises(InputError, match="target.namespace .* is not a repository path"):
            check_namespace(bad, "target.namespace")


def test_names_parse_by_the_docker_host_rule() -> None:
    assert parse_name("env/six:1.17.0").relative == "env/six:1.17.0"
    full = parse_name(f"127.0.0.1:5702/task-02:boltons.abc__x@{DIGEST}")
    assert (full.host, full.repository, full.tag, full.digest) == ("127.0.0.1:5702", "task-02", "boltons.abc__x", DIGEST)
    assert parse_name("localhost/forgeflow/task:1").host == "localhost"
    assert parse_name(f"env/six@{DIGEST}").tag is None
    assert not has_host("env/six:1") and has_host("docker.io/library/x:1") and not has_host("six:1")


@pytest.mark.parametrize("name,why", [
    ("env/six:1.17.0@sha256:abc", "digest 'sha256:abc'"), ("env/six", "has no tag"), ("Env/six:1", "repository 'Env/six'"),
    ("../x:1", "registry host '..'"), ("env/six:-bad", "tag '-bad'"), ("env//six:1", "repository"),
    ("127.0.0.1:99999/env/six:1", "port '99999'"), ("", "is empty")])
def test_bad_names_are_refused_with_the_expected_form(name: str, why: str) -> None:
    with pytest.raises(InputError, match=why):
        parse_name(name, "images entry")


def test_relative_names_accept_the_registries_in_question_only() -> None:
    assert relative_name("task-02:x", REGISTRIES).relative == "task-02:x"
    assert relative_name("127.0.0.1:5702/task-02:x", REGISTRIES).relative == "task-02:x"
    assert relative_name("127.0.0.1:5701/env/six:1", REGISTRIES).relative == "env/six:1"
    assert relative_name("r.example.com/mirror/env/six:1", [("r.example.com", "mirror")]).relative == "env/six:1"
    with pytest.raises(InputError, match=r"column 'image' value 'localhost/forgeflow/task:1' names registry host "
                                         r"'localhost', which is not '127.0.0.1:5702' or '127.0.0.1:5701': expected 'repo:tag'"):
        relative_name("localhost/forgeflow/task:1", REGISTRIES, "column 'image' value")
    with pytest.raises(InputError, match="outside the namespace 'mirror'"):
        relative_name("r.example.com/other/six:1", [("r.example.com", "mirror")])
