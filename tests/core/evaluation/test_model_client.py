"""The model client: retries, budget, circuit breaker, stream completeness, response cache.

The fault tests run against a loopback fake of the OpenAI HTTP API (stdlib ``http.server`` in a
thread on 127.0.0.1, port 0), because faults (a 503 then a 200, a stream closed early, a 401, a
hang) cannot be injected into the real llama-cpp-python server on demand. The last test talks to
the real llama-cpp-python server serving the tiny GGUF, when that GGUF is already cached.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from forgeflow.common.errors import (
    CircuitOpenError,
    InputError,
    ModelEndpointError,
    ModelRequestError,
    is_transient,
)
from forgeflow.evaluation.circuit import CircuitBreaker, CircuitState
from forgeflow.evaluation.model_client import (
    ChatRequest,
    ChatResponse,
    ModelClient,
    ResponseCache,
    RetryPolicy,
    cache_key,
    chat_request,
)

MESSAGES = [{"role": "user", "content": "Say hi"}]
DIGEST = "a" * 64
FAST = RetryPolicy(max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.05, total_budget_s=20.0)


class FakeOpenAI:
    """A scripted OpenAI chat endpoint: each request pops the next action (default: a good answer).

    Actions: ("ok", text) | ("status", code) | ("stream_ok", text) | ("stream_cut", text)
    | ("hang", seconds) | ("slow_ok", seconds).
    """

    def __init__(self) -> None:
        self.script: list[tuple[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    action = fake.script.pop(0) if fake.script else ("ok", "hello")
                kind, arg = action
                try:
                    if kind == "hang":
                        time.sleep(arg)
                        kind, arg = "ok", "late"
                    if kind == "slow_ok":
                        time.sleep(arg)
                        kind, arg = "ok", "probe"
                    if kind == "ok":
                        self._json(200, completion(arg))
                    elif kind == "status":
                        self._json(arg, {"error": {"message": f"status {arg}"}}, {"Retry-After": "0"} if arg == 429 else {})
                    elif kind in ("stream_ok", "stream_cut"):
                        self._stream(arg, complete=kind == "stream_ok")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _json(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, text: str, complete: bool) -> None:
                # No Content-Length, Connection: close: the body ends when the socket closes, so a
                # cut stream is a clean EOF that only the terminal-event check can catch.
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for word in text.split(" "):
                    chunk = {"model": "fake", "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if complete:
                    final = {"model": "fake", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                    self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def requests(self) -> int:
        with self.lock:
            return len(self.bodies)


def completion(text: str, finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def client_for(fake: FakeOpenAI, **kwargs: Any) -> ModelClient:
    kwargs.setdefault("retry", FAST)
    return ModelClient(fake.base_url, **kwargs)


def test_503_then_200_is_retried_and_returns_the_answer(fake: FakeOpenAI) -> None:
    fake.script = [("status", 503), ("status", 429), ("ok", "hi there")]
    with client_for(fake) as client:
        response = client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert response.content == "hi there" and response.finish_reason == "stop"
    assert response.attempts == 3 and fake.requests == 3
    assert response.prompt_tokens == 5


def test_5xx_beyond_the_attempts_is_a_transient_endpoint_error(fake: FakeOpenAI) -> None:
    fake.script = [("status", 500)] * 5
    with client_for(fake) as client, pytest.raises(ModelEndpointError, match="failed 3 attempts") as info:
        client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert is_transient(info.value) and fake.requests == 3


def test_401_is_not_retried(fake: FakeOpenAI) -> None:
    fake.script = [("status", 401), ("ok", "never")]
    with client_for(fake) as client, pytest.raises(ModelRequestError, match="401") as info:
        client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert not is_transient(info.value) and fake.requests == 1


def test_a_hang_times_out_without_a_retry(fake: FakeOpenAI) -> None:
    fake.script = [("hang", 3.0)]
    started = time.monotonic()
    with client_for(fake, read_timeout_s=0.5) as client, pytest.raises(ModelEndpointError, match="Timeout"):
        client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert time.monotonic() - started < 2.5 and fake.requests == 1


def test_total_budget_stops_the_retries(fake: FakeOpenAI) -> None:
    fake.script = [("status", 503)] * 10
    policy = RetryPolicy(max_attempts=10, backoff_initial_s=0.4, backoff_max_s=0.4, total_budget_s=1.0)
    with client_for(fake, retry=policy) as client, pytest.raises(ModelEndpointError, match="budget of 1 s spent"):
        client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert 2 <= fake.requests <= 3  # attempts at ~0 s and ~0.4 s (and ~0.8 s); never past 1 s


def test_connection_refused_is_retried_then_a_transient_error() -> None:
    client = ModelClient("http://127.0.0.1:5769/v1", retry=FAST)  # nothing listens there
    with client, pytest.raises(ModelEndpointError, match="ConnectError") as info:
        client.chat(ChatRequest(model="tiny", messages=MESSAGES))
    assert is_transient(info.value) and "3 attempts" in str(info.value)


def test_a_stream_closed_early_is_an_error_never_a_result(fake: FakeOpenAI, tmp_path: Path) -> None:
    fake.script = [("stream_cut", "half an answer")] * 3
    cache = ResponseCache(tmp_path / "cache", ttl_s=60)
    with client_for(fake, cache=cache, model_digest=DIGEST) as client:
        with pytest.raises(ModelEndpointError, match="without its terminal event"):
            client.chat(ChatRequest(model="tiny", messages=MESSAGES), stream=True)
    assert fake.requests == 3 and len(cache) == 0


def test_a_stream_cut_once_is_retried_and_the_full_answer_cached(fake: FakeOpenAI, tmp_path: Path) -> None:
    fake.script = [("stream_cut", "half"), ("stream_ok", "the whole answer")]
    cache = ResponseCache(tmp_path / "cache", ttl_s=60)
    request = ChatRequest(model="tiny", messages=MESSAGES)
    with client_for(fake, cache=cache, model_digest=DIGEST) as client:
        response = client.chat(request, stream=True)
        assert response.content == "the whole answer " and response.finish_reason == "stop"
        assert response.attempts == 2 and len(cache) == 1
        again = client.chat(request)
    assert again.cached and again.content == "the whole answer " and fake.requests == 2


def test_circuit_opens_then_half_open_admits_exactly_one_probe(fake: FakeOpenAI) -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=30.0, clock=lambda: now[0])
    single = RetryPolicy(max_attempts=1)
    fake.script = [("status", 503), ("status", 503)]
    with client_for(fake, retry=single, breaker=breaker) as client:
        request = ChatRequest(model="tiny", messages=MESSAGES)
        for _ in range(2):
            with pytest.raises(ModelEndpointError):
                client.chat(request)
        assert breaker.state is CircuitState.OPEN
        with pytest.raises(CircuitOpenError, match="circuit open"):
            client.chat(request)
        assert fake.requests == 2  # refused without being sent

        now[0] = 31.0
        fake.script = [("slow_ok", 1.0)]
        barrier = threading.Barrier(4)
        outcomes: list[str] = []

        def call() -> None:
            barrier.wait()
            try:
                outcomes.append(client.chat(request).content)
            except CircuitOpenError:
                outcomes.append("refused")

        threads = [threading.Thread(target=call) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert sorted(outcomes) == ["probe", "refused", "refused", "refused"]
    assert fake.requests == 3 and breaker.state is CircuitState.CLOSED


def test_a_failed_probe_reopens_the_circuit() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=lambda: now[0])
    breaker.acquire()
    breaker.record_failure()
    assert breaker.state is CircuitState.OPEN
    now[0] = 5.0
    breaker.acquire()  # the probe
    with pytest.raises(CircuitOpenError, match="probe is in flight"):
        breaker.acquire()
    breaker.record_failure()
    with pytest.raises(CircuitOpenError, match="next probe in 5.0 s"):
        breaker.acquire()
    now[0] = 10.0
    breaker.acquire()
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED and breaker.consecutive_failures == 0


def test_cache_key_covers_every_sampling_parameter_and_epoch() -> None:
    base = ChatRequest(model="tiny", messages=MESSAGES, temperature=0.7, max_tokens=64, seed=1)
    key = cache_key(DIGEST, base)
    variants = [
        base.model_copy(update={"temperature": 0.8}),
        base.model_copy(update={"top_p": 0.9}),
        base.model_copy(update={"max_tokens": 65}),
        base.model_copy(update={"seed": 2}),
        base.model_copy(update={"stop": ["\n"]}),
        base.model_copy(update={"presence_penalty": 0.1}),
        base.model_copy(update={"extra_params": {"top_k": 40}}),
        base.model_copy(update={"messages": [{"role": "user", "content": "Say hi!"}]}),
    ]
    keys = {key, *(cache_key(DIGEST, v) for v in variants), cache_key("b" * 64, base), cache_key(DIGEST, base, epoch=1)}
    assert len(keys) == len(variants) + 3
    # the alias and fields the endpoint never sees are not part of the key
    assert cache_key(DIGEST, base.model_copy(update={"model": "other-alias"})) == key
    extra = [{"role": "user", "content": "Say hi", "extra": {"timestamp": 1.0}}]
    assert cache_key(DIGEST, base.model_copy(update={"messages": extra})) == key
    # greedy decoding: every epoch gives the same answer, so the epoch is not keyed
    greedy = base.model_copy(update={"temperature": 0.0})
    assert cache_key(DIGEST, greedy, epoch=0) == cache_key(DIGEST, greedy, epoch=3)


def test_sampled_epochs_do_not_reuse_samples(fake: FakeOpenAI, tmp_path: Path) -> None:
    fake.script = [("ok", "sample one"), ("ok", "sample two")]
    cache = ResponseCache(tmp_path / "cache", ttl_s=60)
    request = ChatRequest(model="tiny", messages=MESSAGES, temperature=0.8)
    with client_for(fake, cache=cache, model_digest=DIGEST) as client:
        first = client.chat(request, epoch=0)
        second = client.chat(request, epoch=1)
        replay = client.chat(request, epoch=0)
    assert (first.content, second.content) == ("sample one", "sample two")
    assert replay.cached and replay.content == "sample one" and fake.requests == 2


def test_cache_ttl_and_truncated_answers(tmp_path: Path) -> None:
    now = [1000.0]
    cache = ResponseCache(tmp_path, ttl_s=10, clock=lambda: now[0])
    key = cache_key(DIGEST, ChatRequest(model="tiny", messages=MESSAGES))
    assert not cache.put(key, ChatResponse(content="cut at max_tok", finish_reason="length"))
    assert cache.get(key) is None and len(cache) == 0
    assert cache.put(key, ChatResponse(content="done", finish_reason="stop"))
    now[0] = 1010.0
    assert cache.get(key) is not None and cache.get(key).content == "done"
    now[0] = 1010.5
    assert cache.get(key) is None  # expired


def test_errors_are_never_cached(fake: FakeOpenAI, tmp_path: Path) -> None:
    fake.script = [("status", 500)] * 3 + [("ok", "fresh")]
    cache = ResponseCache(tmp_path / "cache", ttl_s=60)
    request = ChatRequest(model="tiny", messages=MESSAGES)
    with client_for(fake, cache=cache, model_digest=DIGEST) as client:
        with pytest.raises(ModelEndpointError):
            client.chat(request)
        assert len(cache) == 0
        assert client.chat(request).content == "fresh"


def test_bad_requests_name_the_input() -> None:
    with pytest.raises(InputError, match="temperature"):
        chat_request("tiny", MESSAGES, temperature=3.0)
    with pytest.raises(InputError, match="role"):
        chat_request("tiny", [{"content": "no role"}])
    with pytest.raises(InputError, match="model_digest"):
        ModelClient("http://127.0.0.1:1/v1", cache=ResponseCache(Path("/tmp/unused"), ttl_s=1))
    assert chat_request("tiny", MESSAGES, top_k=40, seed=3).api_body()["top_k"] == 40


@pytest.mark.integration
@pytest.mark.slow
def test_real_llama_cpp_server_answers_streamed_and_not(tmp_path: Path) -> None:
    """The real llama-cpp-python OpenAI server on the cached tiny GGUF (built by the serving tests)."""
    from forgeflow.common.settings import cache_dir
    from forgeflow.serving.server import ModelServer

    gguf = cache_dir() / "test-fixtures" / "tiny-seed0" / "tiny-q8_0.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not built yet (tests/integration/test_serving.py builds it)")
    cache = ResponseCache(tmp_path / "cache", ttl_s=60)
    request = ChatRequest(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0)
    with ModelServer(gguf, 8861, "tiny", n_ctx=512, log_path=tmp_path / "server.log") as server:
        with ModelClient(server.base_url, model_digest=DIGEST, cache=cache, retry=FAST) as client:
            plain = client.chat(request)
        with ModelClient(server.base_url, retry=FAST) as client:
            streamed = client.chat(request, stream=True)
    assert plain.finish_reason in ("stop", "length") and streamed.finish_reason == plain.finish_reason
    assert streamed.content == plain.content
    assert plain.completion_tokens is not None and 1 <= plain.completion_tokens <= 6
    assert len(cache) == (1 if plain.finish_reason == "stop" else 0)  # cut at max_tokens: not stored
