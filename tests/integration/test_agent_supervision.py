"""Live supervision of agent trials: dead loops and hangs stop the run, the verifier still runs.

Real mini-swe-agent, real podman containers of the calc task image, real verifier. The model is a
scripted OpenAI-compatible loopback server (stdlib ``http.server`` on 127.0.0.1, port 0) that always
answers the same action (period 1), alternates two actions whose JSON arguments differ only in
whitespace, key order and escaping (period 2), or stops answering (hang). A scripted server is used
because a real model cannot be made to loop or to hang on demand; everything else is the real stack.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_agent import BUG_PATCH, F2P, P2P, TASK_IMAGE, TEST_COMMAND, calc_task, task_image  # noqa: F401 - fixture

from forgeflow.evaluation.agent import (
    AgentConfig,
    run_agent_trial,
)
from forgeflow.evaluation.supervision import call_signature

pytestmark = pytest.mark.integration
task_image_ref = TASK_IMAGE  # built by the ``task_image`` fixture each test requests

Answer = Callable[[int], dict[str, Any] | None]
"""Request index (0-based) -> the OpenAI chat completion to send (an optional ``status`` key sets
the HTTP status, default 200), or None to never answer."""


def text_answer(command: str) -> dict[str, Any]:
    content = f"THOUGHT: let me look.\n\n```mswea_bash_command\n{command}\n```"
    return {"model": "scripted", "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10}}


def tool_answer(index: int, arguments: str) -> dict[str, Any]:
    call = {"id": f"call_{index}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"model": "scripted", "choices": [{"index": 0, "finish_reason": "tool_calls",
                                              "message": {"role": "assistant", "content": "", "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10}}


@contextmanager
def scripted_endpoint(answer: Answer, api_key: str | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Serve ``answer`` on /v1/chat/completions; yields (base_url, received request bodies). With ``api_key``,
    as an OpenAI-compatible server started with a key: a request (``GET /v1/models`` too) without
    ``Authorization: Bearer <api_key>`` gets 401 and is not recorded."""
    bodies: list[dict[str, Any]] = []
    release = threading.Event()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _refused(self) -> bool:
            if api_key is None or self.headers.get("Authorization") == f"Bearer {api_key}":
                return False
            data = json.dumps({"error": {"message": "invalid api key", "type": "invalid_request_error"}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return True

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self._refused():
                return
            data = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self._refused():
                return
            with lock:
                bodies.append(body)
                index = len(bodies) - 1
            payload = answer(index)
            if payload is None:  # a hung model server: accept, never answer
                release.wait(120)
                return
            status = payload.pop("status", 200) if isinstance(payload, dict) else 200
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", bodies
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def _trial(url: str, tmp_path: Path, **config: Any):
    cfg = AgentConfig(**{"step_limit": 30, "agent_timeout_s": 120, "memory_mb": 512, **config})
    return run_agent_trial(calc_task(task_image_ref), url, "scripted", cfg, tmp_path)


def _messages(path: str) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["messages"]


def test_period_1_loop_is_stopped_at_the_third_repeat_and_recorded(task_image: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from forgeflow.ledger.store import Store
    from tasks.evaluation import record_agent_trial

    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    with scripted_endpoint(lambda i: text_answer("cat calc.py")) as (url, bodies):
        record = _trial(url, tmp_path)
    record_agent_trial(None, record, "canary-loop", None, None)  # what tasks.evaluation.agent_trial does after it
    assert record.exception_type == "AgentLoopError", record.exception_message
    assert len(bodies) == 3, "blocked at the 3rd identical call, not later"
    assert record.reward == 0.0 and record.verifier_s is not None, "the verifier still runs (flagged)"
    sup = record.supervision
    assert sup.kind == "dead_loop" and sup.evidence["period"] == 1 and sup.evidence["repeats"] == 3
    assert sup.evidence["signatures"] == [call_signature("bash", {"command": "cat calc.py"})]
    messages = _messages(sup.trajectory_path)
    assert messages[-1]["role"] == "exit" and messages[-1]["extra"]["exit_status"] == "AgentLoopError"
    # only the first two `cat` ran: the looping third answer is in the trajectory, its command is not
    assert sum(1 for m in messages if m["role"] == "user" and "<returncode>" in str(m["content"])) == 2
    store = Store()
    (event,) = store.supervision_events(record.trial_id)
    assert (event.kind, event.job_id, event.trajectory_path) == ("dead_loop", "canary-loop", sup.trajectory_path)
    assert event.evidence["exception_type"] == "AgentLoopError" and event.evidence["period"] == 1


def test_period_2_loop_with_reformatted_json_arguments_is_one_loop(task_image: str, tmp_path: Path) -> None:
    a_forms = ['{"command": "cat calc.py", "description": "read"}',
               '{ "description":"read",\n  "command":"cat calc.py" }',
               '{"command": "cat \\u0063alc.py", "description": "read"}']
    b_forms = ['{"command": "ls -la", "description": "list"}',
               '{"description": "list", "command": "ls -la"}',
               '{"command":"ls -la","description":"list"}']
    def answer(i: int):  # the scripted endpoint's reply to call i
        return tool_answer(i, (a_forms if i % 2 == 0 else b_forms)[(i // 2) % 3])
    with scripted_endpoint(answer) as (url, bodies):
        record = _trial(url, tmp_path, action_format="toolcall", config_name="swebench")
    assert record.exception_type == "AgentLoopError", record.exception_message
    assert len(bodies) == 6, "blocked at the end of the third A-B cycle"
    evidence = record.supervision.evidence
    assert evidence["period"] == 2 and evidence["indices"] == [0, 1, 2, 3, 4, 5]
    assert evidence["signatures"] == [call_signature("bash", json.loads(a_forms[0])),
                                      call_signature("bash", json.loads(b_forms[0]))]
    assert record.reward == 0.0 and record.verifier_s is not None
    # the tool-call format was really used: observations answer each call id
    assert any(m.get("role") == "tool" and m.get("tool_call_id") == "call_1" for m in bodies[-1]["messages"])
    assert bodies[0]["tools"][0]["function"]["name"] == "bash"


def test_loop_threshold_is_a_parameter(task_image: str, tmp_path: Path) -> None:
    with scripted_endpoint(lambda i: text_answer("cat calc.py")) as (url, bodies):
        record = _trial(url, tmp_path, loop_threshold=5)
    assert record.exception_type == "AgentLoopError" and len(bodies) == 5


def test_model_server_that_stops_answering_is_a_hang(task_image: str, tmp_path: Path) -> None:
    def answer(i: int):  # the scripted endpoint's reply to call i
        return text_answer("ls") if i == 0 else None
    started = time.monotonic()
    with scripted_endpoint(answer) as (url, bodies):
        record = _trial(url, tmp_path, hang_idle_s=2.0)
    assert record.exception_type == "AgentHangError", record.exception_message
    assert len(bodies) == 2
    evidence = record.supervision.evidence
    assert evidence["during"] == "a model call" and evidence["idle_s"] > 2.0 and evidence["idle_limit_s"] == 2.0
    assert record.reward == 0.0 and record.verifier_s is not None, "the verifier still runs (flagged)"
    assert time.monotonic() - started < 60, "stopped by the watchdog, not by the 120 s agent budget"
    assert _messages(record.supervision.trajectory_path)[-1]["extra"]["exit_status"] == "AgentHangError"


def test_command_stuck_past_the_idle_limit_is_a_hang(task_image: str, tmp_path: Path) -> None:
    def answer(i: int):  # the scripted endpoint's reply to call i
        return text_answer("sleep 100") if i == 0 else text_answer("ls")
    started = time.monotonic()
    with scripted_endpoint(answer) as (url, bodies):
        record = _trial(url, tmp_path, hang_idle_s=2.0, command_timeout_s=100)
    assert record.exception_type == "AgentHangError", record.exception_message
    assert record.supervision.evidence["during"] == "a command"
    assert len(bodies) == 1, "the run stopped before asking the model again"
    assert time.monotonic() - started < 60, "the watchdog killed the stuck command"
    assert record.verifier_s is not None


def test_the_watchdogs_kill_leaves_the_container_for_the_submission(task_image: str, tmp_path: Path) -> None:
    """Regression: the hang kill used to be ``kill -KILL -1`` in mini-swe-agent's ``--init``
    container, which also killed the container's ``sleep`` (so the container exited and the
    submission was lost). Now only the processes the agent's commands started are killed: the fix
    made before the stuck command is submitted and graded."""
    def answer(i: int):  # the scripted endpoint's reply to call i: fix (no submit), then get stuck
        return text_answer("sed -i 's/a - b/a + b/' calc.py") if i == 0 else text_answer("sleep 100")
    with scripted_endpoint(answer) as (url, bodies):
        record = _trial(url, tmp_path, hang_idle_s=2.0, command_timeout_s=100)
    assert record.exception_type == "AgentHangError", record.exception_message
    assert record.supervision.evidence["during"] == "a command" and len(bodies) == 2
    assert "could not take the submission" not in (record.exception_message or "")
    assert record.reward == 1.0, "the fix in the agent's container was submitted after the kill"
    traj = json.loads(Path(record.supervision.trajectory_path).read_text())
    assert "a + b" in traj["info"]["submission"]
    assert traj["info"]["config"]["environment_type"] == "forgeflow.evaluation.sandbox_env.SandboxEnvironment"
    assert traj["info"]["config"]["environment"]["backend"] == "podman"


def test_a_task_rows_image_reaches_the_model_with_every_request_and_keys_the_trial(task_image: str,
                                                                                  tmp_path: Path) -> None:
    """A canary row with a screenshot (a multimodal task): the model receives it as an OpenAI ``image_url``
    part of the first user turn in every request (recorded by the scripted endpoint), the bytes inline, and
    the trial's id depends on the image's digest (another screenshot is another trial)."""
    import base64

    from PIL import Image

    from forgeflow.evaluation.canary import CanaryTask

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(red)
    Image.new("RGB", (8, 8), (0, 0, 255)).save(blue)
    base = calc_task(task_image_ref).model_dump()
    task = CanaryTask(**{**base, "repo": "calc", "image_digest": "sha256:" + "0" * 64, "images": [str(red)]})
    cfg = AgentConfig(step_limit=30, agent_timeout_s=120, memory_mb=512)
    with scripted_endpoint(lambda i: text_answer("cat calc.py")) as (url, bodies):
        record = run_agent_trial(task, url, "scripted", cfg, tmp_path / "red")
    assert record.exception_type == "AgentLoopError" and len(bodies) == 3  # stopped by the loop detector
    for body in bodies:
        first_user = next(m for m in body["messages"] if m["role"] == "user")
        parts = first_user["content"]
        assert isinstance(parts, list) and parts[0]["type"] == "text", parts
        (image,) = [p for p in parts if p["type"] == "image_url"]
        assert base64.b64decode(image["image_url"]["url"].split(",", 1)[1]) == red.read_bytes()
        assert not any(isinstance(m["content"], list) for m in body["messages"] if m is not first_user)
    other = CanaryTask(**{**base, "repo": "calc", "image_digest": "sha256:" + "0" * 64, "images": [str(blue)]})
    with scripted_endpoint(lambda i: text_answer("cat calc.py")) as (url, _):
        assert run_agent_trial(other, url, "scripted", cfg, tmp_path / "blue").trial_id != record.trial_id
