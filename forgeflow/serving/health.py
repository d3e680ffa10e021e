"""The serving gate: a running endpoint checked the way a client would use it."""

from __future__ import annotations

import time

import httpx
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.serving.multimodal import ImageSmoke, image_smoke

SMOKE_MAX_TOKENS = 8


# --- gate ------------------------------------------------------------------------------------
class ServingGateResult(BaseModel):
    """Evidence that an endpoint serves the model."""

    model_config = ConfigDict(frozen=True)

    models_ok: bool = Field(description="GET /models answered 200 and listed the alias.")
    model_ids: list[str] = Field(default_factory=list, description="the ids /models listed.")
    smoke_tokens: int = Field(ge=0, description="completion tokens of the smoke chat completion (0 if it failed).")
    latency_s: float = Field(ge=0, description="wall time of the smoke completion in seconds.")
    image: ImageSmoke | None = Field(None,
                                     description="the image smoke's evidence (None: the endpoint was not gated with "
                                                 "an image).")
    passed: bool = Field(description="models_ok and smoke_tokens >= 1 (and, with an image, no image smoke error).")
    error: str = Field("", description="what failed, empty when passed.")


def gate(base_url: str, model_alias: str, timeout_s: float = 60.0, api_key: str | None = None,
         image: bool = False) -> ServingGateResult:
    """Check an OpenAI-compatible endpoint: the alias is listed and a smoke completion answers; with
    ``image``, a red square sent as an ``image_url`` must add prompt tokens (and ``/props`` must not report
    the vision modality off): a server that dropped its projector, or refuses images, fails.

    Args:
        base_url: e.g. ``http://127.0.0.1:8801/v1``.
        timeout_s: per-request timeout in seconds.
        api_key: sent as ``Authorization: Bearer`` (an external endpoint's key); None: no header.
    """
    base = base_url.rstrip("/")
    model_ids: list[str] = []
    models_ok = False
    smoke_tokens = 0
    latency_s = 0.0
    problems: list[str] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        try:
            resp = client.get(f"{base}/models")
            if resp.status_code == 200:
                model_ids = [str(m.get("id")) for m in resp.json().get("data", [])]
                models_ok = model_alias in model_ids
                if not models_ok:
                    problems.append(f"/models lists {model_ids}, not {model_alias!r}")
            else:
                problems.append(f"/models answered {resp.status_code}")
        except (httpx.HTTPError, ValueError) as exc:
            problems.append(f"/models failed: {type(exc).__name__}: {exc}")
        t0 = time.monotonic()
        try:
            resp = client.post(
                f"{base}/chat/completions",
                json={
                    "model": model_alias,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": SMOKE_MAX_TOKENS,
                    "temperature": 0.0,
                },
            )
            latency_s = time.monotonic() - t0
            if resp.status_code == 200:
                smoke_tokens = int((resp.json().get("usage") or {}).get("completion_tokens") or 0)
                if smoke_tokens < 1:
                    problems.append("smoke completion returned no tokens")
            else:
                problems.append(f"smoke completion answered {resp.status_code}: {resp.text[:300]}")
        except (httpx.HTTPError, ValueError) as exc:
            latency_s = time.monotonic() - t0
            problems.append(f"smoke completion failed: {type(exc).__name__}: {exc}")
        smoke = image_smoke(client, base, model_alias) if image else None
    if smoke is not None and smoke.error:
        problems.append(smoke.error)
    return ServingGateResult(
        models_ok=models_ok,
        model_ids=model_ids,
        smoke_tokens=smoke_tokens,
        latency_s=latency_s,
        image=smoke,
        passed=models_ok and smoke_tokens >= 1 and not (smoke is not None and smoke.error),
        error="; ".join(problems),
    )
