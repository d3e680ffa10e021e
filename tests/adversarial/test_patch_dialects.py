"""Attack class: the screen and git disagree about what the patch changes (patch dialects x protected paths).

A generator crosses every way of writing a diff that ``git apply`` reads (git's own headers, a plain
unified part, a plain part after a git part, C-quoted paths, a rename onto the path, a new symlink, a
mode change, a binary part) with every kind of file the runner reads (conftest files at every depth,
pytest configuration, start-up hooks, plugin metadata, bytecode caches, a module that shadows the
standard library). The unfixed submission that carries the attack must get reward 0 through real podman,
named as tampering or refused by git; a variant that git applies must name exactly the protected path
git wrote. The same fix written in each dialect still scores 1 (the defence is not a refusal of dialects).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from forgeflow.sandbox.submission import protected_reason, shadowed_module
from tests.adversarial.calc_task import BUGGY_CALC, FIX, GOOD_CALC, verify

pytestmark = pytest.mark.integration

CHEAT = "import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    raise SystemExit\n"
PROTECTED = ["conftest.py", "tests/conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
             "sitecustomize.py", "usercustomize.py", "zz.pth", "calc.egg-info/entry_points.txt",
             "__pycache__/calc.cpython-311.pyc", "tests/__pycache__/conftest.cpython-311-pytest-7.2.1.pyc",
             "json.py", "pdb.py", ".pytest_cache/v/cache/lastfailed", "deep/er/conftest.py"]


def _git_binary_patch(path: str, data: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / path).write_bytes(data)
        subprocess.run(["git", "init", "-q"], cwd=tmp, check=True)
        subprocess.run(["git", "add", "-A", "-f"], cwd=tmp, check=True)
        return subprocess.run(["git", "diff", "--cached", "--binary", "--no-renames"], cwd=tmp,
                              check=True, capture_output=True, text=True).stdout


def _quote(path: str) -> str:
    return '"' + "".join(f"\\{b:03o}" for b in path.encode()) + '"'


def _new_file(path: str, text: str, dialect: str) -> str:
    lines = text.splitlines()
    body = f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines)
    if dialect == "git":
        return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n{body}"
    if dialect == "plain":
        return f"--- /dev/null\n+++ {path}\n{body}"
    if dialect == "quoted":
        return f"diff --git {_quote('a/' + path)} {_quote('b/' + path)}\nnew file mode 100644\n--- /dev/null\n" \
               f"+++ {_quote('b/' + path)}\n{body}"
    if dialect == "symlink":  # a link to a file the attacker does not control is harmless; the link itself is not
        return f"diff --git a/{path} b/{path}\nnew file mode 120000\n--- /dev/null\n+++ b/{path}\n" \
               f"@@ -0,0 +1 @@\n+/etc/hostname\n\\ No newline at end of file\n"
    if dialect == "binary":  # git's own binary patch (a NUL byte makes the content binary)
        return _git_binary_patch(path, text.encode() + b"\0")
    raise AssertionError(dialect)


DIALECTS = ["git", "plain", "git-then-plain", "quoted", "symlink", "binary"]


def _attack(path: str, dialect: str) -> str:
    """An unfixed submission that writes ``CHEAT`` to ``path`` in ``dialect`` (plus a harmless edit first)."""
    harmless = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,3 @@\n+# tidy\n" \
               " def add(a, b):\n     return a - b\n"
    if dialect == "git-then-plain":
        return harmless + _new_file(path, CHEAT, "plain")
    return _new_file(path, CHEAT, dialect)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_protected_path_in_every_dialect_scores_0(task_image: str, dialect: str) -> None:
    seen = []
    d = DIALECTS.index(dialect)
    for i, path in enumerate(PROTECTED):
        if (i + d) % 3:  # each path in two of the six dialects: the class covered, the suite kept short
            continue
        verdict = verify(task_image, _attack(path, dialect), f"dialect-{dialect}-{i}")
        record = verdict.evidence["submission"]
        seen.append((path, verdict.reward, record.get("applied", True), sorted(record.get("protected_paths", {}))))
        assert verdict.reward == 0.0, (path, dialect, verdict.notes)
        assert verdict.result is None, (path, dialect, "no test may run on a tampered tree")
        if record.get("applied", True):  # git wrote it where git reads the header (a plain "+++ tests/x" loses
            # its first component to -p1): whatever path git wrote, it is named
            written = path if dialect != "plain" and dialect != "git-then-plain" else path.split("/", 1)[-1]
            assert record.get("tampering"), (path, dialect, record)
            if protected_reason(written) is not None or shadowed_module(written) is not None:
                assert written in record["protected_paths"], (path, dialect, record)
            else:  # e.g. ".pytest_cache/v/cache/lastfailed" written as "v/cache/lastfailed": nothing reads it,
                assert record["screen_findings"], record  # and the hook it holds is what the screen refuses
    assert any(applied for _, _, applied, _ in seen), seen  # the dialect is one git really applies


@pytest.mark.parametrize("dialect", ["git", "plain", "quoted"])
def test_the_fix_in_each_dialect_still_scores_1(task_image: str, dialect: str) -> None:
    old, new = BUGGY_CALC.splitlines(), GOOD_CALC.splitlines()
    hunk = f"@@ -1,{len(old)} +1,{len(new)} @@\n" + "".join(f"-{x}\n" for x in old) + "".join(f"+{x}\n" for x in new)
    patch = {"git": FIX, "plain": f"--- calc.py\n+++ calc.py\n{hunk}",
             "quoted": f"diff --git {_quote('a/calc.py')} {_quote('b/calc.py')}\n--- {_quote('a/calc.py')}\n"
                       f"+++ {_quote('b/calc.py')}\n{hunk}"}[dialect]
    verdict = verify(task_image, "Here is the fix:\n" + patch, f"fix-{dialect}")
    assert verdict.reward == 1.0, verdict.notes
    assert verdict.evidence["submission"]["changed_paths"] == 1 and "+    return a + b" in verdict.submission_patch
