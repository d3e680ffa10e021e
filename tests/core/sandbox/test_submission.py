"""Screening submissions: which paths of a diff are the task's, and the tamper policies.

The diffs are real ``git diff`` output of a scratch repository (git on the host), so renames,
new, deleted and binary files and C-quoted paths are what git really prints.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.sandbox.submission import protected_reason, screen_submission, split_diff

F2P = ["tests/test_core.py::test_fix[a b]"]
P2P = ["tests/test_core.py::test_other", "pkg/test_inline.py::test_x"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "core.quotePath=true", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    (root / "pkg" / "test_inline.py").write_text("def test_x():\n    pass\n")
    (root / "tests" / "test_core.py").write_text("def test_other():\n    pass\n")
    (root / "setup.cfg").write_text("[tool:pytest]\naddopts = -q\n")
    (root / "old name.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    return root


def _diff(repo: Path) -> str:
    _git(repo, "add", "-A")
    return _git(repo, "diff", "--cached", "--binary", "-M", "HEAD")


def test_a_fix_of_the_source_is_clean(repo: Path) -> None:
    (repo / "pkg" / "core.py").write_text("def f():\n    return 2\n")
    diff = _diff(repo)
    screened = screen_submission(diff, [*F2P, *P2P])
    assert not screened.tampering and screened.protected_paths == {} and screened.diff == diff


@pytest.mark.parametrize(("path", "content", "why"), [
    ("tests/test_core.py", "def test_other():\n    assert True\n", "test file of FAIL_TO_PASS/PASS_TO_PASS"),
    ("conftest.py", "def pytest_collection_modifyitems(items):\n    items.clear()\n", "conftest"),
    ("pkg/conftest.py", "import pytest\n", "conftest"),
    ("setup.cfg", "[tool:pytest]\naddopts = --deselect tests\n", "configuration"),
    ("pytest.ini", "[pytest]\naddopts = -p no:python\n", "configuration"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-k nothing'\n", "configuration"),
    ("sitecustomize.py", "import os\n", "start-up hook"),
    ("pkg/zz_hook.pth", "import os\n", "start-up hook"),
    ("usercustomize.py", "import os\n", "start-up hook"),
    ("pkg.egg-info/entry_points.txt", "[pytest11]\nx = pkg.plugin\n", "plugin registration"),
    ("pkg.egg-info/top_level.txt", "pkg\n", "packaging metadata"),
    ("tests/helpers/new_util.py", "X = 1\n", "test directory tests/"),
    ("pkg/core_test.py", "def test_y():\n    pass\n", "test file"),
])
def test_changes_to_the_tasks_own_files_are_tampering(repo: Path, path: str, content: str, why: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(content)
    (repo / "pkg" / "core.py").write_text("def f():\n    return 2\n")
    screened = screen_submission(_diff(repo), [*F2P, *P2P])
    assert screened.tampering and screened.diff == ""
    assert list(screened.protected_paths) == [path]
    assert why in screened.protected_paths[path]
    assert screened.evidence()["protected_paths"] == {path: screened.protected_paths[path]}


def test_drop_policy_keeps_the_fix_and_removes_the_protected_parts(repo: Path) -> None:
    (repo / "pkg" / "core.py").write_text("def f():\n    return 2\n")
    (repo / "conftest.py").write_text("import pytest\n")
    (repo / "tests" / "test_core.py").unlink()
    screened = screen_submission(_diff(repo), [*F2P, *P2P], "drop")
    assert not screened.tampering
    assert screened.dropped_paths == ["conftest.py", "tests/test_core.py"]
    assert [p.paths for p in split_diff(screened.diff)] == [["pkg/core.py"]]
    # what is left still applies to the pristine tree
    (repo / "out.patch").write_text(screened.diff)
    _git(repo, "reset", "-q", "--hard")
    _git(repo, "apply", "--check", "out.patch")


def test_a_rename_onto_a_protected_path_is_seen_on_both_sides(repo: Path) -> None:
    _git(repo, "mv", "pkg/core.py", "pkg/conftest.py")
    parts = split_diff(_diff(repo))
    assert [p.paths for p in parts] == [["pkg/conftest.py", "pkg/core.py"]]
    assert screen_submission(_diff(repo), []).tampering


def test_quoted_paths_with_spaces_and_unicode_are_unquoted(repo: Path) -> None:
    (repo / "old name.py").write_text("x = 2\n")
    (repo / "pkg" / "café.py").write_text("y = 1\n")
    (repo / "pkg" / "tests é").mkdir()
    (repo / "pkg" / "tests é" / "a b.py").write_text("z = 1\n")
    paths = sorted(p for part in split_diff(_diff(repo)) for p in part.paths)
    assert paths == ["old name.py", "pkg/café.py", "pkg/tests é/a b.py"]
    # a directory "tests é" is not a test directory; "a b.py" is not a test file name
    assert not screen_submission(_diff(repo), []).tampering


def test_binary_new_and_deleted_files_name_their_paths(repo: Path) -> None:
    (repo / "pkg" / "blob.bin").write_bytes(bytes(range(256)))
    (repo / "old name.py").unlink()
    (repo / "tests" / "data.bin").write_bytes(b"\x00\x01")
    parts = {tuple(p.paths): p for p in split_diff(_diff(repo))}
    assert set(parts) == {("pkg/blob.bin",), ("old name.py",), ("tests/data.bin",)}
    assert parts[("old name.py",)].new_path is None and parts[("pkg/blob.bin",)].old_path is None
    screened = screen_submission(_diff(repo), [], "drop")
    assert screened.dropped_paths == ["tests/data.bin"]


def test_empty_submission_and_bad_input() -> None:
    assert split_diff("") == [] and not screen_submission("", F2P).tampering
    with pytest.raises(errors.InputError, match="unknown tamper policy 'lenient'; valid: reject, drop"):
        screen_submission("", F2P, "lenient")  # type: ignore[arg-type]
    with pytest.raises(errors.InputError, match="must be a string"):
        split_diff(b"diff")  # type: ignore[arg-type]


@pytest.mark.parametrize(("path", "protected"), [
    ("src/pkg/module.py", False), ("src/testing_utils.py", False), ("docs/conf.py", False),
    ("src/pkg/testing/helpers.py", True), ("test/unit.py", True), ("a/b/tests.py", True),
    ("src/pkg/test_module.py", True), ("lib/x.pth", True), ("setup.py", False),
])
def test_protected_reason(path: str, protected: bool) -> None:
    assert (protected_reason(path) is not None) is protected


@pytest.mark.parametrize(("path", "module"), [
    ("pytest.py", "pytest"), ("_pytest/__init__.py", "_pytest"), ("json.py", "json"), ("src/inspect.py", "inspect"),
    ("src/re/__init__.py", "re"), ("pluggy/_hooks.py", "pluggy"), ("pkg/json.py", None), ("mymod.py", None),
    ("README.md", None), ("docs/json.py", None),
])
def test_shadowed_module(path: str, module: str | None) -> None:
    from forgeflow.sandbox.submission import shadowed_module

    assert shadowed_module(path) == module


def test_a_new_module_that_shadows_the_runner_is_tampering_but_editing_an_existing_one_is_not(repo: Path) -> None:
    (repo / "pytest.py").write_text("import sys\nsys.exit(0)\n")
    screened = screen_submission(_diff(repo), [])
    assert screened.tampering and "shadowing 'pytest'" in screened.protected_paths["pytest.py"]
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "project ships a top-level json.py")
    (repo / "pytest.py").write_text("import sys\nsys.exit(1)\n")  # now the pristine tree has it: an edit
    assert not screen_submission(_diff(repo), []).tampering
