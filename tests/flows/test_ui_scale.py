"""A curate run as the Prefect UI shows it, through the scale benchmark's own path
(``python -m benchmarks.scale_ui``: ``forgeflow ui`` on a free port, the curate flow on stand-in candidates,
the run graph's API and the run's and a batch's pages in headless Chromium). At 400 candidates here (the
benchmark runs 30,000 for the issue's figure): what must hold at any size is that the run graph grows by one
node per batch, not per validation, so the UI draws it (it refused ~4,750 candidates when every validation was
a task run), and that the run page and a batch's page render."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forgeflow.common.settings import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_curate_run_graph_grows_by_batch_and_its_pages_render() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.scale_ui", "--candidates", "400"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert (figures["status"], figures["validated"]) == ("freeze-ready", 400)
    assert figures["graph_status"] == 200, figures["graph_error"]
    # one validate-batch task run per batch plus the run's few setup tasks: never one node per validation
    assert figures["batches"] <= figures["graph_nodes"] <= figures["batches"] + 10, figures
    assert figures["run_page"] and figures["batch_page"], figures
