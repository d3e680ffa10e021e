"""One client for every OpenAI-compatible chat call: retries, a budget, a circuit breaker, a cache.

Retried within the budget: connect errors and timeouts, read and protocol errors, pool timeouts, 429 and 5xx
(``Retry-After`` honoured), an incomplete body or stream; then :class:`~forgeflow.common.errors.ModelEndpointError`
(transient). Not retried: a read timeout (``ModelEndpointError`` at once) and other 4xx
(:class:`~forgeflow.common.errors.ModelRequestError`). The cache key digests the model file's sha256, the
messages and every sampling parameter as sent (and the epoch when temperature > 0); only complete answers
(``finish_reason`` ``stop`` or ``tool_calls``) are stored."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common.errors import (
    CircuitOpenError,
    InputError,
    ModelEndpointError,
    ModelRequestError,
)
from forgeflow.common.fsutil import atomic_write_json, sha256_json
from forgeflow.evaluation.chat_images import api_content
from forgeflow.evaluation.circuit import CircuitBreaker

CACHE_SCHEMA_VERSION = 1
"""Version of the cache entry layout (and part of every key: a new layout never reads old keys)."""

CACHEABLE_FINISH_REASONS = frozenset({"stop", "tool_calls"})
"""Finish reasons of a complete answer; only these responses are stored in the cache."""

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
"""Message fields sent to the endpoint (mini-swe-agent's ``extra`` and the like are dropped)."""

_NAMED_PARAMS = ("temperature", "top_p", "max_tokens", "seed", "stop", "presence_penalty", "frequency_penalty")

_RETRIED_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.PoolTimeout,
)


# --- records ------------------------------------------------------------------------------------
class ChatRequest(BaseModel):
    """One chat completion request: the messages and every sampling parameter sent."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(min_length=1,
                       description="The model name the endpoint serves (an alias; the cache keys on the digest "
                                   "instead).")
    messages: list[dict[str, Any]] = Field(
        min_length=1,
        description="Chat messages [{\"role\", \"content\", ...}]; only role, content, name, tool_calls and "
                    "tool_call_id are sent (and keyed)")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0,
                               description="Sampling temperature in [0, 2]; 0 is greedy (and drops the epoch from "
                                           "the key).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    max_tokens: int | None = Field(default=None, ge=1,
                                   description="Completion token limit (None: the server's default).")
    seed: int | None = Field(None, description="Sampling seed (None: not sent).")
    stop: list[str] | None = Field(None, description="Stop strings (None: not sent).")
    presence_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0,
        description="OpenAI presence penalty in [-2, 2] (None: not sent).")
    frequency_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0,
        description="OpenAI frequency penalty in [-2, 2] (None: not sent).")
    extra_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Further body fields sent verbatim (llama.cpp's top_k, min_p, repeat_penalty...)")

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise ValueError(f"messages[{i}] has no 'role' string: {str(message)[:120]}")
        return messages

    @model_validator(mode="after")
    def _extra_params_do_not_shadow(self) -> ChatRequest:
        clash = sorted(set(self.extra_params) & {*_NAMED_PARAMS, "model", "messages", "stream"})
        if clash:
            raise ValueError(f"extra_params must not set {clash}; use the named fields")
        return self

    def api_body(self) -> dict[str, Any]:
        """The JSON body sent to ``/chat/completions`` (without ``stream``); None params omitted; a message's
        images inline (raises DigestMismatchError when an image file no longer has its digest)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{k: api_content(m) if k == "content" else m[k] for k in _MESSAGE_KEYS
                          if k in m or (k == "content" and m.get("images"))} for m in self.messages],
        }
        for name in _NAMED_PARAMS:
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        body.update(self.extra_params)
        return body


class ChatResponse(BaseModel):
    """A complete chat answer."""

    model_config = ConfigDict(frozen=True)

    content: str = Field(description="The assistant text (streamed deltas joined).")
    finish_reason: str | None = Field(
        description="stop, length, tool_calls... (None only for a stream that ended with [DONE] and never named "
                    "one).")
    tool_calls: list[dict[str, Any]] = Field(
        default_factory=list,
        description="OpenAI tool calls of a non-streamed answer (streamed tool deltas are not joined).")
    model: str = Field("", description="The model name the endpoint reported.")
    prompt_tokens: int | None = Field(default=None, ge=0, description="Input tokens, when the endpoint reported usage.")
    completion_tokens: int | None = Field(
        default=None, ge=0,
        description="Output tokens, when the endpoint reported usage.")
    attempts: int = Field(default=1, ge=0, description="HTTP attempts this call made (0 for a cache hit).")
    cached: bool = Field(False, description="True when served from the ResponseCache.")
    duration_s: float = Field(default=0.0, ge=0.0,
                              description="Wall seconds of the call, retries and backoff included.")

    @property
    def complete(self) -> bool:
        """True when the answer ended on its own (``stop``/``tool_calls``), not at a limit."""
        return self.finish_reason in CACHEABLE_FINISH_REASONS


class RetryPolicy(BaseModel):
    """How :class:`ModelClient` retries transient failures.

    The delay before attempt ``k + 1`` is ``min(backoff_max_s, backoff_initial_s *
    backoff_multiplier ** (k - 1))``, or the server's ``Retry-After`` (capped the same way). No
    attempt starts once ``total_budget_s`` (measured from the call's start) would be passed.
    """

    model_config = ConfigDict(frozen=True)

    max_attempts: int = Field(default=4, ge=1, le=100)
    backoff_initial_s: float = Field(default=0.5, ge=0.0)
    backoff_multiplier: float = Field(default=2.0, ge=1.0)
    backoff_max_s: float = Field(default=8.0, ge=0.0)
    total_budget_s: float = Field(default=300.0, gt=0.0)

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if retry_after_s is not None:
            return min(self.backoff_max_s, max(0.0, retry_after_s))
        return min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** (attempt - 1))


# --- cache --------------------------------------------------------------------------------------
def cache_key(model_digest: str, request: ChatRequest, epoch: int = 0) -> str:
    """The cache key (64 hex) of ``request`` against the model whose file has sha256 ``model_digest``.

    ``epoch`` is keyed only when ``request.temperature > 0``; an alias is not a model identity.

    Raises:
        InputError: ``model_digest`` is empty or ``epoch`` is negative.
    """
    if not model_digest:
        raise InputError("model_digest must be the served model's sha256, got an empty string")
    if epoch < 0:
        raise InputError(f"epoch must be >= 0, got {epoch}")
    body = request.api_body()
    body.pop("model")
    return sha256_json(
        {
            "schema_version": CACHE_SCHEMA_VERSION,
            "model_digest": model_digest,
            "request": body,
            "epoch": epoch if request.temperature > 0 else None,
        }
    )


class ResponseCache:
    """Complete chat answers on disk, one JSON file per key (``<root>/<key[:2]>/<key>.json``), valid ``ttl_s``.

    Raises:
        InputError: ``ttl_s <= 0``.
    """

    def __init__(self, root: str | Path, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise InputError(f"ttl_s must be > 0, got {ttl_s}")
        self.root = Path(root)
        self.ttl_s = float(ttl_s)
        self._clock = clock

    def _path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise InputError(f"cache key must be 64 lowercase hex characters, got {key!r}")
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> ChatResponse | None:
        """The stored answer for ``key``, or None when absent, expired or unreadable."""
        path = self._path(key)
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if entry.get("schema_version") != CACHE_SCHEMA_VERSION or entry.get("key") != key:
                return None
            if self._clock() - float(entry["stored_at_unix_s"]) > self.ttl_s:
                return None
            return ChatResponse.model_validate(entry["response"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, response: ChatResponse) -> bool:
        """Store ``response`` under ``key`` if complete (``finish_reason`` in :data:`CACHEABLE_FINISH_REASONS`).

        Returns True if stored, False for a truncated answer."""
        if not response.complete:
            return False
        entry = {
            "schema_version": CACHE_SCHEMA_VERSION,
            "key": key,
            "stored_at_unix_s": self._clock(),
            "response": response.model_dump(mode="json", exclude={"attempts", "cached", "duration_s"}),
        }
        atomic_write_json(self._path(key), entry)
        return True

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("??/*.json")) if self.root.is_dir() else 0


# --- client -------------------------------------------------------------------------------------
class _RetryableFailure(Exception):
    """Internal: one attempt failed in a way a retry may cure."""

    def __init__(self, error: ModelEndpointError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _parse_completion(data: Any, url: str) -> ChatResponse:
    if not isinstance(data, Mapping) or not data.get("choices"):
        raise _RetryableFailure(ModelEndpointError(f"{url} answered 200 without choices: {str(data)[:200]}"))
    choice = data["choices"][0]
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        raise _RetryableFailure(ModelEndpointError(f"{url} answered a choice without a message (truncated)"))
    usage = data.get("usage") or {}
    return ChatResponse(
        content=message.get("content") or "",
        finish_reason=choice.get("finish_reason"),
        tool_calls=list(message.get("tool_calls") or []),
        model=str(data.get("model") or ""),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


class ModelClient:
    """The OpenAI-compatible chat client every model call goes through.

    Args:
        base_url: Endpoint root including ``/v1`` (e.g. ``http://127.0.0.1:8801/v1``).
        breaker: Circuit breaker; share one per endpoint across clients (default: a new one).
        read_timeout_s: Seconds to wait for the next bytes of a response (capped by the budget).

    Raises:
        InputError: ``cache`` is given without ``model_digest``, or a timeout is not positive.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model_digest: str | None = None,
        retry: RetryPolicy | None = None,
        breaker: CircuitBreaker | None = None,
        cache: ResponseCache | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        api_key: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if cache is not None and not model_digest:
            raise InputError("a ResponseCache needs model_digest (the served model's sha256)")
        if connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise InputError(
                f"timeouts must be > 0, got connect_timeout_s={connect_timeout_s}, read_timeout_s={read_timeout_s}"
            )
        self.base_url = base_url.rstrip("/")
        self.model_digest = model_digest
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or CircuitBreaker()
        self.cache = cache
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> ModelClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def chat(self, request: ChatRequest, *, stream: bool = False, epoch: int = 0) -> ChatResponse:
        """Send one chat completion, retrying transient failures within the budget (``cached=True`` on a hit).

        Raises:
            CircuitOpenError: the breaker refused the call (open, or half-open with a probe out).
            ModelEndpointError: transient failures outlasted the attempts or the budget, or a read timed out.
            ModelRequestError: the endpoint answered a 4xx other than 429 (not retried).
        """
        started = time.monotonic()
        key = cache_key(self.model_digest or "", request, epoch) if self.cache is not None else None
        if key is not None and self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return hit.model_copy(update={"cached": True, "attempts": 0, "duration_s": time.monotonic() - started})
        deadline = started + self.retry.total_budget_s
        body = request.api_body()
        if stream:
            body["stream"] = True
        attempt = 0
        while True:
            attempt += 1
            try:
                self.breaker.acquire()
            except CircuitOpenError as exc:
                if attempt > 1:
                    raise CircuitOpenError(f"{exc} (gave up after {attempt - 1} attempts)") from exc
                raise
            try:
                response = self._attempt(body, stream, deadline)
            except _RetryableFailure as failure:
                self.breaker.record_failure()
                if attempt >= self.retry.max_attempts:
                    raise ModelEndpointError(
                        f"model endpoint {self.base_url} failed {attempt} attempts; last: {failure.error}"
                    ) from failure.error
                delay_s = self.retry.delay_s(attempt, failure.retry_after_s)
                if time.monotonic() + delay_s >= deadline:
                    raise ModelEndpointError(
                        f"model endpoint {self.base_url}: budget of {self.retry.total_budget_s:g} s spent "
                        f"after {attempt} attempts; last: {failure.error}"
                    ) from failure.error
                self._sleep(delay_s)
                continue
            except ModelEndpointError:
                self.breaker.record_failure()
                raise
            except ModelRequestError:
                self.breaker.record_success()  # the endpoint is up; the request is wrong
                raise
            except BaseException:
                self.breaker.release()
                raise
            self.breaker.record_success()
            response = response.model_copy(update={"attempts": attempt, "duration_s": time.monotonic() - started})
            if key is not None and self.cache is not None:
                self.cache.put(key, response)
            return response

    def _timeout(self, deadline: float) -> httpx.Timeout:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise ModelEndpointError(f"model endpoint {self.base_url}: budget of {self.retry.total_budget_s:g} s spent")
        return httpx.Timeout(
            connect=min(self.connect_timeout_s, remaining_s),
            read=min(self.read_timeout_s, remaining_s),
            write=min(self.connect_timeout_s, remaining_s),
            pool=min(self.connect_timeout_s, remaining_s),
        )

    def _check_status(self, response: httpx.Response, url: str) -> None:
        status = response.status_code
        if status == 429 or status >= 500:
            raise _RetryableFailure(
                ModelEndpointError(f"{url} answered HTTP {status}: {response.text[:200]}"), _retry_after_s(response)
            )
        if status >= 400:
            raise ModelRequestError(f"{url} rejected the request with HTTP {status}: {response.text[:200]}")

    def _attempt(self, body: dict[str, Any], stream: bool, deadline: float) -> ChatResponse:
        url = f"{self.base_url}/chat/completions"
        timeout = self._timeout(deadline)
        try:
            if not stream:
                response = self._http.post(url, json=body, timeout=timeout)
                self._check_status(response, url)
                try:
                    data = response.json()
                except ValueError as exc:
                    error = ModelEndpointError(f"{url} answered 200 with a body that is not JSON")
                    raise _RetryableFailure(error) from exc
                return _parse_completion(data, url)
            with self._http.stream("POST", url, json=body, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check_status(response, url)
                return self._read_stream(response, url, deadline)
        except _RETRIED_TRANSPORT_ERRORS as exc:
            raise _RetryableFailure(ModelEndpointError(f"{url}: {type(exc).__name__}: {exc}")) from exc
        except httpx.TimeoutException as exc:  # read/write timeouts: the server is up but slow
            raise ModelEndpointError(
                f"{url}: {type(exc).__name__} after {min(self.read_timeout_s, self.retry.total_budget_s):g} s: {exc}"
            ) from exc

    def _read_stream(self, response: httpx.Response, url: str, deadline: float) -> ChatResponse:
        parts: list[str] = []
        finish_reason: str | None = None
        done = False
        model = ""
        usage: Mapping[str, Any] = {}
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise ModelEndpointError(f"{url}: budget of {self.retry.total_budget_s:g} s spent mid-stream")
            if not line.startswith("data:"):
                continue  # blank separators, comments (":"), "event:"/"id:" fields
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except ValueError as exc:
                error = ModelEndpointError(f"{url}: unparseable stream event {payload[:120]!r}")
                raise _RetryableFailure(error) from exc
            if not isinstance(chunk, Mapping) or "error" in chunk:
                raise _RetryableFailure(ModelEndpointError(f"{url}: stream carried an error: {payload[:200]}"))
            model = str(chunk.get("model") or model)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                parts.append(delta.get("content") or "")
                finish_reason = choice.get("finish_reason") or finish_reason
        if not done and finish_reason is None:
            raise _RetryableFailure(
                ModelEndpointError(
                    f"{url}: stream ended without its terminal event ([DONE] or a finish_reason) "
                    f"after {sum(map(len, parts))} characters"
                )
            )
        return ChatResponse(
            content="".join(parts),
            finish_reason=finish_reason,
            model=model,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )


def chat_request(model: str, messages: Sequence[Mapping[str, Any]], **params: Any) -> ChatRequest:
    """Build a :class:`ChatRequest`; unknown keyword parameters go to ``extra_params``.

    Raises:
        InputError: a parameter is out of bounds or a message has no role.
    """
    named = {k: params.pop(k) for k in list(params) if k in _NAMED_PARAMS}
    try:
        return ChatRequest(model=model, messages=[dict(m) for m in messages], extra_params=params, **named)
    except ValueError as exc:
        raise InputError(f"invalid chat request: {exc}") from exc
