"""How :class:`forgeflow.registry.skopeo.Skopeo` runs the skopeo binary: command line, time limit, missing tool.

The copies, inspections and error mapping against real registries are in
tests/integration/test_registry.py. Here a stand-in ``skopeo`` script on PATH plays a skopeo that
hangs past its own ``--command-timeout`` (the real one stops itself at that limit, so no real
registry can show what happens when it does not).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from forgeflow.common.errors import RegistryUnavailableError, ToolMissingError
from forgeflow.registry import skopeo as skopeo_module
from forgeflow.registry.skopeo import Skopeo


def _stand_in(tmp_path: Path, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "skopeo"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return bin_dir


def test_a_fractional_command_timeout_reaches_skopeo_in_milliseconds(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(_stand_in(tmp_path, 'printf "%s\\n" "$@"')))
    argv = Skopeo(command_timeout_s=0.5).argv("inspect", "--raw", "docker://127.0.0.1:1/x:1")
    assert argv[0] == str(tmp_path / "bin" / "skopeo")
    assert argv[1:] == ["--command-timeout=500ms", "inspect", "--raw", "docker://127.0.0.1:1/x:1"]
    # and the stand-in, run by _run, sees exactly those arguments (not "0s", which is no limit)
    printed = Skopeo(command_timeout_s=0.5)._run("docker://127.0.0.1:1/x:1", "inspect", "--raw", "x")
    assert printed.decode().splitlines() == ["--command-timeout=500ms", "inspect", "--raw", "x"]


def test_a_skopeo_hanging_past_its_timeout_is_killed_as_a_transient_registry_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(_stand_in(tmp_path, "exec /bin/sleep 60")))
    monkeypatch.setattr(skopeo_module, "KILL_GRACE_S", 0.5)
    started = time.monotonic()
    with pytest.raises(RegistryUnavailableError, match=r"docker://127.0.0.1:1/x:1.*0.5 s command timeout"):
        Skopeo(command_timeout_s=0.5).inspect_digest("docker://127.0.0.1:1/x:1")
    assert time.monotonic() - started < 30  # killed, not waited out


def test_a_missing_skopeo_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="skopeo not found on PATH"):
        Skopeo().inspect_digest("docker://127.0.0.1:1/x:1")
