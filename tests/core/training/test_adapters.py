"""The adapter digest names the adapter, not the hash seed of the process that saved it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.training.adapters import adapter_sha256, canonicalize_adapter_config

# A parent's config saved by one process, reloaded and saved by another (what an RL burst does with
# the SFT adapter it continues); peft keeps target_modules as a set, so the list order follows the
# seed. Seeds 9 and 10 reorder Qwen2's four attention projections with peft 0.21 (seen in CI: a burst
# with no gradient looked like a new adapter).
_ROUND_TRIP = """
import sys
from peft import LoraConfig
from forgeflow.training.adapters import canonicalize_adapter_config
first, raw, canonical = sys.argv[1:4]
config = LoraConfig.from_pretrained(first)
config.save_pretrained(raw)
config.save_pretrained(canonical)
canonicalize_adapter_config(canonical)
"""


def _save_config(folder: Path) -> None:
    from peft import LoraConfig

    LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]).save_pretrained(str(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"weights")


def _resave(src: Path, raw: Path, canonical: Path, seed: int) -> None:
    """Reload ``src``'s config in a process of hash seed ``seed`` and save it twice: as peft writes it (``raw``)
    and canonicalized (``canonical``); one process, so both start from the same set order."""
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    subprocess.run([sys.executable, "-c", _ROUND_TRIP, str(src), str(raw), str(canonical)],
                   env=env, check=True, timeout=120)
    for dst in (raw, canonical):
        (dst / "adapter_model.safetensors").write_bytes(b"weights")


def test_an_adapter_resaved_under_another_hash_seed_keeps_its_digest(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    _save_config(parent)
    canonicalize_adapter_config(parent)
    orders = set()
    for seed in (9, 10, 11):
        raw, canon = tmp_path / f"raw{seed}", tmp_path / f"canon{seed}"
        _resave(parent, raw, canon, seed)
        orders.add(tuple(json.loads((raw / "adapter_config.json").read_text())["target_modules"]))
        assert adapter_sha256(canon) == adapter_sha256(parent)
        assert json.loads((canon / "adapter_config.json").read_text())["target_modules"] == [
            "k_proj", "o_proj", "q_proj", "v_proj"]
    # without canonicalisation these seeds really do write different orders (else this test proves nothing)
    assert len(orders) > 1


def test_a_config_that_is_not_json_is_refused_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InputError, match="adapter_config.json"):
        canonicalize_adapter_config(tmp_path)
    with pytest.raises(InputError, match="adapter_config.json"):
        canonicalize_adapter_config(tmp_path / "missing")
