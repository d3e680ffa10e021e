#!/usr/bin/env bash
# GPU check (one H200, under 8 minutes): SFT burst vs naive loop, then GGUF serving with GPU offload.
#
#   benchmarks/gpu_check.sh --prepare [--with-gguf]
#       on this (CPU) machine: download the wheels the GPU machine lacks into build/gpu-check/wheels
#       (trl, datasets, dill, multiprocess, transformers, peft, and pydantic with pydantic-core,
#       annotated-types and typing-inspection for forgeflow's training modules, at this machine's
#       installed versions, for CPython 3.12 manylinux; ~18 MB); --with-gguf also copies the tiny Q8_0 GGUF for the
#       serving part (49 MB: together over the device tool's 64 MiB carry limit with the wheels).
#   benchmarks/gpu_check.sh
#       on the GPU machine, from the repository root, with build/gpu-check carried along.
#
# The GPU machine's own python3 (3.12, a CUDA torch >= 2.10, transformers, accelerate, pyarrow...;
# /work/.library/device/KINDS.md) runs both parts; the carried wheels are installed with --no-deps
# into /tmp/gpu-check-site, put first on PYTHONPATH, and `pip check` is printed to versions.txt.
# $PYTHON overrides the interpreter.
#
# 1. benchmarks.gpu_burst: Qwen2.5-0.5B-shaped model, LoRA r=16 all-linear, seq 2048, bf16: naive
#    transformers+peft loop (batch 8; batch 16 expected OOM) vs the flows' own burst trainer
#    (forgeflow.training.burst.sft_trainer: bfd packing, padding-free batches, the fused chunked log-prob
#    loss, gradient checkpointing as the flows decide it by memory, the device plan's attention) at 16 packed
#    rows, then the variants on:16, off:16, auto:32 and off:32 (checkpointing:rows; an OOM is reported, not
#    fatal). Last line: JSON with the ratios against the naive loop and the 52k tokens/s anchor (goal >= 1.5).
# 2. benchmarks.gpu_lineage: the flows' run_sft_burst itself (preflight, device plan, packing, gates,
#    lineage) on a small random Qwen2 with the carried tokenizer (build/gpu-check/tokenizer, which --prepare
#    copies from the tiny model, 11 MB): the lineage must say cuda / bfloat16 and the attention it used.
# 3. benchmarks.gpu_serve: llama-server with all layers offloaded vs llama-cpp-python directly,
#    decode tokens/s. Needs llama-cpp-python and a llama-server built with CUDA on that machine
#    ($FORGEFLOW_LLAMA_SERVER or the cached build) and the GGUF; skipped with the reason in serve.json
#    when one is missing (building them with CUDA does not fit the budget; GPU_CHECK_BUILD=1 tries).
#
# Results: $OUT (the device runner's output folder) or build/gpu-check/: burst.json, lineage.json, serve.json,
# logs.
# Budget: GPU_CHECK_BUDGET_S (default 470 s) for the three parts together; each runs under `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=build/gpu-check/wheels

if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$WHEELS"
  pins=$("$PY" -c 'from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("trl", "datasets", "dill", "multiprocess", "transformers", "peft",
                                              "pydantic", "pydantic-core", "annotated-types", "typing-inspection")))') \
    || exit 1
  # shellcheck disable=SC2086  # one argument per pin
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" $pins || { echo "pip download of $pins failed" >&2; exit 1; }
  echo "wheels for the GPU machine in $WHEELS: $pins ($(du -sh "$WHEELS" | cut -f1))"
  tok=$("$PY" -c 'from forgeflow.common.settings import cache_dir; print(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf")')
  if [[ -f "$tok/tokenizer.json" ]]; then
    mkdir -p build/gpu-check/tokenizer
    cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$tok/chat_template.jinja" build/gpu-check/tokenizer/
    echo "copied the tiny model's Qwen2 tokenizer -> build/gpu-check/tokenizer (11 MB)"
  else
    echo "no tiny model at $tok (run tests/integration/test_serving.py once): the lineage part will be skipped" >&2
  fi
  if [[ "${2:-}" == "--with-gguf" ]]; then
    src=$("$PY" -c 'from forgeflow.common.settings import cache_dir; print(cache_dir() / "test-fixtures" / "tiny-seed0" / "tiny-q8_0.gguf")')
    [[ -f "$src" ]] || { echo "no tiny GGUF at $src: run tests/integration/test_serving.py once to build it" >&2; exit 1; }
    cp "$src" build/gpu-check/tiny-q8_0.gguf
    echo "copied $src -> build/gpu-check/tiny-q8_0.gguf"
  fi
  echo "carry build/gpu-check to the GPU machine ($(du -sh build/gpu-check | cut -f1); the device tool carries 64 MiB in all)"
  exit 0
fi

out=${OUT:-build/gpu-check}
mkdir -p "$out" build/gpu-check
budget=${GPU_CHECK_BUDGET_S:-470}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
    "$WHEELS"/*.whl || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
{ echo "python: $("$PY" --version 2>&1)"; "$PY" -m pip check 2>&1 | head -20; } | tee "$out/versions.txt"
"$PY" - <<'EOF' 2>&1 | tee -a "$out/versions.txt"
import importlib
for name in ("torch", "transformers", "trl", "peft", "datasets", "pydantic", "triton", "flash_attn", "llama_cpp"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError as exc:
        print(name, "missing:", exc)
import torch
print("cuda available:", torch.cuda.is_available(), "cuda", torch.version.cuda)
EOF

status=0
echo "== burst vs naive ($(left) s left)"
# GPU_CHECK_BURST_ARGS: options for benchmarks.gpu_burst (default: the variants above)
# shellcheck disable=SC2086
timeout --kill-after=10 "$(( $(left) - 60 ))" "$PY" -m benchmarks.gpu_burst \
  ${GPU_CHECK_BURST_ARGS:---variants on:16,off:16,auto:32,off:32} 2>&1 | tee "$out/burst.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_burst failed with $rc (124: over budget)"; status=1; fi
tail -n 1 "$out/burst.log" > "$out/burst.json"

if [[ -f build/gpu-check/tokenizer/tokenizer.json ]] && (( $(left) > 90 )); then
  echo "== the flows' run_sft_burst on CUDA and its lineage ($(left) s left)"
  timeout --kill-after=10 60 "$PY" -m benchmarks.gpu_lineage --tokenizer-dir build/gpu-check/tokenizer --device cuda \
    2>&1 | tee "$out/lineage.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "gpu_lineage failed with $rc (124: over 60 s)"; status=1; fi
  tail -n 1 "$out/lineage.log" > "$out/lineage.json"
else
  echo "== lineage part skipped: no build/gpu-check/tokenizer (--prepare copies it) or under 90 s left"
fi

remaining=$(left)
if (( remaining < 45 )); then
  echo "== serving skipped: only ${remaining} s of the budget left"
else
  echo "== GGUF serving ($remaining s left)"
  build_flag=()
  [[ "${GPU_CHECK_BUILD:-0}" == "1" ]] && build_flag=(--build)
  timeout --kill-after=10 "$(( remaining - 5 ))" "$PY" -m benchmarks.gpu_serve "${build_flag[@]}" --log-dir "$out" \
    2>&1 | tee "$out/serve.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "gpu_serve failed with $rc (124: over budget)"; status=1; fi
  tail -n 1 "$out/serve.log" > "$out/serve.json"
fi
echo "== done in $(( $(date +%s) - start )) s; results in $out"
exit $status
