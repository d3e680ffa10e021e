"""Print one JSON line of the figures issue 35 ("One vocabulary of types") is checked by.

``model_classes``: the pydantic model classes defined in forgeflow/, tasks/, flows/, blocks/ and
deployments/ (a class whose base is ``BaseModel``, ``RootModel``, ``BaseSettings`` or a Prefect
``Block``, directly or through another class defined there), read from the source with ``ast`` (no
import); ``docstring_lines`` / ``python_lines`` / ``docstring_share``: the lines of module, class and
function docstrings over all lines of those folders' Python files; ``readme_lines``: README.md's length.

Usage: ``python3 scripts/type_stats.py`` (from anywhere; paths are the repository's).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("forgeflow", "tasks", "flows", "blocks", "deployments")
MODEL_ROOTS = {"BaseModel", "RootModel", "BaseSettings", "Block"}


def _base_name(node: ast.expr) -> str:
    """``pydantic.BaseModel`` -> ``BaseModel``; ``RootModel[list[str]]`` -> ``RootModel``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _docstring_lines(tree: ast.Module) -> int:
    """Lines taken by the module's, its classes' and its functions' docstrings."""
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                total += first.end_lineno - first.lineno + 1
    return total


def stats(root: Path = ROOT) -> dict[str, float | int]:
    """The figures for the repository at ``root``.

    Args:
        root: the repository's root folder.

    Returns:
        ``{"model_classes", "docstring_lines", "python_lines", "docstring_share", "readme_lines"}``;
        ``docstring_share`` is a fraction (0..1), rounded to 3 places.
    """
    bases: dict[str, set[str]] = {}  # class name -> its base names (same-named classes merged)
    doc_lines = py_lines = 0
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text, filename=str(path))
            py_lines += len(text.splitlines())
            doc_lines += _docstring_lines(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases.setdefault(f"{path}:{node.name}", set()).update(_base_name(b) for b in node.bases)
    by_name: dict[str, list[str]] = {}
    for key in bases:
        by_name.setdefault(key.rsplit(":", 1)[1], []).append(key)
    models: set[str] = set()
    changed = True
    while changed:  # a class is a model when a base is a model root or a model defined here
        changed = False
        for key, names in bases.items():
            if key not in models and any(n in MODEL_ROOTS or any(k in models for k in by_name.get(n, []))
                                         for n in names):
                models.add(key)
                changed = True
    readme = root / "README.md"
    return {"model_classes": len(models), "docstring_lines": doc_lines, "python_lines": py_lines,
            "docstring_share": round(doc_lines / py_lines, 3) if py_lines else 0.0,
            "readme_lines": len(readme.read_text(encoding="utf-8").splitlines()) if readme.is_file() else 0}


if __name__ == "__main__":
    print(json.dumps(stats()))
