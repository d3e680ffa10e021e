"""An OpenAI-compatible endpoint forgeflow does not start (``kind="external"``): what a swap to it checks.

:func:`probe` runs ``models`` (always), ``identity`` and ``slot_context`` (only when the endpoint answers
llama-server's ``GET /props``); ``accelerator`` never runs (the offload is in a load log forgeflow cannot
read). A check that did not run is reported ``not_run``, never a pass."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_file
from forgeflow.serving.llama_server import ContextPreflightError, ServerProps

PROBE_TIMEOUT_S = 30.0
"""Seconds one probe request (``/models``, ``/props``) may take."""


class EndpointCheck(BaseModel):
    """One check of a served endpoint and whether it ran."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="models, smoke, identity, slot_context, accelerator or gguf_metadata.")
    status: Literal["passed", "partial", "not_run"] = Field(
        description="passed; partial (ran on less evidence than a started server gives, said in detail)")
    detail: str = Field(description="what was seen, in words.")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def props_url(base_url: str) -> str:
    """Where llama-server answers ``/props``: its root, i.e. ``base_url`` less a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return f"{root.removesuffix('/v1')}/props"


def check_models(base_url: str, model_alias: str, api_key: str | None = None,
                 timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """``GET <base_url>/models`` must answer 200 with an OpenAI models list naming ``model_alias``.

    Raises:
        PreflightError: the endpoint does not answer (refused, timed out, DNS), answers another status
            than 200/401/403, or not with a models list (the URL and what came back named).
        InputError: 401/403 (a missing or refused API key: set ``api_key_secret``), or ``model_alias``
            is not among the ids listed (the ids named).
    """
    url = f"{base_url.rstrip('/')}/models"
    try:
        resp = httpx.get(url, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise errors.PreflightError(f"external endpoint {url} does not answer: {type(exc).__name__}: {exc}") from exc
    if resp.status_code in (401, 403):
        key = "the API key it was sent was refused" if api_key else "it wants an API key (set api_key_secret)"
        raise errors.InputError(f"external endpoint {url} answered {resp.status_code}: {key}")
    if resp.status_code != 200:
        raise errors.PreflightError(f"external endpoint {url} answered {resp.status_code}: {resp.text[:300]}")
    try:
        ids = [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.PreflightError(f"external endpoint {url} did not answer an OpenAI models list: "
                                    f"{resp.text[:300]}") from exc
    if model_alias not in ids:
        raise errors.InputError(f"model_alias {model_alias!r} is not served by {url}: it lists {ids}")
    return ids


def read_props(base_url: str, api_key: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> ServerProps | None:
    """llama-server's ``/props`` at :func:`props_url`, or None when the endpoint does not answer it
    (another server: vLLM, a hosted API, llama-cpp-python) or not with the fields forgeflow reads."""
    try:
        resp = httpx.get(props_url(base_url), headers=_headers(api_key), timeout=timeout_s)
        return ServerProps.from_json(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, errors.InfraError):
        return None


def identity_check(props: ServerProps | None, model_path: Path, model_sha256: str, where: str) -> EndpointCheck:
    """The served model file (``/props`` ``model_path``) against the one the swap names.

    Returns:
        ``passed`` (same path, or a readable file with the same sha256), ``partial`` (same file name, file not
        readable here) or ``not_run`` (``props`` None).

    Raises:
        InputError: ``/props`` names another file.
    """
    if props is None or not props.model_path:
        return EndpointCheck(name="identity", status="not_run",
                             detail=f"{where} does not answer (or names no model_path): the endpoint does not say "
                             "which model file it serves")
    served = Path(props.model_path)
    if served.name != model_path.name:
        raise errors.InputError(f"{where} reports model_path {props.model_path!r}, not {model_path.name}: the "
                                "endpoint serves another model")
    if served.is_file():
        if served.resolve() == model_path.resolve() or sha256_file(served) == model_sha256:
            return EndpointCheck(name="identity", status="passed", detail=f"{where} serves {served} (sha256 "
                                 f"{model_sha256[:12]})")
        raise errors.InputError(f"{where} reports model_path {props.model_path!r}, a file whose sha256 differs from "
                                f"{model_path} ({model_sha256[:12]})")
    return EndpointCheck(name="identity", status="partial",
                         detail=f"{where} serves a file named {served.name} ({served}, not readable here: its content "
                         "was not compared)")


def slot_check(props: ServerProps | None, required_tokens: int | None, where: str) -> EndpointCheck:
    """The per-slot context ``/props`` reports against the context one request needs.

    Raises:
        ContextPreflightError: a slot holds fewer than ``required_tokens`` (both numbers named).
    """
    if props is None:
        return EndpointCheck(name="slot_context", status="not_run",
                             detail=f"{where} does not answer: the endpoint does not report its slots")
    seen = f"{props.per_slot_ctx} tokens a slot, {props.total_slots} slot(s)"
    if required_tokens is None:
        return EndpointCheck(name="slot_context", status="not_run",
                             detail=f"{where}: {seen}; no required_context_tokens to check it against")
    if props.per_slot_ctx < required_tokens:
        raise ContextPreflightError(f"{where} reports {seen} but a request needs {required_tokens} tokens")
    return EndpointCheck(name="slot_context", status="passed", detail=f"{where}: {seen} >= {required_tokens}")


def probe(base_url: str, model_alias: str, model_path: Path, model_sha256: str, *,
          required_context_tokens: int | None = None, api_key: str | None = None) -> tuple[EndpointCheck, ...]:
    """Every check an external endpoint can report, before anything is recorded (see the module docstring).

    Args:
        required_context_tokens: tokens one request needs (None: the slot check is not run).
        api_key: sent as ``Authorization: Bearer``; None: no header.

    Returns:
        The ``models``, ``identity``, ``slot_context`` and ``accelerator`` checks, in that order (a swap's
        ``checks``).

    Raises:
        PreflightError: the endpoint does not answer ``/models`` (the URL named).
        InputError: 401/403, a wrong alias, or ``/props`` naming another model file.
        ContextPreflightError: ``/props`` reports slots smaller than ``required_context_tokens``.
    """
    check_models(base_url, model_alias, api_key)
    props = read_props(base_url, api_key)
    where = props_url(base_url)
    return (
        EndpointCheck(name="models", status="passed", detail=f"{base_url}/models lists {model_alias!r}"),
        identity_check(props, Path(model_path), model_sha256, where),
        slot_check(props, required_context_tokens, where),
        EndpointCheck(name="accelerator", status="not_run",
                      detail="an external server's load log (GPU offload) is not readable by forgeflow"),
    )
