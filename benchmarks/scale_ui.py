"""A curate run of 30,000 candidates as a user sees it in the Prefect UI: ``python -m benchmarks.scale_ui``.

It starts the Prefect server and UI with the product's own command (``forgeflow ui --port P``, a free port, a
fresh ``PREFECT_HOME``), runs the ``curate`` flow against it on ``--candidates`` synthetic candidates (the stand-in
sandbox of :mod:`benchmarks.standin_sandbox`, chosen by a ``forgeflow-sandbox`` block as a user would; a fresh
SQLite store), then reads the run as the UI does: the run graph's API (``GET /api/flow_runs/<id>/graph-v2``: the
call that refused a curate run of ~4,750 candidates with "has more than 10000 nodes" when every validation was a
task run) and, in headless Chromium driven over the DevTools protocol
(:mod:`benchmarks.browser`), the run's page and one batch's task-run page. Prints one JSON line, last::

    {"candidates": 30000, "batches": ..., "graph_nodes": ..., "graph_status": 200, "run_page": true,
     "batch_page": true, "curate_wall_s": ..., "s_per_candidate": ...}

Screenshots and DOM of both pages are kept under the printed folder. Stop: the server by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.options import int_option

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_ui(home: Path, port: int) -> subprocess.Popen:
    """``forgeflow ui --port port`` with ``home`` as FORGEFLOW_HOME / PREFECT_HOME; waits for ``/api/health``.

    Raises:
        RuntimeError: the server did not answer within 240 s (its log's tail in the message).
    """
    env = {**os.environ, "FORGEFLOW_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = home / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "ui", "--port", str(port)], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    _stop(proc)
    raise RuntimeError(f"forgeflow ui did not start on port {port}:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s process group (TERM, then KILL after 20 s)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_curate(count: int, tmp: Path) -> dict[str, Any]:
    """The ``curate`` flow on ``count`` stand-in candidates against the server in PREFECT_API_URL."""
    from benchmarks.scale_curate import BLOCK, REPO_SIZE, _ensure_image, write_candidates  # noqa: PLC0415
    from benchmarks.standin_sandbox import KIND, install  # noqa: PLC0415
    from blocks.core import SandboxBackend  # noqa: PLC0415
    from flows.curate import CurateParams, curate  # noqa: PLC0415
    from forgeflow.common.settings import apply_container_env  # noqa: PLC0415
    from forgeflow.curation.freeze import SplitQuotas  # noqa: PLC0415
    from forgeflow.curation.task_rows import TaskSource  # noqa: PLC0415

    apply_container_env()
    _ensure_image()
    install()
    SandboxBackend(kind=KIND).save(BLOCK, overwrite=True)
    candidates = write_candidates(tmp / "candidates.jsonl", count)
    os.environ["FORGEFLOW_STORE_URL"] = f"sqlite:///{tmp / 'store.db'}"
    quotas = SplitQuotas(train=count, validation=0, test=0, max_per_repo=REPO_SIZE, min_repos=count // REPO_SIZE)
    start = time.perf_counter()
    state = curate(CurateParams(source=TaskSource(candidates_path=candidates), quotas=quotas, sandbox=BLOCK),
                   return_state=True)
    wall_s = time.perf_counter() - start
    out = state.result()
    return {"flow_run_id": str(state.state_details.flow_run_id), "batches": len(out.batches),
            "validated": len(out.validated), "status": out.status, "curate_wall_s": round(wall_s, 1)}


def read_ui(port: int, run_id: str, out_dir: Path) -> dict[str, Any]:
    """The run graph's API and the run's and a batch's pages in Chromium (see the module docstring)."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: PLC0415

    from benchmarks.browser import Browser  # noqa: PLC0415

    graph = httpx.get(f"http://127.0.0.1:{port}/api/flow_runs/{run_id}/graph-v2", timeout=120)
    nodes = len(graph.json().get("nodes", [])) if graph.status_code == 200 else None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        batches = [t for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
                                                    limit=200) if t.name.startswith("validate-batch-")]
    browser = Browser(out_dir / "chromium-profile")
    try:
        page = browser.open(f"http://127.0.0.1:{port}/v2/runs/flow-run/{run_id}", [run.name], out_dir / "run")
        batch = browser.open(f"http://127.0.0.1:{port}/v2/runs/task-run/{batches[0].id}", [batches[0].name],
                             out_dir / "batch")
    finally:
        browser.close()
    return {"graph_status": graph.status_code, "graph_nodes": nodes,
            "graph_error": None if graph.status_code == 200 else graph.text[:300],
            "run_page": run.name in page and "more than" not in page, "batch_page": batches[0].name in batch}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run the measurement, print the JSON line last and return it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_ui", description=__doc__)
    parser.add_argument("--candidates", type=int_option(20, 100_000), default=30_000,
                        help="synthetic candidates (20-100000, default 30000)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-scale-ui-"))
    (tmp / "prefect").mkdir()
    port = _free_port()
    proc = _start_ui(tmp, port)
    os.environ.update({"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_HOME": str(tmp / "prefect"),
                       "FORGEFLOW_HOME": str(tmp), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    try:
        figures = run_curate(args.candidates, tmp)
        figures |= read_ui(port, figures["flow_run_id"], tmp)
    finally:
        _stop(proc)
    figures |= {"candidates": args.candidates,
                "s_per_candidate": round(figures["curate_wall_s"] / args.candidates, 4), "kept": str(tmp)}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
