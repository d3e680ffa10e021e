"""The serving backend a swap starts: which server, on which ports, with which context and slots.

``kind`` is ``llama-cpp-python`` (the default, 4,096-token context on ports 8801/8802), ``llama-server``
(llama.cpp's server: slots, KV pool and cache type, GPU offload) or ``external``: an OpenAI-compatible
endpoint forgeflow does not start, whose ``base_url`` includes the version path
(``http://10.0.0.5:8000/v1``; forgeflow appends ``/models`` and ``/chat/completions``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from forgeflow.common import errors
from forgeflow.serving.llama_server import (
    FLASH_ATTN_MODES,
    KV_CACHE_TYPES,
    ContextPlan,
    ContextPreflightError,
    ServerProps,
    check_accelerator,
    ensure_llama_server,
    preflight_context,
    slot_context,
)
from forgeflow.serving.server import DEFAULT_ALIAS, LOOPBACK_HOST, ModelServer, check_bind_host, client_host

DEFAULT_PORTS: tuple[int, int] = (8801, 8802)
_MULTIMODAL = ("cache_type_k", "cache_type_v", "flash_attn", "mmproj", "image_min_tokens")
_LLAMA_SERVER_ONLY = ("n_parallel", "kv_unified", "n_gpu_layers", "cache_type", "binary", *_MULTIMODAL)
_STARTED_ONLY = ("ports", "host", "n_ctx", "n_parallel", "kv_unified", "cache_type", "n_gpu_layers", "n_threads",
                 "startup_timeout_s", "binary", *_MULTIMODAL)
"""Fields that only make sense for a server forgeflow starts: refused (named) with ``kind="external"``."""
_EXTERNAL_ONLY = ("base_url", "api_key_secret")
BACKEND_KINDS = ("llama-cpp-python", "llama-server", "external")


def check_base_url(url: str) -> str:
    """``url`` without a trailing ``/`` if it is an ``http``/``https`` URL with a host and no query, fragment or
    credentials.

    Raises:
        ValueError: anything else (the reason named).
    """
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"base_url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url {url!r} must be an http:// or https:// URL with a host "
                         "(the API root, e.g. http://10.0.0.5:8000/v1)")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"base_url {url!r} must carry no query, fragment or credentials (the key goes in a "
                         "Secret block named by api_key_secret)")
    return url.rstrip("/")


class BackendConfig(BaseModel):
    """How a GGUF is served.

    Raises:
        pydantic.ValidationError: a field out of range, two equal ports, a llama-server option
            (named) set with ``kind="llama-cpp-python"``, which cannot honour it, a started server's
            option (named) set with ``kind="external"``, ``external`` without a valid ``base_url``, or
            ``base_url``/``api_key_secret`` with another kind.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["llama-cpp-python", "llama-server", "external"] = Field(
        "llama-cpp-python",
        description="llama-cpp-python (python -m llama_cpp.server, the embedded default), llama-server (llama.cpp's "
                    "binary, LlamaServer) or external (an OpenAI-compatible endpoint "
                    "forgeflow does not start; only base_url, api_key_secret, model_alias and "
                    "required_context_tokens apply).")
    ports: tuple[int, int] = Field(DEFAULT_PORTS, description="the two blue/green TCP ports (distinct, 1024-65535).")
    host: str = Field(LOOPBACK_HOST,
                      description="the IPv4 address both servers bind: 127.0.0.1 (this machine only, the default), "
                                  "an interface's address, or 0.0.0.0 (every interface: pods, Ray nodes or canaries "
                                  "on other machines reach it at this machine's address; the recorded endpoint "
                                  "stays 127.0.0.1).")
    model_alias: str = Field(DEFAULT_ALIAS, pattern=r"^\S+$",
                             description="the model name clients send (one word); external: the name the endpoint's "
                                         "/models must list.")
    n_ctx: int = Field(4096, ge=16, description="the context (llama-server: the whole KV pool -c), tokens (>= 16).")
    n_parallel: int = Field(1, ge=-1, description="llama-server slots -np (-1: auto, 4 slots on a unified cache).")
    kv_unified: bool = Field(False, description="llama-server --kv-unified (every slot may use the whole pool).")
    cache_type: str | None = Field(None,
                                   description="llama-server KV cache type (--cache-type-k and -v), one of "
                                               "forgeflow.serving.llama_server.KV_CACHE_TYPES")
    cache_type_k: str | None = Field(None, description="llama-server -ctk alone (over cache_type).")
    cache_type_v: str | None = Field(None, description="llama-server -ctv alone (over cache_type).")
    flash_attn: str | None = Field(None, description="llama-server -fa (on, off, auto); None: the server's default.")
    mmproj: Path | None = Field(None,
                                description="llama-server --mmproj: the vision projector GGUF served with the model")
    image_min_tokens: int | None = Field(None, ge=1, description="llama-server --image-min-tokens")
    n_gpu_layers: int = Field(0, ge=0,
                              description="llama-server -ngl; > 0 makes a server that offloads nothing a failed "
                                          "start.")
    required_context_tokens: int | None = Field(
        None, ge=1,
        description="the context one request needs (prompt + completion), tokens")
    n_threads: int | None = Field(None, ge=1, description="CPU threads for generation (None: llama.cpp's default).")
    startup_timeout_s: float = Field(120.0, gt=0, description="seconds a start may take before it is a failed start.")
    binary: Path | None = Field(None, description="a llama-server executable to use instead of the cached build.")
    base_url: str | None = Field(None,
                                 description="external only (and required there): the endpoint's API root with its "
                                             "version path, http(s)://host[:port]/v1")
    api_key_secret: str | None = Field(None, min_length=1,
                                       description="external only: the name of a Prefect Secret block holding the "
                                                   "key sent as Authorization: Bearer (never the key itself)")

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        return None if value is None else check_base_url(value)

    @model_validator(mode="after")
    def _check(self) -> "BackendConfig":
        self._check_external()
        for port in self.ports:
            if not 1024 <= port <= 65535:
                raise ValueError(f"ports: {port} is outside 1024..65535")
        if self.ports[0] == self.ports[1]:
            raise ValueError(f"ports must be two distinct ports, got {list(self.ports)}")
        try:
            check_bind_host(self.host)
        except errors.InputError as exc:
            raise ValueError(str(exc)) from None
        if self.n_parallel == 0:
            raise ValueError("n_parallel must be >= 1 or -1 (auto), got 0")
        for name in ("cache_type", "cache_type_k", "cache_type_v"):
            if getattr(self, name) is not None and getattr(self, name) not in KV_CACHE_TYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_CACHE_TYPES)}, got {getattr(self, name)!r}")
        if self.flash_attn is not None and self.flash_attn not in FLASH_ATTN_MODES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}, got {self.flash_attn!r}")
        if self.kind == "llama-cpp-python":
            defaults = BackendConfig.model_fields
            changed = [name for name in _LLAMA_SERVER_ONLY if getattr(self, name) != defaults[name].default]
            if changed:
                raise ValueError(f"{', '.join(changed)} need kind 'llama-server' (llama-cpp-python's server "
                                 "has one slot, no KV cache type and no offload check here)")
        return self

    def _check_external(self) -> None:
        """``external`` needs a valid ``base_url`` and none of a started server's options; other kinds
        take neither ``base_url`` nor ``api_key_secret`` (raises ValueError naming the fields)."""
        defaults = BackendConfig.model_fields
        if self.kind != "external":
            given = [name for name in _EXTERNAL_ONLY if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need kind 'external' (kind {self.kind!r} starts its own "
                                 "server on ports)")
            return
        changed = [name for name in _STARTED_ONLY if getattr(self, name) != defaults[name].default]
        if changed:
            raise ValueError(f"{', '.join(changed)} cannot be set with kind 'external': forgeflow does not start "
                             "that server (set them where it runs); give base_url, model_alias, api_key_secret, "
                             "required_context_tokens")
        if not self.base_url:
            raise ValueError("kind 'external' needs base_url (the endpoint's API root, e.g. http://10.0.0.5:8000/v1)")

    @property
    def external_port(self) -> int:
        """The TCP port of ``base_url`` (explicit, else 80 for http and 443 for https); ``external`` only."""
        parts = urlsplit(self.base_url or "")
        return parts.port or (443 if parts.scheme == "https" else 80)

    def server(self, gguf_path: Path, port: int, log_path: Path) -> ModelServer:
        """The (not yet started) server of this configuration for ``gguf_path`` on ``port``.

        Raises:
            InputError: the GGUF is missing or a value is out of range (named), or the kind is
                ``external`` (forgeflow starts no server for it); ContextPreflightError: a slot cannot
                hold ``required_context_tokens``.
        """
        if self.kind == "external":
            raise errors.InputError(f"kind 'external' ({self.base_url}) is not started by forgeflow; it has no server")
        if self.kind == "llama-server":
            return LlamaServer(gguf_path, port, self, log_path=log_path)
        return ModelServer(gguf_path, port, self.model_alias, n_ctx=self.n_ctx, log_path=log_path,
                           startup_timeout_s=self.startup_timeout_s, n_threads=self.n_threads, host=self.host)

    def preflight(self, n_ctx_train: int | None = None) -> ContextPlan | None:
        """The slot plan, refused before anything starts when a slot cannot hold ``required_context_tokens``.

        Args:
            n_ctx_train: the GGUF's training context, which caps every slot; None when unknown.

        Returns:
            The :class:`~forgeflow.serving.llama_server.ContextPlan`; None for ``external`` (read from ``/props``).

        Raises:
            ContextPreflightError: a slot holds fewer than ``required_context_tokens`` (numbers and fixes named).
        """
        if self.kind == "external":
            if self.required_context_tokens is not None and n_ctx_train and n_ctx_train < self.required_context_tokens:
                raise ContextPreflightError(
                    f"a request needs {self.required_context_tokens} tokens of context but the model was trained "
                    f"for {n_ctx_train} (its context_length caps every slot of {self.base_url})")
            return None
        if self.kind == "llama-server":
            if self.required_context_tokens is not None:
                return preflight_context(self.required_context_tokens, self.n_ctx, self.n_parallel, self.kv_unified,
                                         n_ctx_train=n_ctx_train)
            return slot_context(self.n_ctx, self.n_parallel, self.kv_unified, n_ctx_train=n_ctx_train)
        per_slot = min(self.n_ctx, n_ctx_train) if n_ctx_train else self.n_ctx
        if self.required_context_tokens is not None and per_slot < self.required_context_tokens:
            cap = f" (the model was trained for {n_ctx_train})" if n_ctx_train and n_ctx_train < self.n_ctx else ""
            raise ContextPreflightError(
                f"a request needs {self.required_context_tokens} tokens of context but the llama-cpp-python "
                f"server's one slot holds {per_slot}{cap}; raise n_ctx")
        return ContextPlan(n_ctx=max(self.n_ctx, 256), n_parallel=1, kv_unified=False, per_slot=per_slot)

    def describe(self) -> str:
        """One line for logs: kind, ports, context and slots (``external``: the URL and alias)."""
        if self.kind == "external":
            key = f", key from Secret block {self.api_key_secret!r}" if self.api_key_secret else ""
            return f"external endpoint {self.base_url} serving {self.model_alias!r}{key}"
        where = f"{self.host} ports {list(self.ports)}"
        if self.kind == "llama-cpp-python":
            return f"llama-cpp-python on {where}, n_ctx {self.n_ctx}"
        cache = f", KV {self.cache_type}" if self.cache_type else ""
        flags = (("-ctk", self.cache_type_k), ("-ctv", self.cache_type_v), ("-fa", self.flash_attn),
                 ("--mmproj", self.mmproj), ("--image-min-tokens", self.image_min_tokens))
        cache += "".join(f", {flag} {value}" for flag, value in flags if value is not None)
        return (f"llama-server on {where}, -c {self.n_ctx} -np {self.n_parallel}"
                f"{' --kv-unified' if self.kv_unified else ''}{cache}, -ngl {self.n_gpu_layers}")


class LlamaServer(ModelServer):
    """One ``llama-server`` process serving one GGUF: a :class:`forgeflow.serving.server.ModelServer` whose
    readiness is ``GET /health`` and which, once up, checks ``/props`` and the accelerator.

    Raises:
        InputError: bad arguments (named), or a projector that is not this model's.
        ContextPreflightError: ``required_context_tokens`` cannot fit a slot.
    """

    def __init__(self, gguf_path: Path, port: int, config: BackendConfig, *, log_path: Path | None = None) -> None:
        """Args: ``config`` gives the alias, context, host, threads, start timeout and llama-server's options
        (slots, KV cache, offload, projector, binary); its ``kind`` and ``ports`` are not read (``port`` is the one
        served on)."""
        super().__init__(gguf_path, port, config.model_alias, n_ctx=config.n_ctx, log_path=log_path,
                         startup_timeout_s=config.startup_timeout_s, n_threads=config.n_threads, host=config.host)
        if config.image_min_tokens is not None and config.mmproj is None:
            raise errors.InputError("image_min_tokens needs mmproj (a text-only server takes no images)")
        if config.mmproj is not None:  # refused before the start: a projector that is not this model's
            from forgeflow.serving.multimodal import check_projector

            check_projector(Path(gguf_path), Path(config.mmproj))
        self.mmproj, self.image_min_tokens, self.flash_attn = config.mmproj, config.image_min_tokens, config.flash_attn
        self.cache_type_k = config.cache_type_k or config.cache_type
        self.cache_type_v = config.cache_type_v or config.cache_type
        slots = (config.n_ctx, config.n_parallel, config.kv_unified)
        self.plan = (preflight_context(config.required_context_tokens, *slots) if config.required_context_tokens
                     else slot_context(*slots))
        self.n_parallel, self.kv_unified = config.n_parallel, config.kv_unified
        self.required_context_tokens = config.required_context_tokens
        self.n_gpu_layers, self.cache_type = config.n_gpu_layers, config.cache_type
        self.binary = Path(config.binary) if config.binary else None
        self.props: ServerProps | None = None
        self.offload: tuple[int, int] | None = None

    def argv(self) -> list[str]:
        """The server's command line."""
        argv = [str(self.binary or ensure_llama_server(gpu=self.n_gpu_layers > 0)),
                "--model", str(self.gguf_path), "--host", self.host, "--port", str(self.port),
                "--alias", self.model_alias, "--ctx-size", str(self.n_ctx),
                "--parallel", str(self.n_parallel), "--n-gpu-layers", str(self.n_gpu_layers)]
        if self.kv_unified:
            argv.append("--kv-unified")
        if self.cache_type_k is not None:
            argv += ["--cache-type-k", self.cache_type_k]
        if self.cache_type_v is not None:
            argv += ["--cache-type-v", self.cache_type_v]
        if self.flash_attn is not None:
            argv += ["--flash-attn", self.flash_attn]
        if self.mmproj is not None:
            argv += ["--mmproj", str(self.mmproj)]
        if self.image_min_tokens is not None:
            argv += ["--image-min-tokens", str(self.image_min_tokens)]
        if self.n_threads is not None:
            argv += ["--threads", str(self.n_threads)]
        return argv

    @property
    def ready_url(self) -> str:
        """``GET /health`` (200 once the model is loaded)."""
        return f"http://{client_host(self.host)}:{self.port}/health"

    def _after_ready(self) -> None:
        """Read ``/props``; refuse another served file, a per-slot context below ``required_context_tokens``, a CPU
        fallback.

        Raises:
            ServerStartError: ``/props`` did not answer 200 or names another ``model_path``.
            InfraError: ``/props`` lacks a field.
        """
        root = f"http://{client_host(self.host)}:{self.port}"
        resp = httpx.get(f"{root}/props", timeout=10.0)
        if resp.status_code != 200:
            raise errors.ServerStartError(f"{root}/props answered {resp.status_code}: {resp.text[:300]}")
        self.props = ServerProps.from_json(resp.json())
        if self.props.model_path and Path(self.props.model_path).resolve() != self.gguf_path:
            raise errors.ServerStartError(
                f"{root}/props reports model_path {self.props.model_path!r}, not {self.gguf_path}: another "
                "server answers on this port")
        if self.required_context_tokens is not None and self.props.per_slot_ctx < self.required_context_tokens:
            raise ContextPreflightError(
                f"{root}/props reports {self.props.per_slot_ctx} tokens per slot "
                f"({self.props.total_slots} slots) but a request needs {self.required_context_tokens}")
        self.offload = check_accelerator(self.log_path.read_text(errors="replace"), self.n_gpu_layers)


def backend_config(value: BackendConfig | dict[str, Any] | None, name: str = "backend") -> BackendConfig:
    """``value`` as a :class:`BackendConfig` (None: the embedded default).

    Raises:
        InputError: ``value`` is not a valid backend configuration (the message names ``name`` and
            pydantic's reason).
    """
    if value is None:
        return BackendConfig()
    if isinstance(value, BackendConfig):
        return value
    try:
        return BackendConfig.model_validate(value)
    except ValidationError as exc:
        raise errors.InputError(f"{name} is not a valid serving backend: {errors.validation_problems(exc)}") from exc
