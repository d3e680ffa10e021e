#!/usr/bin/env bash
# GPU check (one H200, under 8 minutes): SFT burst vs naive loop, then GGUF serving with GPU offload.
#
#   benchmarks/gpu_check.sh --prepare   # on a machine with the forgeflow cache: copy the tiny Q8_0 GGUF
#                                       # into build/gpu-check/ (49 MB) so it can travel to the GPU machine
#   benchmarks/gpu_check.sh             # on the GPU machine, from the repository root
#
# 1. python -m benchmarks.gpu_burst: Qwen2.5-0.5B-shaped model, LoRA r=16 all-linear, seq 2048, bf16:
#    naive transformers+peft loop (batch 8; batch 16 expected OOM) vs TRL SFTTrainer with bfd packing,
#    padding-free batches and the fused chunked log-prob loss. Last line: JSON with the ratio (goal >= 1.5).
# 2. python -m benchmarks.gpu_serve: llama-server with all layers offloaded vs llama-cpp-python
#    directly, decode tokens/s. Optional: skipped (with the reason) when no llama-server binary is
#    there ($FORGEFLOW_LLAMA_SERVER or the cached CUDA build); building one with CUDA does not fit the
#    budget (GPU_CHECK_BUILD=1 tries anyway).
#
# Results: $OUT (the device runner's output folder) or build/gpu-check/: burst.json, serve.json, logs.
# Budget: GPU_CHECK_BUDGET_S (default 470 s) for both parts together; each runs under `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
  src=$(python -c 'from forgeflow.settings import cache_dir; print(cache_dir() / "test-fixtures" / "tiny-seed0" / "tiny-q8_0.gguf")')
  [[ -f "$src" ]] || { echo "no tiny GGUF at $src: run tests/integration/test_serving.py once to build it" >&2; exit 1; }
  mkdir -p build/gpu-check && cp "$src" build/gpu-check/tiny-q8_0.gguf
  echo "copied $src -> build/gpu-check/tiny-q8_0.gguf (carry build/gpu-check to the GPU machine)"
  exit 0
fi

out=${OUT:-build/gpu-check}
mkdir -p "$out" build/gpu-check
budget=${GPU_CHECK_BUDGET_S:-470}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
python - <<'EOF' 2>&1 | tee "$out/versions.txt"
import importlib
for name in ("torch", "transformers", "trl", "peft", "datasets", "triton", "flash_attn", "llama_cpp"):
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
timeout --kill-after=10 "$(( $(left) - 60 ))" python -m benchmarks.gpu_burst 2>&1 | tee "$out/burst.log"
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then echo "gpu_burst failed with $rc (124: over budget)"; status=1; fi
tail -n 1 "$out/burst.log" > "$out/burst.json"

remaining=$(left)
if (( remaining < 45 )); then
  echo "== serving skipped: only ${remaining} s of the budget left"
else
  echo "== GGUF serving ($remaining s left)"
  build_flag=()
  [[ "${GPU_CHECK_BUILD:-0}" == "1" ]] && build_flag=(--build)
  timeout --kill-after=10 "$(( remaining - 5 ))" python -m benchmarks.gpu_serve "${build_flag[@]}" --log-dir "$out" \
    2>&1 | tee "$out/serve.log"
  rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "gpu_serve failed with $rc (124: over budget)"; status=1; fi
  tail -n 1 "$out/serve.log" > "$out/serve.json"
fi
echo "== done in $(( $(date +%s) - start )) s; results in $out"
exit $status
