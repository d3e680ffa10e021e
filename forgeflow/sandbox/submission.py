"""What of a submission reaches the verifier: the task's test infrastructure is the task's.

A submission is a unified diff of ``/testbed`` (``git diff`` of the agent's working tree, or the
patch an RL completion holds). Files that configure or extend the test run belong to the task, not
to the submission: a change to one of them could make failing tests pass without fixing anything.
:func:`screen_submission` splits the diff into its per-file parts, finds the *protected* paths it
touches (:func:`protected_reason`, both sides of a rename or copy), and applies a named policy:

* ``reject`` (default): the submission is recorded as **tampering**: reward 0, the protected paths
  named, the tests not even run;
* ``drop``: the parts that touch protected paths are removed and the rest is graded (the task's
  files stay exactly as the image has them); the dropped paths are recorded.

Protected, anywhere in the repository (:data:`PROTECTED_NAMES`, :data:`TEST_DIR_NAMES`):

* test files: every file named by FAIL_TO_PASS / PASS_TO_PASS, ``test_*.py``, ``*_test.py``,
  ``tests.py``, and everything under a directory named ``test``, ``tests`` or ``testing``;
* pytest configuration and plugins: every ``conftest.py``, ``pytest.ini``, ``.pytest.ini``,
  ``tox.ini``, ``setup.cfg``, ``pyproject.toml`` (the whole file: it can hold
  ``[tool.pytest.ini_options]``), ``noxfile.py``, and packaging metadata that registers plugins
  (``entry_points.txt``, anything under ``*.egg-info`` / ``*.dist-info``);
* interpreter start-up hooks: ``sitecustomize.py``, ``usercustomize.py`` and every ``*.pth``;
* a *new* top-level module (in the repository root or under ``src/``) named like a module of the
  test runner (``pytest``, ``_pytest``, ``py``, ``pluggy``, ``iniconfig``) or of the standard
  library (``sys.stdlib_module_names``): the repository is on ``sys.path`` ahead of them, so such a
  file would replace the runner or a module it imports (:func:`shadowed_module`). A file of that name
  the pristine repository already has may be edited.

The verifier also runs with user site-packages disabled (``PYTHONNOUSERSITE``, see
:data:`forgeflow.sandbox.verifier.VERIFIER_ENV`), in a fresh container of the pristine task image.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError

__all__ = [
    "TamperPolicy",
    "TAMPER_POLICIES",
    "FileDiff",
    "ScreenedSubmission",
    "split_diff",
    "protected_reason",
    "screen_submission",
    "shadowed_module",
    "test_files",
]

TamperPolicy = Literal["reject", "drop"]
"""``reject``: a submission that touches a protected path is tampering (reward 0); ``drop``: those
parts are removed and the rest is graded."""

TAMPER_POLICIES: tuple[str, ...] = TamperPolicy.__args__

PROTECTED_NAMES = frozenset({
    "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py",
    "sitecustomize.py", "usercustomize.py", "entry_points.txt", "tests.py",
})
"""File names protected wherever they are (test configuration, plugins, start-up hooks)."""

TEST_DIR_NAMES = frozenset({"test", "tests", "testing"})
"""Directory names whose whole content is test infrastructure."""

RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "forgeflow_pytest_report"})
"""Modules the test run imports besides the standard library (pytest and its dependencies, the
verifier's report plugin)."""

_MODULE_SUFFIXES = (".py", ".pyc", ".pyw", ".so", ".pyd")
_TEST_FILE = re.compile(r"^(test_.*|.*_test)\.py$")
_PATH_HEADERS = (("rename from ", "old"), ("copy from ", "old"), ("rename to ", "new"), ("copy to ", "new"))
_DIFF_HEADER = re.compile(r"^diff --git ", re.MULTILINE)
_C_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


class FileDiff(BaseModel):
    """One file's part of a ``git diff``.

    Attributes:
        old_path: path before (None for a new file), relative to the repository root.
        new_path: path after (None for a deleted file).
        text: the part's text, from its ``diff --git`` line to the next one.
    """

    model_config = ConfigDict(frozen=True)

    old_path: str | None
    new_path: str | None
    text: str

    @property
    def paths(self) -> list[str]:
        """Every path the part touches (both sides of a rename or copy), without duplicates."""
        return sorted({p for p in (self.old_path, self.new_path) if p is not None})


class ScreenedSubmission(BaseModel):
    """A submission after :func:`screen_submission`.

    Attributes:
        policy: the policy applied.
        diff: what the verifier applies (the whole diff when clean; without the protected parts
            under ``drop``; empty under ``reject`` when tampering was found).
        protected_paths: protected paths the submission touched, each with why it is protected
            (``{path: reason}``), sorted by path; empty when clean.
        tampering: True when ``policy == "reject"`` and a protected path was touched: reward 0.
        dropped_paths: paths whose parts were removed (``drop``).
    """

    model_config = ConfigDict(frozen=True)

    policy: TamperPolicy
    diff: str
    protected_paths: dict[str, str] = Field(default_factory=dict)
    tampering: bool = False
    dropped_paths: list[str] = Field(default_factory=list)

    def evidence(self) -> dict[str, object]:
        """The record a trial keeps: policy, and the protected paths when there were any."""
        out: dict[str, object] = {"policy": self.policy}
        if self.protected_paths:
            out["protected_paths"] = dict(self.protected_paths)
            out["tampering"] = self.tampering
            out["dropped_paths"] = list(self.dropped_paths)
        return out


def _unquote(token: str) -> str:
    """A git path token: C-quoted (``"a/caf\\303\\251.py"``) or plain; trailing TAB removed."""
    token = token.rstrip("\n").rstrip("\t")
    if not (token.startswith('"') and token.endswith('"') and len(token) >= 2):
        return token
    body, out, i = token[1:-1], bytearray(), 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if re.fullmatch(r"[0-7]{3}", body[i + 1:i + 4]):
                out.append(int(body[i + 1:i + 4], 8))
                i += 4
                continue
            out.extend(_C_ESCAPES.get(nxt, nxt).encode())
            i += 2
            continue
        out.extend(ch.encode())
        i += 1
    return out.decode("utf-8", errors="replace")


def _strip_prefix(path: str) -> str | None:
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _header_paths(first_line: str) -> tuple[str | None, str | None]:
    """Paths from ``diff --git a/X b/Y`` (for parts without ---/+++ lines: mode changes, binaries)."""
    rest = first_line[len("diff --git "):].rstrip("\n")
    if rest.startswith('"'):
        match = re.match(r'^("(?:[^"\\]|\\.)*")\s+(.*)$', rest)
        if match:
            return _strip_prefix(_unquote(match.group(1))), _strip_prefix(_unquote(match.group(2)))
    # unquoted: "a/X b/X" with the same X on both sides unless renamed (then rename lines tell)
    half = (len(rest) - 1) // 2
    if rest[half] == " " and rest[:half][2:] == rest[half + 1:][2:]:
        return _strip_prefix(rest[:half]), _strip_prefix(rest[half + 1:])
    parts = rest.split(" b/", 1)
    return _strip_prefix(parts[0]), (parts[1] if len(parts) == 2 else None)


def split_diff(diff: str) -> list[FileDiff]:
    """Split a ``git diff`` into its per-file parts, with the paths each part touches.

    Paths come from ``rename from``/``rename to``, ``copy from``/``copy to``, ``---``/``+++`` lines
    (C-quoted paths unquoted), else the ``diff --git`` line; ``/dev/null`` sides are None.

    Args:
        diff: a unified diff in git's format (``git diff``; plain ``---``/``+++`` diffs without
            ``diff --git`` lines are taken as one part).

    Returns:
        The parts in order; empty for an empty diff.

    Raises:
        InputError: ``diff`` is not a string, or a part names no path.
    """
    if not isinstance(diff, str):
        raise InputError(f"submission diff must be a string, got {type(diff).__name__}")
    if not diff.strip():
        return []
    starts = [m.start() for m in _DIFF_HEADER.finditer(diff)]
    if not starts or diff[:starts[0]].strip():
        starts = [0, *starts] if starts else [0]
    chunks = [diff[a:b] for a, b in zip(starts, [*starts[1:], len(diff)])]
    parts = []
    for chunk in chunks:
        lines = chunk.splitlines(keepends=True)
        old = new = None
        seen_old = seen_new = False
        for line in lines:
            if line.startswith("@@"):
                break
            for key, setter in _PATH_HEADERS:
                if line.startswith(key):
                    value = _unquote(line[len(key):])
                    if setter == "old":
                        old, seen_old = value, True
                    else:
                        new, seen_new = value, True
            if line.startswith("--- ") and not seen_old:
                old, seen_old = _strip_prefix(_unquote(line[4:])), True
            elif line.startswith("+++ ") and not seen_new:
                new, seen_new = _strip_prefix(_unquote(line[4:])), True
        if lines and lines[0].startswith("diff --git ") and not (seen_old and seen_new):
            head_old, head_new = _header_paths(lines[0])
            is_new = any(line.startswith("new file mode") for line in lines)
            is_deleted = any(line.startswith("deleted file mode") for line in lines)
            old = old if seen_old else (None if is_new else head_old)
            new = new if seen_new else (None if is_deleted else head_new)
        if old is None and new is None:
            raise InputError(f"submission diff has a part that names no file: {chunk[:200]!r}")
        parts.append(FileDiff(old_path=old, new_path=new, text=chunk))
    return parts


def test_files(test_ids: Iterable[str]) -> set[str]:
    """The files of test ids (``tests/test_x.py::test_a[p]`` -> ``tests/test_x.py``)."""
    return {t.split("::", 1)[0] for t in test_ids if "::" in t}


def protected_reason(path: str, task_test_files: Iterable[str] = ()) -> str | None:
    """Why ``path`` (relative to the repository root) is the task's, or None if it is not.

    Args:
        path: a repository-relative POSIX path.
        task_test_files: the files of the task's FAIL_TO_PASS / PASS_TO_PASS tests.

    Returns:
        A short reason (``"test file of FAIL_TO_PASS/PASS_TO_PASS"``, ``"test directory tests/"``,
        ``"pytest configuration"``, ``"interpreter start-up hook"``, ...) or None.
    """
    pure = PurePosixPath(path)
    name = pure.name
    if path in set(task_test_files):
        return "test file of FAIL_TO_PASS/PASS_TO_PASS"
    if name in ("sitecustomize.py", "usercustomize.py") or name.endswith(".pth"):
        return "interpreter start-up hook"
    if name == "conftest.py":
        return "pytest conftest (fixtures, hooks, plugins)"
    if name in PROTECTED_NAMES:
        return "test-run configuration or plugin registration"
    for part in pure.parts[:-1]:
        if part in TEST_DIR_NAMES:
            return f"test directory {part}/"
        if part.endswith((".egg-info", ".dist-info")):
            return "packaging metadata (plugin entry points)"
    if _TEST_FILE.match(name):
        return "test file"
    return None


def shadowed_module(path: str) -> str | None:
    """The module of the test runner or standard library that a top-level ``path`` would shadow.

    Top-level means in the repository root or directly under ``src/`` (where the repository puts
    itself on ``sys.path``): ``json.py``, ``src/inspect/__init__.py``, ``pytest.py``. Returns None for
    anything else (``pkg/json.py`` is ``pkg.json``, shadowing nothing).
    """
    parts = PurePosixPath(path).parts
    if len(parts) > 1 and parts[0] == "src":
        parts = parts[1:]
    if not parts:
        return None
    if len(parts) == 1:
        if not parts[0].endswith(_MODULE_SUFFIXES):
            return None
        name = parts[0].split(".", 1)[0]
    else:
        name = parts[0]
    return name if name in RUNNER_MODULES or name in sys.stdlib_module_names else None


def screen_submission(diff: str, test_ids: Iterable[str], policy: TamperPolicy = "reject") -> ScreenedSubmission:
    """Find the protected paths a submission touches and apply ``policy``.

    Args:
        diff: the submission (``git diff`` text; may be empty).
        test_ids: the task's FAIL_TO_PASS and PASS_TO_PASS test ids (their files are protected).
        policy: ``reject`` or ``drop`` (see the module docstring).

    Returns:
        The :class:`ScreenedSubmission`.

    Raises:
        InputError: an unknown policy (the valid ones are listed) or a malformed diff.
    """
    if policy not in TAMPER_POLICIES:
        raise InputError(f"unknown tamper policy {policy!r}; valid: {', '.join(TAMPER_POLICIES)}")
    files = test_files(test_ids)
    parts = split_diff(diff)
    protected: dict[str, str] = {}
    kept: list[FileDiff] = []
    for part in parts:
        reasons = {p: r for p in part.paths if (r := protected_reason(p, files)) is not None}
        if part.new_path is not None and part.new_path != part.old_path:  # a new file (or a rename onto one)
            module = shadowed_module(part.new_path)
            if module is not None:
                reasons[part.new_path] = f"new module shadowing {module!r} (test runner or standard library)"
        protected.update(reasons)
        if not reasons:
            kept.append(part)
    protected = dict(sorted(protected.items()))
    if not protected:
        return ScreenedSubmission(policy=policy, diff=diff)
    if policy == "reject":
        return ScreenedSubmission(policy=policy, diff="", protected_paths=protected, tampering=True)
    return ScreenedSubmission(policy=policy, diff="".join(p.text for p in kept), protected_paths=protected,
                              dropped_paths=sorted(protected))
