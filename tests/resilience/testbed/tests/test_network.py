"""Runs INSIDE a sandbox: a task whose tests need the network. Every test must fail there."""

import os
import socket

import pytest

PORT = int(os.environ["FF_HOST_PORT"])
ADDRESSES = os.environ["FF_HOST_ADDRS"].split(",")


@pytest.mark.parametrize("address", ADDRESSES)
def test_reach_host_listener(address):
    socket.create_connection((address, PORT), timeout=3).close()


def test_resolve_a_public_name():
    socket.getaddrinfo("pypi.org", 443)


def test_only_loopback_interface():
    assert [name for _, name in socket.if_nameindex()] != ["lo"]
