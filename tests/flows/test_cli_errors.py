"""The installed ``forgeflow`` entry point turns known errors into one line, never a traceback:
bad input exits 2, an unreachable store database exits 1 (run as a real process)."""

from __future__ import annotations

import os
import subprocess
import sys

from forgeflow.settings import REPO_ROOT
from tests.helpers import free_port


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_a_malformed_store_url_is_one_line_and_exit_2() -> None:
    done = _run("trials", FORGEFLOW_STORE_URL="notaurl")
    assert done.returncode == 2
    assert "store URL 'notaurl' is not a valid SQLAlchemy URL" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_an_unreachable_store_database_is_one_line_and_exit_1() -> None:
    url = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/x"  # nothing listens there
    done = _run("status", FORGEFLOW_STORE_URL=url)
    assert done.returncode == 1
    assert "error: OperationalError" in done.stderr and "Connection refused" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_a_folder_given_as_an_id_list_is_one_line_and_exit_2(tmp_path) -> None:
    done = _run("derived", "build", "x", "--define", "x = accepted - s", "--id-list", f"s={tmp_path}@v1",
                FORGEFLOW_HOME=str(tmp_path / "home"))
    assert done.returncode == 2
    assert "IsADirectoryError" in done.stderr and str(tmp_path) in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
