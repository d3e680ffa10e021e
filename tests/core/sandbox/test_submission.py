"""What a submission changed, as git sees it, and which of those paths are the task's.

No container: :func:`forgeflow.sandbox.changes.changes_script` runs with the host's bash, git and python3
on a scratch repository (the same script the verifier runs in the sandbox), so every list below is
what git really reported after really applying the submission.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.sandbox.changes import Change, RunnerProbe, TreeChanges, changes_script, parse_changes, restore_script
from forgeflow.sandbox.submission import classify_changes, protected_reason, screen_added_lines, shadowed_module

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
    (root / ".gitignore").write_text("*.egg-info/\n__pycache__/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    (root / "pkg.egg-info").mkdir()  # an ignored file the image holds (pip install -e at build time)
    (root / "pkg.egg-info" / "entry_points.txt").write_text("[console_scripts]\npkg = pkg.core:f\n")
    return root


def changes_of(repo: Path, patch: str) -> TreeChanges:
    """Apply ``patch`` to ``repo`` with the verifier's own script and return what git saw change."""
    nonce = uuid.uuid4().hex[:16]
    patch_file = repo.parent / f"{nonce}.patch"
    patch_file.write_text(patch)
    proc = subprocess.run(["bash", "-c", changes_script(str(repo), nonce, patch_path=str(patch_file))],
                          capture_output=True, text=True, timeout=120)
    return parse_changes(proc.stdout, proc.returncode, nonce)


def _diff_of(repo: Path, edit) -> str:  # noqa: ANN001 - a callable editing the work tree
    """The ``git diff`` (binary, renames on) of ``edit`` applied to a copy of ``repo``'s commit."""
    scratch = repo.parent / f"scratch-{uuid.uuid4().hex[:6]}"
    subprocess.run(["git", "clone", "-q", str(repo), str(scratch)], check=True)
    edit(scratch)
    _git(scratch, "add", "-A")
    return _git(scratch, "diff", "--cached", "--binary", "-M", "HEAD")


FIX = ("diff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py\n+++ b/pkg/core.py\n@@ -1,2 +1,2 @@\n"
       " def f():\n-    return 1\n+    return 2\n")


def test_a_plain_part_after_a_git_part_is_seen_by_git_and_is_tampering(repo: Path) -> None:
    """The issue's attack: the old screen read only the first (git-format) part; git applies both."""
    cheat = "--- /dev/null\n+++ conftest.py\n@@ -0,0 +1,2 @@\n+import pytest\n+pytest.skip_all = True\n"
    changes = changes_of(repo, FIX + cheat)
    assert changes.applied and changes.paths == ["conftest.py", "pkg/core.py"]
    assert classify_changes(changes, [*F2P, *P2P], str(repo)) == {
        "conftest.py": "pytest conftest (fixtures, hooks, plugins)"}
    assert (repo / "conftest.py").is_file()  # git really wrote it


def test_git_lists_every_kind_of_change(repo: Path) -> None:
    def edit(tree: Path) -> None:
        (tree / "pkg" / "core.py").write_text("def f():\n    return 2\n")
        (tree / "old name.py").rename(tree / "new näme.py")
        (tree / "pkg" / "blob.pyc").write_bytes(bytes(range(256)))
        (tree / "pkg" / "link.py").symlink_to("/usr/lib/python3/dist-packages")
        (tree / "tests" / "test_core.py").chmod(0o755)

    changes = changes_of(repo, _diff_of(repo, edit))
    by_path = {c.path: c for c in changes.changes}
    assert set(by_path) == {"pkg/core.py", "old name.py", "new näme.py", "pkg/blob.pyc", "pkg/link.py",
                            "tests/test_core.py"}
    assert by_path["old name.py"].status == "D" and by_path["new näme.py"].status == "A"  # a rename: both sides
    assert by_path["pkg/link.py"].is_symlink and by_path["tests/test_core.py"].new_mode == "100755"
    protected = classify_changes(changes, [*F2P, *P2P], str(repo))
    assert set(protected) == {"pkg/blob.pyc", "pkg/link.py", "tests/test_core.py"}
    assert "symbolic link" in protected["pkg/link.py"] and "compiled" in protected["pkg/blob.pyc"]


def test_a_change_to_an_ignored_file_the_image_holds_is_seen(repo: Path) -> None:
    """``git status`` without --ignored would miss it: the snapshots hash ignored files too."""
    patch = ("--- a/pkg.egg-info/entry_points.txt\n+++ b/pkg.egg-info/entry_points.txt\n@@ -1,2 +1,4 @@\n"
             " [console_scripts]\n pkg = pkg.core:f\n+[pytest11]\n+evil = pkg.core\n")
    changes = changes_of(repo, patch)
    assert changes.paths == ["pkg.egg-info/entry_points.txt"]
    assert "plugin registration" in classify_changes(changes, [], str(repo))["pkg.egg-info/entry_points.txt"]


def test_a_patch_git_refuses_changes_nothing_and_says_why(repo: Path) -> None:
    for patch in ("text before\n```diff\ndiff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py\n",
                  "--- a/../outside.py\n+++ b/../outside.py\n@@ -0,0 +1 @@\n+x\n",
                  "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+x\n"):
        changes = changes_of(repo, patch)
        assert not changes.applied and changes.apply_output and changes.changes == [], patch
    assert not (repo.parent / "outside.py").exists() and not (repo / ".git" / "hooks" / "post-checkout").exists()


def test_what_git_accepts_is_what_counts_even_where_a_text_parser_would_refuse(repo: Path) -> None:
    """A diff between two /dev/nulls made the old screen raise; git applies it as a new file dev/null."""
    changes = changes_of(repo, "--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+x\n")
    assert changes.applied and changes.paths == ["dev/null"] and (repo / "dev" / "null").read_text() == "x\n"


def test_drop_puts_the_task_files_back_and_removes_new_ones(repo: Path) -> None:
    def edit(tree: Path) -> None:
        (tree / "pkg" / "core.py").write_text("def f():\n    return 2\n")
        (tree / "tests" / "test_core.py").write_text("def test_other():\n    assert True\n")
        (tree / "conftest.py").write_text("import pytest\n")
        (tree / "setup.cfg").unlink()

    changes = changes_of(repo, _diff_of(repo, edit))
    protected = sorted(classify_changes(changes, [*F2P, *P2P], str(repo)))
    assert protected == ["conftest.py", "setup.cfg", "tests/test_core.py"]
    listing = repo.parent / "restore.list"
    listing.write_text("".join(f"{p}\0" for p in protected))
    subprocess.run(["bash", "-c", restore_script(str(repo), changes.base_tree, str(listing))], check=True)
    assert not (repo / "conftest.py").exists()
    assert (repo / "setup.cfg").read_text() == "[tool:pytest]\naddopts = -q\n"
    assert (repo / "tests" / "test_core.py").read_text() == "def test_other():\n    pass\n"
    assert (repo / "pkg" / "core.py").read_text() == "def f():\n    return 2\n"  # the fix stays


def test_an_empty_submission_changes_nothing(repo: Path) -> None:
    nonce = uuid.uuid4().hex[:16]
    proc = subprocess.run(["bash", "-c", changes_script(str(repo), nonce)], capture_output=True, text=True)
    changes = parse_changes(proc.stdout, proc.returncode, nonce)
    assert changes.applied and changes.changes == [] and changes.patch.strip() == ""
    assert str(repo) in changes.probe.repo_entries and "json" in changes.probe.names


def test_a_broken_sandbox_is_an_error_not_a_verdict() -> None:
    with pytest.raises(errors.SandboxError, match="listing what the submission changed failed"):
        parse_changes("cd: /testbed: No such file or directory\n", 126, "0123456789abcdef")
    with pytest.raises(errors.InputError, match="patch or a tree"):
        changes_script("/testbed", "0123456789abcdef", patch_path="/tmp/a", tree_path="/tmp/b")


@pytest.mark.parametrize(("path", "protected"), [
    ("src/pkg/module.py", False), ("src/testing_utils.py", False), ("docs/conf.py", False),
    ("src/pkg/testing/helpers.py", True), ("test/unit.py", True), ("a/b/tests.py", True),
    ("src/pkg/test_module.py", True), ("lib/x.pth", True), ("setup.py", False),
    ("pkg/__pycache__/m.cpython-311.pyc", True),
    ("pkg/_speedups.cpython-311-x86_64-linux-gnu.so", True), (".pytest_cache/v/cache/lastfailed", True),
    ("pkg.dist-info", True), (".coveragerc", True),
])
def test_protected_reason(path: str, protected: bool) -> None:
    assert (protected_reason(path) is not None) is protected


def test_shadowing_is_measured_against_what_the_interpreter_can_import() -> None:
    probe = RunnerProbe(sys_path=["/testbed", "/testbed/lib", "/usr/lib/python3.11", "/venv/site-packages"],
                        repo_entries=["/testbed", "/testbed/lib"], names=frozenset({"json", "numpy", "six"}))
    assert shadowed_module("numpy/__init__.py", probe) == "numpy"  # an installed library the tests use
    assert shadowed_module("lib/six.py", probe) == "six"  # in another sys.path entry inside the repository
    assert shadowed_module("json.py", probe) == "json"
    assert shadowed_module("pytest.py", probe) == "pytest"  # the runner's own, even where the probe missed it
    assert shadowed_module("pkg/json.py", probe) is None and shadowed_module("mymod.py", probe) is None
    assert shadowed_module("README.md", probe) is None
    # without a probe: the repository root and src/ against the standard library
    assert shadowed_module("src/inspect.py") == "inspect" and shadowed_module("numpy/__init__.py") is None


def test_an_edit_of_an_existing_module_of_that_name_is_not_shadowing() -> None:
    probe = RunnerProbe(repo_entries=["/testbed"], names=frozenset({"json"}))
    edited = TreeChanges(changes=[Change(status="M", path="json.py", old_mode="100644", new_mode="100644")],
                         probe=probe)
    added = TreeChanges(changes=[Change(status="A", path="json.py", old_mode="000000", new_mode="100644")],
                        probe=probe)
    assert classify_changes(edited, []) == {}
    assert "shadowing 'json'" in classify_changes(added, [])["json.py"]


def test_the_static_screen_reads_only_added_lines_of_gits_patch(repo: Path) -> None:
    def edit(tree: Path) -> None:
        (tree / "pkg" / "core.py").write_text("import atexit\nimport _pytest.runner\n\ndef f():\n    return 2\n")
        (tree / "pkg" / "util.py").write_text("# removed: os._exit\nVALUE = 1\n")

    changes = changes_of(repo, _diff_of(repo, edit))
    findings = screen_added_lines(changes.patch)
    assert [(f.path, f.kind) for f in findings] == [("pkg/core.py", "process exit hooks"),
                                                    ("pkg/core.py", "test framework internals"),
                                                    ("pkg/util.py", "process exit hooks")]
    assert screen_added_lines("") == []
    assert screen_added_lines(changes.patch, skip=["pkg/core.py", "pkg/util.py"]) == []


def test_a_gitattributes_cannot_hide_an_edit_from_git_or_the_screen(repo: Path) -> None:
    """Found by a red-team run: ``working-tree-encoding=UTF-7`` made git hash an edited test file as its
    pristine bytes (``+ACAAPQA9ACAANQ`` decodes to `` == 5``), and ``-diff`` made a source edit a binary
    part the screen skipped. The sandbox's ``.git/info/attributes`` now outranks every ``.gitattributes``."""
    (repo / "tests" / "test_eq.py").write_text("def test_eq():\n    assert 2 + 3 == 5\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a test with == 5")
    utf7 = ("diff --git a/tests/test_eq.py b/tests/test_eq.py\n--- a/tests/test_eq.py\n+++ b/tests/test_eq.py\n"
            "@@ -1,2 +1,2 @@\n def test_eq():\n-    assert 2 + 3 == 5\n+    assert 2 + 3+ACAAPQA9ACAANQ\n"
            "diff --git a/.gitattributes b/.gitattributes\nnew file mode 100644\n--- /dev/null\n+++ b/.gitattributes\n"
            "@@ -0,0 +1,2 @@\n+tests/test_eq.py working-tree-encoding=UTF-7\n+pkg/core.py -diff\n")
    hook = ("diff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py\n+++ b/pkg/core.py\n@@ -1,2 +1,3 @@\n"
            "+import _pytest.reports\n def f():\n     return 1\n")
    changes = changes_of(repo, utf7 + hook)
    assert changes.paths == [".gitattributes", "pkg/core.py", "tests/test_eq.py"]  # the test edit is seen
    protected = classify_changes(changes, [], str(repo))
    assert set(protected) == {".gitattributes", "tests/test_eq.py"} and "git attributes" in protected[".gitattributes"]
    assert [(f.path, f.kind) for f in screen_added_lines(changes.patch, skip=protected)] == [
        ("pkg/core.py", "test framework internals")]  # read as text, not as a binary part
    assert "+    assert 2 + 3+ACAAPQA9ACAANQ" in changes.patch  # the stored submission is what ran
