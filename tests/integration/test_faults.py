"""Injected faults against the real local stack: each ends as the right exception, retried or not as
the taxonomy says (``forgeflow.common.errors``), and never as reward 0.

Real pieces: the llama-cpp-python OpenAI server on the tiny Q8_0 GGUF, mini-swe-agent, podman
containers of the calc task image, the verifier. Faults:

* the model server killed with SIGKILL (by its PID) in the middle of an agent trial;
* a server that closes the stream early: a loopback proxy (stdlib ``http.server``) in front of the
  real server forwards each request and cuts the real response short (the real server cannot be
  made to cut its own responses on demand, so the proxy does it);
* a verifier that prints garbage instead of ``pytest -rA`` output;
* a 66-character task id (upper case, dots, underscores: not a valid container name) through an
  agent trial (its verifier container is named from the id).

Already covered elsewhere and not repeated: sandbox OOM and verifier timeout (test_trial.py), a
dead/503/400 endpoint (test_agent.py), the stream completeness rule on a scripted fake
(tests/core/evaluation/test_model_client.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from test_agent import BUG_PATCH, F2P, P2P, TEST_COMMAND, calc_task, task_image  # noqa: F401 - fixture

from forgeflow.common.errors import ModelEndpointError
from forgeflow.common.settings import tool_env
from forgeflow.evaluation.agent import (
    AgentConfig,
    run_agent_trial,
)
from forgeflow.evaluation.model_client import (
    ModelClient,
    ResponseCache,
    RetryPolicy,
    chat_request,
)
from forgeflow.evaluation.mswea import stream_path
from forgeflow.sandbox.trial import container_name, make_trial_id
from forgeflow.serving.server import ModelServer
from tests.helpers import free_port as _free_port
from tests.helpers import tiny_ggufs

pytestmark = pytest.mark.integration

FAST = RetryPolicy(max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.2, total_budget_s=60.0)
LONG_ID = "Owner__Repo.func_pm_remove_assign__ABCD1234.With_A_Long_Tail_x" + "Zq9A"
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")




@contextmanager
def _server(tmp: Path) -> Iterator[ModelServer]:
    with ModelServer(tiny_ggufs()[0], _free_port(), "tiny", n_ctx=4096, log_path=tmp / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _server(tmp_path_factory.mktemp("server")) as server:
        yield server.base_url


class CuttingProxy:
    """Forwards ``POST /v1/chat/completions`` to ``upstream`` and cuts the first ``cut`` responses
    (all when ``cut`` is None): a stream loses everything from its 3rd event on (no finish_reason,
    no ``[DONE]``), a JSON body is sent with its full Content-Length but only half of its bytes.
    The real answer to a request body is fetched once and replayed to its retries (the same
    greedy request gets the same answer; it keeps the test within its time budget on 2 cores)."""

    def __init__(self, upstream: str, cut: int | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.cut = cut
        self.requests = 0
        self.cut_count = 0
        self.answers: dict[bytes, httpx.Response] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.requests += 1
                real = proxy.answers.get(body)
                if real is None:
                    real = proxy.answers[body] = httpx.post(
                        f"{proxy.upstream}{self.path.removeprefix('/v1')}", content=body,
                        headers={"Content-Type": "application/json"}, timeout=120)
                data = real.content
                cutting = proxy.cut is None or proxy.cut_count < proxy.cut
                streamed = real.headers.get("content-type", "").startswith("text/event-stream")
                try:
                    self.send_response(real.status_code)
                    self.send_header("Content-Type", real.headers.get("content-type", "application/json"))
                    if streamed:
                        self.send_header("Connection", "close")
                        if cutting:
                            events = data.split(b"\n\n")
                            data = b"\n\n".join(events[:2]) + b"\n\n"
                    else:
                        self.send_header("Content-Length", str(len(data)))
                        if cutting:
                            data = data[: len(data) // 2]
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                if cutting:
                    proxy.cut_count += 1
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> CuttingProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _agent_trial(url: str, out: Path, instance_id: str = "calc-add-1", **config):
    cfg = AgentConfig(**{"step_limit": 2, "agent_timeout_s": 120, "max_tokens": 48, "memory_mb": 512, **config})
    return run_agent_trial(calc_task("localhost/forgeflow/test-agent-calc:1", instance_id=instance_id), url, "tiny",
                           cfg, out, run_key=config.get("run_key", "faults"))


def test_model_server_killed_mid_trial_is_a_model_endpoint_error(task_image: str, tmp_path: Path) -> None:
    with _server(tmp_path) as server:
        trial_id = make_trial_id("calc-add-1", "agent", task_image, "faults")
        traj = tmp_path / f"{trial_id}.traj.json"
        killed: dict[str, float] = {}

        def kill_after_first_answer() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:  # the trajectory is streamed as it grows, one message a line
                    messages = stream_path(traj).read_text().splitlines()
                except OSError:
                    messages = []
                if len(messages) > 2:  # system, task, then the first answer (or its format error)
                    os.kill(server.pid, signal.SIGKILL)
                    killed["at"] = time.monotonic()
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=kill_after_first_answer, daemon=True)
        watcher.start()
        record = _agent_trial(server.base_url, tmp_path, step_limit=30)
        watcher.join(5)
    assert "at" in killed, f"the server was not killed after the first answer: {record}"
    assert record.exception_type == "ModelEndpointError", record.exception_message
    assert record.reward is None and record.verifier_s is None, "never reward 0 for a dead server"
    assert record.agent_steps >= 2  # one answered call, then the one that hit the dead server
    assert "attempts" in record.exception_message  # connection refused was retried, then given up


def test_stream_cut_by_a_proxy_is_retried_then_the_full_answer_returns(endpoint: str, tmp_path: Path) -> None:
    request = chat_request("tiny", [{"role": "user", "content": "Say hello."}], max_tokens=16, seed=0)
    direct = ModelClient(endpoint, retry=FAST).chat(request, stream=True)
    with CuttingProxy(endpoint, cut=1) as proxy:
        cache = ResponseCache(tmp_path / "cache", ttl_s=3600)
        answer = ModelClient(proxy.base_url, retry=FAST, cache=cache, model_digest="b" * 64).chat(request, stream=True)
    assert proxy.requests == 2 and answer.attempts == 2, "the cut stream was retried once"
    assert answer.content == direct.content and answer.finish_reason == direct.finish_reason


def test_stream_always_cut_is_a_transient_endpoint_error_and_never_cached(endpoint: str, tmp_path: Path) -> None:
    request = chat_request("tiny", [{"role": "user", "content": "Say hello."}], max_tokens=16, seed=0)
    cache = ResponseCache(tmp_path / "cache", ttl_s=3600)
    with CuttingProxy(endpoint) as proxy, pytest.raises(ModelEndpointError, match="terminal event") as info:
        ModelClient(proxy.base_url, retry=FAST, cache=cache, model_digest="b" * 64).chat(request, stream=True)
    assert proxy.requests == FAST.max_attempts and info.value.transient
    assert len(cache) == 0


def test_agent_behind_a_cutting_proxy_records_an_exception_not_reward_0(task_image: str, endpoint: str,
                                                                        tmp_path: Path) -> None:
    with CuttingProxy(endpoint) as proxy:
        record = _agent_trial(proxy.base_url, tmp_path)
    assert proxy.requests == 4, "ModelClient's default 4 attempts, all cut"
    assert record.exception_type == "ModelEndpointError" and record.reward is None and record.verifier_s is None
    assert "RemoteProtocolError" in record.exception_message


def test_verifier_printing_garbage_is_unparseable_output_not_reward_0(task_image: str, endpoint: str,
                                                                      tmp_path: Path) -> None:
    garbage = "echo 'Segmentation fault (core dumped)'; head -c 600 /dev/urandom | od -An -tx1 | head -20"
    record = run_agent_trial(calc_task(task_image, test_command=garbage), endpoint, "tiny",
                             AgentConfig(step_limit=1, max_tokens=32, memory_mb=512), tmp_path)
    assert record.exception_type == "VerifierOutputError", record.exception_message
    assert record.reward is None and "Segmentation fault" not in (record.exception_type or "")
    assert "exited" in record.exception_message  # the test command's exit status is in the evidence


def test_66_character_task_id_runs_end_to_end(task_image: str, endpoint: str, tmp_path: Path) -> None:
    assert len(LONG_ID) == 66 and not NAME_RE.match(LONG_ID)
    record = _agent_trial(endpoint, tmp_path, instance_id=LONG_ID, step_limit=1, run_key="long-id")
    assert record.exception_type is None, record.exception_message
    assert record.reward in (0.0, 1.0) and record.instance_id == LONG_ID
    assert record.verifier_s is not None and set(record.tests) >= set(F2P + P2P)
    # the verifier's container ran under the sanitized name (podman accepted it) and was removed
    name = container_name(LONG_ID, "agent", record.trial_id)
    assert NAME_RE.match(name) and len(name) <= 63 and name != container_name(LONG_ID + "x", "agent", record.trial_id)
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env=tool_env(), capture_output=True,
                          text=True, timeout=60).stdout.split()
    assert name not in left
