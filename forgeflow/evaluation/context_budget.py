"""Context accounting of an agent's requests: refuse one that cannot fit the served slot before sending it.

A request over a llama.cpp slot fails there only after its whole prompt was sent and parsed (a 66K request on
a 65,536-token slot); refusing it on the host is the model's outcome (mini-swe-agent's ``ContextWindowExceeded``).
The floor is the previous request's ``usage`` plus the new messages (bytes + :data:`TEMPLATE_TOKENS_MAX` bound
their tokens; counted with the endpoint's tokenizer only when that bound does not fit), so a step costs the
same at any step count. No ``/props`` answer: no known slot, nothing refused here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

TEMPLATE_TOKENS_MAX = 16
"""Tokens a chat template may add around one message (Qwen2's ``<|im_start|>role\\n ... <|im_end|>\\n`` adds 5);
used only in the upper bound that decides whether counting is needed."""

PROBE_TIMEOUT_S = 5.0
"""Seconds the ``/props`` and tokenizer requests may take."""

TokenCounter = Callable[[str], int | None]
"""Text -> its token count with the served model's tokenizer, or None when it cannot be counted."""


class ContextCheck(BaseModel):
    """One request's account."""

    model_config = ConfigDict(frozen=True)

    floor_tokens: int = Field(ge=0, description="tokens its prompt holds at least.")
    ceiling_tokens: int | None = Field(default=None, ge=0,
                                       description="tokens its prompt holds at most (None: unbounded, no previous "
                                                   "usage).")
    max_completion_tokens: int = Field(ge=0, description="the completion cap asked for.")
    slot_tokens: int | None = Field(default=None, ge=1, description="the slot's context (None: unknown).")
    counted: bool = Field(False, description="the new messages were counted with the tokenizer.")
    fits: bool = Field(True, description="False when the floor plus the completion cap exceeds the slot.")


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    text = str(content or "")
    for call in message.get("tool_calls") or []:
        text += str((call.get("function") or {}).get("arguments") or "")
    return text


class ContextBudget:
    """The token account of one agent run against one served slot (``slot_tokens`` None: nothing is refused;
    ``counter`` None: the floor holds only the previous usage; ``counted_messages`` counts its work)."""

    def __init__(self, slot_tokens: int | None, max_completion_tokens: int,
                 counter: TokenCounter | None = None) -> None:
        self.slot_tokens = slot_tokens
        self.max_completion_tokens = max(0, int(max_completion_tokens))
        self.counter = counter
        self.counted_messages = 0
        self._base_tokens: int | None = None
        self._base_messages = 0

    def check(self, messages: Sequence[Mapping[str, Any]]) -> ContextCheck:
        """The account of a request of ``messages`` (the whole conversation, as sent).

        Returns:
            :class:`ContextCheck`; ``fits`` False when the request cannot fit the slot.
        """
        known = self._base_tokens is not None
        new = messages[self._base_messages + 1:] if known else messages
        base = self._base_tokens or 0
        ceiling = base + TEMPLATE_TOKENS_MAX + sum(len(_content_text(m).encode("utf-8")) + TEMPLATE_TOKENS_MAX
                                                   for m in new)
        slot, cap = self.slot_tokens, self.max_completion_tokens
        if slot is None or ceiling + cap <= slot:
            return ContextCheck(floor_tokens=base, ceiling_tokens=ceiling, max_completion_tokens=cap,
                                slot_tokens=slot)
        floor, counted = base, False
        if self.counter is not None:
            counts = [self.counter(_content_text(m)) for m in new]
            self.counted_messages += len(new)
            if all(c is not None for c in counts):
                floor, counted = base + sum(c for c in counts if c is not None), True
        return ContextCheck(floor_tokens=floor, ceiling_tokens=ceiling, max_completion_tokens=cap, slot_tokens=slot,
                            counted=counted, fits=floor + cap <= slot)

    def observe(self, n_messages: int, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """Record the usage of a request of ``n_messages`` messages that was answered (no usage reported:
        the next check reads the whole conversation)."""
        if prompt_tokens is None:
            self._base_tokens, self._base_messages = None, 0
            return
        self._base_tokens = int(prompt_tokens) + int(completion_tokens or 0)
        self._base_messages = n_messages


def endpoint_root(base_url: str) -> str:
    """The server's root: ``base_url`` less a trailing ``/v1`` (where llama-server answers ``/props``)."""
    return base_url.rstrip("/").removesuffix("/v1")


def read_slot_tokens(base_url: str, api_key: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The per-slot context llama-server reports at ``GET /props`` (``default_generation_settings.n_ctx``).

    Returns:
        Tokens, or None when the endpoint does not answer ``/props`` with that field (another server,
        an error status, a refused connection).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{endpoint_root(base_url)}/props", headers=headers, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        n_ctx = int(resp.json()["default_generation_settings"]["n_ctx"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return n_ctx if n_ctx > 0 else None


def endpoint_counter(base_url: str, model_alias: str, api_key: str | None = None,
                     timeout_s: float = PROBE_TIMEOUT_S) -> TokenCounter:
    """The served model's token count through the endpoint: llama-server's ``POST /tokenize``
    (``{"content"}`` -> ``{"tokens": [...]}``), else llama-cpp-python's ``POST /extras/tokenize/count``
    (``{"input", "model"}`` -> ``{"count"}``). The first route that answers is kept; when neither does,
    the counter returns None (and asks no more)."""
    root = endpoint_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    routes: list[tuple[str, Callable[[str], dict[str, Any]], Callable[[Any], int]]] = [
        ("/tokenize", lambda t: {"content": t, "add_special": False}, lambda b: len(b["tokens"])),
        ("/extras/tokenize/count", lambda t: {"input": t, "model": model_alias}, lambda b: int(b["count"])),
    ]

    def count(text: str) -> int | None:
        while routes:
            path, body, read = routes[0]
            try:
                resp = httpx.post(f"{root}{path}", json=body(text), headers=headers, timeout=timeout_s)
                if resp.status_code == 200:
                    return read(resp.json())
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            routes.pop(0)
        return None

    return count
