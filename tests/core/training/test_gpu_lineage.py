"""``python -m benchmarks.gpu_lineage``: the flows' ``run_sft_burst`` on a small random Qwen2 with a given
tokenizer, and what its adapter's lineage says it trained with.

On this CPU machine the check asks for the CPU and must find it recorded (float32, SDPA, bfd packing);
on the GPU machine ``benchmarks/gpu_check.sh`` runs it with ``--device cuda`` (2026-12-04, H200: cuda,
bfloat16, torch_varlen, bfd). A tokenizer folder without its files is refused by name.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def _tokenizer_dir(tmp_path: Path) -> Path:
    tiny_ggufs()  # builds the tiny model (and its HF folder) once per machine
    from forgeflow.common.settings import cache_dir

    hf = cache_dir() / "test-fixtures" / "tiny-seed0" / "hf"
    out = tmp_path / "tokenizer"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(hf / name, out / name)
    return out


def test_the_burst_records_the_device_it_trained_on(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_lineage", "--tokenizer-dir",
                           str(_tokenizer_dir(tmp_path)), "--device", "cpu", "--steps", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["device"], result["dtype"], result["attention"], result["packing"]) == (
        "cpu", "float32", "sdpa", "bfd")
    assert result["steps"] == 2 and math.isfinite(result["final_loss"]) and len(result["adapter_sha256"]) == 64
    assert result["cuda_available"] is False


def test_a_tokenizer_folder_without_its_files_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_lineage", "--tokenizer-dir", str(tmp_path),
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert "lacks ['tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja']" in proc.stderr
