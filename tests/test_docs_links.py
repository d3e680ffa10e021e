"""Every reference in README.md and docs/*.md opens: relative links (and their #anchors, GitHub's
heading slugs), and every repository path the prose names in backticks (``flows/curate.py``,
``tests/resilience``, ``DESIGN.md``). Paths of a run's outputs (``.forgeflow/demo/summary.json``) are
not the repository's and are left alone; so are module names (``flows.stages.PackageResult``)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^[\w.\-/]+$")
BARE_FILE = re.compile(r"^([\w.\-]+\.(py|sh|toml|yaml|yml|cfg|conf)|[A-Z][A-Z_]*\.md)$")
# names the prose uses for files outside this repository
EXTERNAL = {
    "convert_hf_to_gguf.py",  # llama.cpp's converter, in the pinned llama-cpp-python sdist
    "sitecustomize.py", "usercustomize.py",  # Python's start-up hooks (the site module)
    "task.toml", "tests/test.sh",  # a Harbor task's own files (an exported task's layout)
    "calc.py",  # the module of the red-team tests' generated task (tests/adversarial/calc_task.py)
}
SKIP_DIRS = {".git", "__pycache__", ".ruff_cache", ".pytest_cache", "node_modules"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def _names_in_repo() -> set[str]:
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        names.update(files)
    return names


def test_every_link_and_path_in_the_readme_and_docs_opens() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    # the repository's own top-level entries: what git tracks (a demo run's .forgeflow/ is no part of it)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines() if line}
    names = _names_in_repo()
    broken = []
    for page in pages:
        text = page.read_text()
        where = page.relative_to(ROOT)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{where}: link {target} (no {path})")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: link {target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
        prose = re.sub(r"```.*?```", "", text, flags=re.S)  # command examples hold run outputs, not repo paths
        for code in CODE.findall(prose):
            token = re.sub(r"(::\S*|:\d+(-\d+)?)$", "", code.strip()).rstrip("/")
            if not PATHLIKE.match(token) or token in {".", ".."} or token in EXTERNAL:
                continue
            if "/" in token and token.split("/")[0] in top:
                if not (ROOT / token).exists():
                    broken.append(f"{where}: path `{code}` does not exist")
            elif "/" not in token and BARE_FILE.match(token) and token not in names:
                broken.append(f"{where}: file `{code}` is nowhere in the repository")
    assert not broken, "\n".join(broken)
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md: the long form belongs in docs/"
    linked = set(re.findall(r"\(docs/([\w\-]+\.md)", readme))
    assert {p.name for p in pages[1:]} <= linked, f"docs pages the README does not link: {sorted({p.name for p in pages[1:]} - linked)}"
