"""Loopback fakes of HTTP APIs that cannot be reached from the test machines."""
