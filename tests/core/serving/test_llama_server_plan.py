"""llama-server backend: per-slot context as llama.cpp computes it, preflight refusals, /props and
accelerator checks (pure logic; the binary itself runs in tests/integration/test_llama_server.py)."""

from __future__ import annotations

import pytest

from forgeflow.common import settings
from forgeflow.common.errors import InfraError, InputError
from forgeflow.serving.llama_server import (
    AcceleratorFallbackError,
    ContextPreflightError,
    ServerProps,
    build_dir,
    check_accelerator,
    cmake_args,
    offloaded_layers,
    preflight_context,
    slot_context,
)


@pytest.mark.parametrize(
    ("n_ctx", "n_parallel", "unified", "pool", "per_slot"),
    [
        (16384, 4, False, 16384, 4096),  # pool split evenly
        (10000, 4, False, 10240, 2560),  # 10000 -> pad 10240; 10240/4 = 2560 (multiple of 256)
        (4000, 3, False, 4608, 1536),  # 4000 -> 4096; 4096/3 = 1365 -> pad 1536; pool 3*1536
        (8192, 4, True, 8192, 8192),  # unified: every slot may use the whole pool
        (8192, -1, False, 8192, 8192),  # auto: 4 slots, unified
        (100, 1, False, 256, 256),  # padded up to 256
    ],
)
def test_per_slot_context_matches_llama_cpp_arithmetic(n_ctx, n_parallel, unified, pool, per_slot) -> None:
    plan = slot_context(n_ctx, n_parallel, unified)
    assert (plan.n_ctx, plan.per_slot) == (pool, per_slot)
    assert plan.n_parallel == (4 if n_parallel == -1 else n_parallel)


def test_training_context_and_per_slot_cap_bound_a_slot() -> None:
    assert slot_context(32768, 1, n_ctx_train=4096).per_slot == 4096
    assert slot_context(32768, 2, True, kv_unified_per_slot=3000).per_slot == 3000


def test_preflight_refuses_a_request_that_does_not_fit_one_slot_and_names_the_numbers() -> None:
    with pytest.raises(ContextPreflightError, match=r"needs 6000 tokens .* each slot holds 4096 .*16384 tokens split over 4 slots"):
        preflight_context(6000, 16384, 4)
    assert preflight_context(6000, 16384, 4, kv_unified=True).per_slot == 16384
    with pytest.raises(ContextPreflightError, match="trained for 2048 .* no server setting fixes that"):
        preflight_context(3000, 8192, 1, n_ctx_train=2048)
    with pytest.raises(ContextPreflightError, match=r"holds 4096 \(a unified KV cache of 4096 tokens\); raise -c to at least 5000$"):
        preflight_context(5000, 4096, -1)  # auto: already unified, so only -c helps


@pytest.mark.parametrize("bad", [dict(n_ctx=1, n_parallel=300), dict(n_ctx=4096, n_parallel=2.5),
                                 dict(n_ctx=float("inf")), dict(n_ctx="4096"), dict(n_ctx=True)])
def test_odd_values_are_input_errors_naming_the_field(bad) -> None:
    with pytest.raises(InputError, match="n_ctx|n_parallel"):
        slot_context(**bad)
    with pytest.raises(InputError, match="required_tokens"):
        preflight_context(None, 4096)


@pytest.mark.parametrize("bad", [dict(n_ctx=0), dict(n_ctx=4096, n_parallel=0), dict(n_ctx=4096, n_parallel=-2)])
def test_bad_plans_are_named(bad) -> None:
    with pytest.raises(InputError, match="n_ctx|n_parallel"):
        slot_context(**bad)


LOG_GPU = "load_tensors: offloading 24 repeating layers to GPU\nload_tensors: offloaded 25/25 layers to GPU\n"
LOG_CPU = "load_tensors: offloaded 0/25 layers to GPU\n"


def test_accelerator_check_reads_the_load_log() -> None:
    assert offloaded_layers(LOG_GPU) == (25, 25)
    assert check_accelerator(LOG_GPU, n_gpu_layers=99) == (25, 25)
    assert check_accelerator(LOG_CPU, n_gpu_layers=0) is None  # nothing requested
    with pytest.raises(AcceleratorFallbackError, match="0/25 layers offloaded"):
        check_accelerator(LOG_CPU, n_gpu_layers=99)
    with pytest.raises(AcceleratorFallbackError, match="no 'offloaded"):
        check_accelerator("llama_model_loader: loaded meta data\n", n_gpu_layers=99)


def test_props_parsing_takes_the_per_slot_context_and_refuses_a_foreign_answer() -> None:
    props = ServerProps.from_json({"default_generation_settings": {"n_ctx": 2048}, "total_slots": 2,
                                   "model_path": "/m.gguf", "chat_template": "{{ x }}"})
    assert (props.per_slot_ctx, props.total_slots, props.has_chat_template) == (2048, 2, True)
    with pytest.raises(InfraError, match="default_generation_settings"):
        ServerProps.from_json({"total_slots": 1})


def test_both_llama_cpp_builds_are_portable_and_a_build_with_other_options_is_not_reused(monkeypatch) -> None:
    """Regression: a ``-march=native`` build on a Xeon guest without AMX tile state compiled ggml's AMX
    kernels and crashed at the first matrix multiplication (general protection fault at ``ldtilecfg``);
    the cached builds had been made with those options and were reused."""
    from forgeflow.common import llama_cpp_build

    assert "-DGGML_NATIVE=OFF" in settings.LLAMA_CPP_CMAKE_ARGS
    assert set(settings.LLAMA_CPP_CMAKE_ARGS) <= set(cmake_args()) and "-DGGML_CUDA=ON" in cmake_args(gpu=True)
    cpu, gpu = build_dir(), build_dir(gpu=True)
    # the CPU binary is the shared llama.cpp build's (one compile for llama-cpp-python and llama-server)
    assert cpu == llama_cpp_build.server_dir()
    assert cpu.name == f"llama-server-{settings.LLAMA_CPP_PYTHON_VERSION}-{llama_cpp_build.build_tag()}"
    assert gpu.name == (f"llama-server-{settings.LLAMA_CPP_PYTHON_VERSION}-cuda-"
                        f"{settings.llama_cpp_build_tag(tuple(cmake_args(gpu=True)))}") and gpu != cpu
    monkeypatch.setattr(settings, "LLAMA_CPP_CMAKE_ARGS", ("-DGGML_NATIVE=ON",))
    assert build_dir() != cpu and build_dir(gpu=True) != gpu  # other options: another folder, built anew
    assert settings.llama_cpp_build_tag() != settings.llama_cpp_build_tag(("-DGGML_CUDA=ON",))
