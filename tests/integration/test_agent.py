"""Agent trials: real mini-swe-agent, real llama-cpp-python server with the tiny GGUF, real podman.

The task image is a two-function project built FROM the base image (``add`` is broken, ``mul`` is
fine); the verifier grades with SWE-bench's rule on ``pytest -rA`` output.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, ModelRequestError
from forgeflow.common.settings import tool_env
from forgeflow.evaluation.agent import (
    AgentConfig,
    problem_statement_for,
    run_agent_trial,
)
from forgeflow.registry.images import BASE_IMAGE_TAG, ensure_base_image, image_exists
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.serving.server import ModelServer
from tests.helpers import free_port as _free_port
from tests.helpers import tiny_ggufs

TASK_IMAGE = "localhost/forgeflow/test-agent-calc:1"
TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider tests"
F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_mul"]
BUG_PATCH = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,5 +1,5 @@
 def add(a, b):
-    return a + b
+    return a - b
 
 
 def mul(a, b):
"""
FIX_PATCH = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,5 +1,5 @@
 def add(a, b):
-    return a - b
+    return a + b
 
 
 def mul(a, b):
"""
CONTAINERFILE = f"""\
FROM {BASE_IMAGE_TAG}
COPY testbed /testbed
WORKDIR /testbed
RUN git init -q && git add -A \\
 && git -c user.name=forgeflow -c user.email=forgeflow@localhost commit -qm task
"""


@pytest.fixture(scope="module")
def task_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bugged calc project at /testbed (a git repo with one commit)."""
    if image_exists(TASK_IMAGE):
        return TASK_IMAGE
    ensure_base_image()
    ctx = tmp_path_factory.mktemp("calc-image")
    (ctx / "testbed" / "tests").mkdir(parents=True)
    (ctx / "testbed" / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (ctx / "testbed" / "tests" / "test_calc.py").write_text(
        "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n"
    )
    (ctx / "Containerfile").write_text(CONTAINERFILE)
    subprocess.run(
        ["podman", "build", "-q", "-t", TASK_IMAGE, "-f", str(ctx / "Containerfile"), str(ctx)],
        env=tool_env(), check=True, capture_output=True, text=True, timeout=600,
    )
    return TASK_IMAGE


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A llama-cpp-python server on the tiny Q8_0 GGUF (stopped by PID at teardown)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ModelServer(tiny_ggufs()[0], _free_port(), "tiny", n_ctx=4096, log_path=log) as server:
        yield server.base_url


def calc_task(image_ref: str, test_command: str = TEST_COMMAND, instance_id: str = "calc-add-1") -> TaskTests:
    """The calc task (its bug's problem statement, FAIL_TO_PASS and PASS_TO_PASS) as an agent trial's task."""
    return TaskTests(instance_id=instance_id, image_ref=image_ref, test_command=test_command,
                     problem_statement=problem_statement_for(BUG_PATCH, F2P), FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)


def _trajectory(out_dir: Path, trial_id: str) -> dict:
    return json.loads((out_dir / f"{trial_id}.traj.json").read_text())


# --- problem statements (no container needed) --------------------------------------------------
def test_problem_statement_names_failing_tests_without_patch_content() -> None:
    text = problem_statement_for(BUG_PATCH, F2P)
    assert "tests/test_calc.py::test_add" in text
    assert "return a - b" not in text and "calc.py\n" not in text and "diff" not in text


def test_problem_statement_rejects_bad_input() -> None:
    with pytest.raises(InputError, match="failing_tests"):
        problem_statement_for(BUG_PATCH, [])
    with pytest.raises(InputError, match="candidate_patch"):
        problem_statement_for("not a diff", F2P)


# --- verifier ----------------------------------------------------------------------------------
@pytest.mark.integration
def test_verifier_grades_fix_as_1_bug_as_0_and_bad_patch_as_0_with_note(task_image: str) -> None:
    def verdict(patch: str, name: str):
        tests = TaskTests(instance_id="calc-task", image_ref=task_image, test_command=TEST_COMMAND,
                          FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)
        return verify_submission(tests, patch, timeout_s=120, spec=SandboxSpec(memory_mb=512), name=name)

    fixed = verdict(FIX_PATCH, "ff-test-agent-fix")
    assert fixed.reward == 1.0 and fixed.result.tests["tests/test_calc.py::test_add"] == "PASSED"
    unchanged = verdict("", "ff-test-agent-nop")
    assert unchanged.reward == 0.0 and unchanged.result.tests["tests/test_calc.py::test_add"] == "FAILED"
    assert "empty submission" in unchanged.notes[0]
    bad = verdict(BUG_PATCH, "ff-test-agent-bad")
    assert bad.reward == 0.0 and bad.result is None and "did not apply" in bad.notes[0]


# --- agent trials --------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.slow
def test_agent_trial_with_tiny_model_finishes_with_a_reward(task_image: str, endpoint: str, tmp_path: Path) -> None:
    config = AgentConfig(step_limit=3, agent_timeout_s=300, max_tokens=64, memory_mb=512)
    record = run_agent_trial(
        calc_task(task_image), endpoint, "tiny", config, tmp_path,
    )
    assert record.kind == "agent"
    assert record.exception_type is None, record.exception_message
    assert record.reward in (0.0, 1.0)
    assert record.verifier_s is not None and set(record.tests) >= set(F2P + P2P)
    traj = _trajectory(tmp_path, record.trial_id)
    assert traj["info"]["exit_status"] in {"RepeatedFormatError", "LimitsExceeded", "Submitted", "ContextWindowExceeded"}
    assert traj["info"]["forgeflow"]["n_steps"] >= 1
    assert traj["info"]["forgeflow"]["n_input_tokens"] > 0
    assert traj["messages"][0]["role"] == "system"
    # no container of this trial is left behind (its names carry the trial id; other tests' containers may run)
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env=tool_env(),
                          capture_output=True, text=True, timeout=60).stdout.split()
    assert not [name for name in left if record.trial_id[:10] in name], left


@pytest.mark.integration
def test_agent_trial_against_dead_endpoint_records_model_endpoint_error(task_image: str, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    record = run_agent_trial(
        calc_task(task_image), dead, "tiny", AgentConfig(agent_timeout_s=120, memory_mb=512), tmp_path,
    )
    assert record.exception_type == "ModelEndpointError"
    assert record.reward is None and record.verifier_s is None
    assert "127.0.0.1" in record.exception_message
    assert _trajectory(tmp_path, record.trial_id)["info"]["exit_status"] == "ModelEndpointError"


@contextmanager
def _stub_endpoint(status: int, body: bytes) -> Iterator[str]:
    """An HTTP endpoint whose /v1/chat/completions always answers ``status`` with JSON ``body``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def failing_endpoint() -> Iterator[str]:
    """An endpoint answering 503 (an overloaded or broken server)."""
    with _stub_endpoint(503, b'{"error": {"message": "model crashed", "type": "server_error"}}') as url:
        yield url


# llama-cpp-python's context overflow answer (llama_cpp/server/errors.py, context_length_exceeded)
CONTEXT_OVERFLOW_BODY = (
    b'{"error": {"message": "This model\'s maximum context length is 512 tokens. However, you requested '
    b'1500 tokens (1436 in the messages, 64 in the completion).", "type": "invalid_request_error", '
    b'"param": "messages", "code": "context_length_exceeded"}}'
)


@pytest.mark.integration
def test_context_overflow_is_the_models_outcome_and_the_verifier_runs(task_image: str, tmp_path: Path) -> None:
    with _stub_endpoint(400, CONTEXT_OVERFLOW_BODY) as url:
        record = run_agent_trial(
            calc_task(task_image), url, "tiny", AgentConfig(agent_timeout_s=120, memory_mb=512), tmp_path,
        )
    assert record.exception_type is None, record.exception_message
    assert record.reward == 0.0 and record.verifier_s is not None
    assert _trajectory(tmp_path, record.trial_id)["info"]["exit_status"] == "ContextWindowExceeded"


@pytest.mark.integration
def test_other_4xx_is_a_configuration_error_not_an_outcome(task_image: str, tmp_path: Path) -> None:
    body = b'{"error": {"message": "unknown parameter", "type": "invalid_request_error"}}'
    with _stub_endpoint(400, body) as url, pytest.raises(ModelRequestError, match="400"):
        run_agent_trial(
            calc_task(task_image), url, "tiny", AgentConfig(agent_timeout_s=120, memory_mb=512), tmp_path,
        )


@pytest.mark.integration
def test_agent_trial_against_5xx_endpoint_records_model_endpoint_error(
    task_image: str, failing_endpoint: str, tmp_path: Path
) -> None:
    record = run_agent_trial(
        calc_task(task_image), failing_endpoint, "tiny", AgentConfig(agent_timeout_s=120, memory_mb=512), tmp_path,
    )
    assert record.exception_type == "ModelEndpointError" and record.reward is None
    assert "503" in record.exception_message or "ServiceUnavailable" in record.exception_message


def test_run_agent_trial_rejects_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="base_url"):
        run_agent_trial(TaskTests(instance_id="i", image_ref="img", problem_statement="ps", test_command=TEST_COMMAND,
                                  FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P), "localhost:1", "tiny", AgentConfig(), tmp_path)
    with pytest.raises(InputError, match="nothing to grade"):
        run_agent_trial(TaskTests(instance_id="i", image_ref="img", problem_statement="ps", test_command=TEST_COMMAND),
                        "http://x/v1", "tiny", AgentConfig(), tmp_path)
    with pytest.raises(InputError, match="no problem statement"):
        run_agent_trial(TaskTests(instance_id="i", image_ref="img", test_command=TEST_COMMAND, FAIL_TO_PASS=F2P),
                        "http://x/v1", "tiny", AgentConfig(), tmp_path)


@pytest.mark.integration
@pytest.mark.slow
def test_agent_over_budget_records_agent_timeout_and_still_runs_the_verifier(
    task_image: str, endpoint: str, tmp_path: Path
) -> None:
    config = AgentConfig(step_limit=50, agent_timeout_s=1, max_tokens=256, memory_mb=512)
    record = run_agent_trial(
        calc_task(task_image), endpoint, "tiny", config, tmp_path,
    )
    assert record.exception_type == "AgentTimeoutError"
    assert record.verifier_s is not None, "the verifier runs after an agent timeout"
    assert record.tests["tests/test_calc.py::test_add"] == "FAILED"
    # Harbor's convention: the verifier's reward is kept beside the exception
    assert record.reward == 0.0
