"""One frozen vision tower, one projector file: the mmproj converted from the tiny-vl base and from a merged
checkpoint of its lineage has the same sha256.

Regression (the ``forgeflow demo --base-model tiny-vl`` run): the base's projector (sha256 ab8f9eaa...) and the
candidate's (f851c191...) had identical tensors but differed in ``general.name`` ("Base Vl" vs "Merged"): the
converter names a GGUF after the checkpoint's folder, so the same tower got another digest at every merge.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.settings import cache_dir
from forgeflow.packaging import mmproj as projector
from forgeflow.packaging import vl_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_projector_of_the_same_tower_has_one_digest_whatever_the_checkpoint_folder(tmp_path: Path) -> None:
    from gguf import GGUFReader

    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)  # reused
    merged = tmp_path / "merged"  # the folder name a merge writes; the same weights as the base
    merged.symlink_to(base.path, target_is_directory=True)
    from_base = projector.convert_mmproj(base.path, tmp_path / "base-mmproj.gguf")
    from_merged = projector.convert_mmproj(merged, tmp_path / "merged-mmproj.gguf")
    assert from_base.sha256 == from_merged.sha256
    assert GGUFReader(from_base.path).fields["general.name"].contents() == "qwen3_5_vision projector"
    assert projector.check_mmproj(from_merged.path, base.path).projector_type == "qwen3vl_merger"
