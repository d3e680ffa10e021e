"""Property: for any patch ``git apply`` accepts, the paths forgeflow acts on are the paths git changed.

The patches are generated in several dialects (git's own with and without renames and binary parts, GNU
``diff -urN`` plain unified diffs, parts of both concatenated in any order, junk text around and between
parts, C-quoted and unicode paths, mode changes, symlinks, deletions) from random edits of a small
repository. Each is applied by the verifier's own script (:func:`forgeflow.sandbox.changes.changes_script`,
host git and bash: no container), and the changed paths it reports are compared with an independent
oracle: a walk of the work tree before and after (type, executable bit, bytes or link target of every
path but ``.git``). A patch git refuses must change nothing.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from forgeflow.sandbox.changes import changes_script, parse_changes

NAMES = ["a.py", "pkg/b.py", "sp ace.py", "ü.py", "tests/test_x.py", "conftest.py", "pkg/sub/c.txt", "q\"uote.py",
         "json.py", "pkg/__pycache__/b.cpython-311.pyc", "tab\tname.py", "-dash.py"]
BASE = {"a.py": "x = 1\n", "pkg/b.py": "def b():\n    return 2\n", "sp ace.py": "s = 1\n",
        "tests/test_x.py": "def test_x():\n    pass\n", "pkg/sub/c.txt": "line\n" * 5}


def _snapshot(root: Path) -> dict[str, tuple[str, bool, bytes]]:
    """Every path but .git: (type, executable, bytes or link target) — the oracle."""
    out: dict[str, tuple[str, bool, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) == root and d == ".git")]
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", False, os.readlink(path).encode())
            else:
                out[rel] = ("file", bool(info.st_mode & stat.S_IXUSR), path.read_bytes())
    return out


def _repo(root: Path) -> Path:
    root.mkdir(parents=True)
    for rel, text in BASE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base"], cwd=root, check=True)
    return root


EDITS = st.lists(st.tuples(st.sampled_from(["write", "delete", "chmod", "symlink", "binary", "rename"]),
                           st.sampled_from(NAMES), st.sampled_from(NAMES), st.text(min_size=0, max_size=30)),
                 min_size=1, max_size=5)


def _edit(tree: Path, edits: list[tuple[str, str, str, str]]) -> None:
    for op, name, other, text in edits:
        path, target = tree / name, tree / other
        if op == "write":
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                path.unlink()
            path.write_text(text + "\n", encoding="utf-8", errors="surrogatepass")
        elif op == "binary":
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                path.unlink()
            path.write_bytes(bytes(range(0, 256, 3)) + text.encode("utf-8", "surrogatepass"))
        elif op == "delete" and (path.is_file() or path.is_symlink()):
            path.unlink()
        elif op == "chmod" and path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode ^ 0o111)
        elif op == "symlink" and not path.exists() and not path.is_symlink():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(text.replace("\0", "") or "/etc")
        elif op == "rename" and path.is_file() and not path.is_symlink() and not target.exists() and name != other:
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)


def _git_diff(repo: Path, tree: Path, renames: bool) -> str:
    scratch = tree
    subprocess.run(["git", "add", "-A"], cwd=scratch, check=True)
    flags = ["-M"] if renames else ["--no-renames"]
    return subprocess.run(["git", "diff", "--cached", "--binary", *flags, "HEAD"], cwd=scratch, check=True,
                          capture_output=True).stdout.decode("utf-8", "surrogateescape")


def _plain_diff(before: Path, after: Path) -> str:
    proc = subprocess.run(["diff", "-urN", "--exclude=.git", "a", "b"], cwd=before.parent, capture_output=True)
    return proc.stdout.decode("utf-8", "surrogateescape")


def _split_parts(diff: str) -> list[str]:
    lines = diff.splitlines(keepends=True)
    parts: list[list[str]] = []
    for line in lines:
        if line.startswith(("diff --git ", "diff -urN ")) or not parts:
            parts.append([])
        parts[-1].append(line)
    return ["".join(p) for p in parts]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(edits=EDITS, dialect=st.sampled_from(["git", "git-renames", "plain", "mixed"]),
       junk=st.sampled_from(["", "Here is my fix:\n", "```diff\n", "\nsome words\n"]),
       shuffle=st.randoms(use_true_random=False))
def test_the_paths_forgeflow_acts_on_are_the_paths_git_changed(tmp_path_factory, edits, dialect, junk,  # noqa: ANN001
                                                               shuffle) -> None:
    work = tmp_path_factory.mktemp("prop")
    repo = _repo(work / "a")
    edited = work / "b"
    shutil.copytree(repo, edited, symlinks=True)
    _edit(edited, edits)
    if dialect.startswith("git"):
        patch = _git_diff(repo, edited, renames=dialect == "git-renames")
    elif dialect == "plain":
        patch = _plain_diff(repo, edited)
    else:  # git parts and plain parts of the same change, interleaved, with text between them
        parts = _split_parts(_git_diff(repo, edited, renames=False)) + _split_parts(_plain_diff(repo, edited))
        shuffle.shuffle(parts)
        patch = junk.join(parts[: max(1, len(parts) // 2)])
    patch = junk + patch
    before = _snapshot(repo)
    nonce = uuid.uuid4().hex[:16]
    patch_file = work / "submission.patch"
    patch_file.write_bytes(patch.encode("utf-8", "surrogateescape"))
    proc = subprocess.run(["bash", "-c", changes_script(str(repo), nonce, patch_path=str(patch_file))],
                          capture_output=True, timeout=120)
    changes = parse_changes(proc.stdout.decode("utf-8", "replace"), proc.returncode, nonce)
    after = _snapshot(repo)
    git_changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    event(f"{dialect}: {'applied' if changes.applied else 'refused'}, {min(len(git_changed), 3)}+ paths")
    if not changes.applied:
        assert git_changed == [], (patch, changes.apply_output)
        return
    assert changes.paths == git_changed, patch
