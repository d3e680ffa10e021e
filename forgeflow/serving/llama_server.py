"""llama.cpp's own ``llama-server`` as a serving backend: cached build, context preflight, ``/props``
(the server process itself is :class:`forgeflow.serving.backend.LlamaServer`, configured by its ``BackendConfig``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors, llama_cpp_build, settings
from forgeflow.packaging.sdist import download_sdist

KV_PAD = 256
"""llama.cpp pads the context (and each sequence's share of it) to a multiple of 256 tokens."""
AUTO_PARALLEL_SLOTS = 4
"""``-np -1`` (auto, the server's default) means 4 slots sharing a unified KV cache."""
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
"""``--cache-type-k`` / ``--cache-type-v`` values the pinned llama.cpp accepts (``common/arg.cpp``
``kv_cache_types``); f16 is its default. A quantized V cache needs flash attention in llama.cpp: a
server that refuses it fails its start."""
FLASH_ATTN_MODES = ("on", "off", "auto")
"""``--flash-attn`` values (``common/arg.cpp``); ``auto`` is the server's default."""
BINARY_ENV = "FORGEFLOW_LLAMA_SERVER"
"""Environment variable naming a ``llama-server`` binary to use instead of the cached build."""
_BUILD_TIMEOUT_S = 3600
_OFFLOAD_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_LOG_TAIL_CHARS = 4000


class ContextPreflightError(errors.InputError):
    """The context a request needs does not fit one server slot (the message gives the numbers)."""


class AcceleratorFallbackError(errors.ServerStartError):
    """GPU layers were requested but the server runs on the CPU (the load log is quoted)."""


def _pad(n: int, multiple: int = KV_PAD) -> int:
    return -(-n // multiple) * multiple


class ContextPlan(BaseModel):
    """How a server's KV pool is split over its slots."""

    model_config = ConfigDict(frozen=True)

    n_ctx: int = Field(ge=KV_PAD, description="the whole KV pool in tokens, after llama.cpp's padding to 256.")
    n_parallel: int = Field(ge=1, description="number of slots (-np; auto resolved to 4).")
    kv_unified: bool = Field(description="one cache shared by all slots (each slot may use all of it).")
    per_slot: int = Field(ge=1, description="the context one request can use, in tokens.")


def slot_context(n_ctx: int, n_parallel: int = 1, kv_unified: bool = False, *,
                 n_ctx_train: int | None = None, kv_unified_per_slot: int = 0) -> ContextPlan:
    """The per-slot context of ``llama-server -c n_ctx -np n_parallel [--kv-unified]``, as the pinned llama.cpp
    (vendored by llama-cpp-python 0.3.36) computes it: ``src/llama-context.cpp`` pads ``n_ctx`` to 256 and,
    without a unified cache, ``n_ctx_seq = pad(n_ctx / n_seq_max, 256)``; ``tools/server/server-context.cpp``
    ``n_ctx_slot()`` caps it by ``--kv-unified-per-slot`` and the training context; ``tools/server/server.cpp``:
    ``-np`` -1 means 4 slots with a unified cache.

    Raises:
        InputError: a value is out of range (named).
    """
    for name, value in (("n_ctx", n_ctx), ("n_parallel", n_parallel), ("kv_unified_per_slot", kv_unified_per_slot),
                        ("n_ctx_train", n_ctx_train)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise errors.InputError(f"{name} must be a whole number of tokens/slots, got {value!r}")
    if n_ctx <= 0:
        raise errors.InputError(f"n_ctx must be > 0 tokens, got {n_ctx}")
    if n_parallel == -1:
        n_parallel, kv_unified = AUTO_PARALLEL_SLOTS, True
    if n_parallel < 1:
        raise errors.InputError(f"n_parallel must be >= 1 or -1 (auto), got {n_parallel}")
    if n_ctx_train is not None and n_ctx_train < 1:
        raise errors.InputError(f"n_ctx_train must be >= 1, got {n_ctx_train}")
    if kv_unified_per_slot < 0:
        raise errors.InputError(f"kv_unified_per_slot must be >= 0, got {kv_unified_per_slot}")
    pool = _pad(n_ctx)
    if not kv_unified and pool // n_parallel == 0:
        raise errors.InputError(
            f"n_ctx {n_ctx} (padded to {pool}) split over {n_parallel} slots leaves 0 tokens per slot")
    if kv_unified:
        seq = pool
    else:
        seq = _pad(pool // n_parallel)
        pool = seq * n_parallel
    per_slot = seq
    if kv_unified_per_slot > 0:
        per_slot = min(per_slot, kv_unified_per_slot)
    if n_ctx_train is not None:
        per_slot = min(per_slot, n_ctx_train)
    return ContextPlan(n_ctx=pool, n_parallel=n_parallel, kv_unified=kv_unified, per_slot=per_slot)


def preflight_context(required_tokens: int, n_ctx: int, n_parallel: int = 1, kv_unified: bool = False,
                      *, n_ctx_train: int | None = None) -> ContextPlan:
    """Refuse a server plan whose slots cannot hold ``required_tokens``; the :class:`ContextPlan` when it fits.

    Raises:
        ContextPreflightError: the per-slot context is smaller than ``required_tokens`` (both numbers named).
        InputError: as :func:`slot_context`, or ``required_tokens`` < 1.
    """
    if isinstance(required_tokens, bool) or not isinstance(required_tokens, int) or required_tokens < 1:
        raise errors.InputError(f"required_tokens must be a whole number >= 1, got {required_tokens!r}")
    plan = slot_context(n_ctx, n_parallel, kv_unified, n_ctx_train=n_ctx_train)
    if plan.per_slot < required_tokens:
        if n_ctx_train is not None and n_ctx_train < required_tokens:
            raise ContextPreflightError(
                f"a request needs {required_tokens} tokens of context but the model was trained for "
                f"{n_ctx_train} (its context_length caps every slot); no server setting fixes that")
        slots = f"{plan.n_parallel} slot{'s' if plan.n_parallel != 1 else ''}"
        how = (f"a unified KV cache of {plan.n_ctx} tokens" if plan.kv_unified
               else f"a pool of {plan.n_ctx} tokens split over {slots}")
        fixes = [f"raise -c to at least {required_tokens * (1 if plan.kv_unified else plan.n_parallel)}"]
        if not plan.kv_unified and plan.n_parallel > 1:
            fixes += ["lower -np", "use --kv-unified"]
        raise ContextPreflightError(
            f"a request needs {required_tokens} tokens of context but each slot holds {plan.per_slot} "
            f"({how}); {', or '.join(fixes)}"
        )
    return plan


def offloaded_layers(log_text: str) -> tuple[int, int] | None:
    """``(offloaded, total)`` from the load log's ``offloaded X/Y layers to GPU`` line, or None."""
    found = _OFFLOAD_RE.findall(log_text)
    if not found:
        return None
    done, total = found[-1]
    return int(done), int(total)


def check_accelerator(log_text: str, n_gpu_layers: int) -> tuple[int, int] | None:
    """Raise when ``n_gpu_layers`` > 0 were requested and none were offloaded; ``(offloaded, total)`` or None.

    The load log's ``offloaded X/Y layers to GPU`` line comes from llama.cpp's ``src/llama-model.cpp``.

    Raises:
        AcceleratorFallbackError: the log reports 0 layers offloaded, or no offload line (a CPU-only build).
    """
    if n_gpu_layers == 0:
        return None
    offload = offloaded_layers(log_text)
    if offload is None or offload[0] == 0:
        seen = f"the log reports {offload[0]}/{offload[1]} layers offloaded" if offload else \
            "the log has no 'offloaded X/Y layers to GPU' line (a CPU-only build?)"
        raise AcceleratorFallbackError(
            f"{n_gpu_layers} GPU layers were requested but {seen}: the server would silently run on the CPU"
        )
    return offload


# --- the binary -------------------------------------------------------------------------------
def build_dir(gpu: bool = False) -> Path:
    """Where :func:`ensure_llama_server` keeps its build (``bin/llama-server`` inside): the shared llama.cpp
    build's folder for the CPU, ``llama-server-<version>-cuda-<tag>`` for ``gpu``; the tag names the options."""
    if not gpu:
        return llama_cpp_build.server_dir()
    tag = settings.llama_cpp_build_tag(tuple(cmake_args(gpu)))
    return settings.cache_dir() / f"llama-server-{settings.LLAMA_CPP_PYTHON_VERSION}-cuda-{tag}"


def cmake_args(gpu: bool = False) -> list[str]:
    """CMake options of the standalone (``gpu=True``) build: static, server-only, offline; ``GGML_CUDA`` on."""
    args = [
        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_APP=OFF", *settings.LLAMA_CPP_CMAKE_ARGS,
    ]
    if gpu:
        args.append("-DGGML_CUDA=ON")
    return args


def ensure_llama_server(gpu: bool = False, jobs: int | None = None) -> Path:
    """The ``llama-server`` binary: ``$FORGEFLOW_LLAMA_SERVER``, else the cached build (built once).

    Raises:
        ToolMissingError: ``cmake`` or a C++ compiler is missing, or ``$FORGEFLOW_LLAMA_SERVER`` is not executable.
        TransientInfraError: the pinned sdist could not be downloaded.
        InfraError: the build failed (the message carries the tail of the build log).
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise errors.ToolMissingError(f"{BINARY_ENV}={override!r} is not an executable file")
        return path
    if not gpu:
        return llama_cpp_build.build(jobs).server
    return _ensure_standalone(gpu, jobs)


def _ensure_standalone(gpu: bool, jobs: int | None) -> Path:
    """The standalone static build of :func:`cmake_args` into :func:`build_dir` (built once)."""
    final = build_dir(gpu)
    binary = final / "bin" / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise errors.ToolMissingError(
                f"building llama-server needs {tool!r} on PATH (Debian: cmake build-essential)")
    tarball = download_sdist(settings.LLAMA_CPP_PYTHON_VERSION)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    log_path = final.parent / f"{final.name}.build.log"
    try:
        prefix = f"llama_cpp_python-{settings.LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(work / "src", members=members, filter="data")
        src = work / "src" / prefix
        build = work / "build"
        with open(log_path, "wb") as log:
            for argv in (["cmake", "-S", str(src), "-B", str(build), *cmake_args(gpu)],
                         ["cmake", "--build", str(build), "--target", "llama-server",
                          "-j", str(jobs or os.cpu_count() or 1)]):
                proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=_BUILD_TIMEOUT_S,
                                      check=False)
                if proc.returncode != 0:
                    raise errors.InfraError(
                        f"{' '.join(argv[:3])} failed with {proc.returncode}; log {log_path}:\n"
                        f"{log_path.read_text(errors='replace')[-_LOG_TAIL_CHARS:]}"
                    )
        out = work / "out" / "bin"
        out.mkdir(parents=True)
        shutil.copy2(build / "bin" / "llama-server", out / "llama-server")
        try:
            os.rename(work / "out", final)  # atomic: the final name appears complete or not at all
        except OSError:
            if not binary.is_file():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return binary


# --- the server -------------------------------------------------------------------------------
class ServerProps(BaseModel):
    """What ``GET /props`` reports (the fields forgeflow checks)."""

    model_config = ConfigDict(frozen=True)

    per_slot_ctx: int = Field(ge=1,
                              description="default_generation_settings.n_ctx: the context of one slot, in tokens.")
    total_slots: int = Field(ge=1, description="total_slots.")
    model_path: str = Field(description="the GGUF it loaded.")
    has_chat_template: bool = Field(description="chat_template is non-empty.")
    vision: bool | None = Field(None,
                                description="modalities.vision (a projector is loaded); None when the server does "
                                            "not report it.")

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "ServerProps":
        """Parse a ``/props`` body.

        Raises:
            InfraError: a field is missing or malformed (the server is not the llama-server we expect).
        """
        try:
            return cls(per_slot_ctx=int(body["default_generation_settings"]["n_ctx"]),
                       total_slots=int(body["total_slots"]), model_path=str(body.get("model_path", "")),
                       has_chat_template=bool(body.get("chat_template")),
                       vision=body["modalities"].get("vision") if isinstance(body.get("modalities"), dict) else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InfraError(f"/props answer lacks {exc}: {str(body)[:300]}") from exc


