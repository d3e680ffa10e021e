"""``scripts/type_stats.py`` counts what issue 35 is checked by, on a small tree of known figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_type_stats_counts_models_through_local_bases_and_docstring_lines(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import type_stats
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    (tmp_path / "forgeflow").mkdir()
    (tmp_path / "flows").mkdir()
    (tmp_path / "forgeflow" / "a.py").write_text(
        '"""Module doc,\non two lines."""\nfrom pydantic import BaseModel\n\n\n'
        'class Limits(BaseModel):\n    """One line."""\n\n    memory_mb: int = 1024\n\n\n'
        'class NotAModel:\n    pass\n')
    (tmp_path / "flows" / "b.py").write_text(
        'from forgeflow.a import Limits\nfrom prefect.blocks.core import Block\n\n\n'
        'class StageLimits(Limits):\n    pass\n\n\nclass Store(Block):\n    pass\n\n\n'
        'def f():\n    """Doc."""\n')
    (tmp_path / "README.md").write_text("# x\n\ntext\n")
    figures = type_stats.stats(tmp_path)
    assert figures == {"model_classes": 3, "docstring_lines": 4, "python_lines": 27,
                       "docstring_share": round(4 / 27, 3), "readme_lines": 3}
    # the script as a user runs it: one JSON line about this repository
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "type_stats.py")], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out.count("\n") == 1 and json.loads(out)["readme_lines"] == len((ROOT / "README.md").read_text().splitlines())
