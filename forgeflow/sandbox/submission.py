"""What of a submission may reach the tests: the task's own files stay the task's, judged on git's list.

Protected: test files (FAIL_TO_PASS / PASS_TO_PASS files, ``test_*.py``, ``*_test.py``, ``tests.py``, anything
under ``test``/``tests``/``testing``); pytest configuration and plugins (``conftest.py``, ``pytest.ini``,
``.pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``, ``pytest.toml``, ``noxfile.py``, ``.coveragerc``,
``.pytest_cache/``, ``entry_points.txt``, ``*.egg-info`` / ``*.dist-info``); start-up hooks
(``sitecustomize.py``, ``usercustomize.py``, ``*.pth``); compiled code (``__pycache__/``, ``*.pyc``, ``*.pyo``,
``*.so``, ``*.pyd``); symbolic links and ``.gitattributes``; and a *new* top-level module that shadows one the
task's interpreter imports from outside the repository (measured in the pristine sandbox,
:class:`~forgeflow.sandbox.changes.RunnerProbe`; :func:`shadowed_module`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.sandbox.changes import RunnerProbe, TreeChanges

__all__ = [
    "TamperPolicy",
    "TAMPER_POLICIES",
    "ScreenPolicy",
    "SCREEN_POLICIES",
    "SCREEN_PATTERNS",
    "ScreenFinding",
    "classify_changes",
    "protected_reason",
    "screen_added_lines",
    "shadowed_module",
    "test_files",
]

TamperPolicy = Literal["reject", "drop"]
"""``reject``: a submission that changes a protected path is tampering (reward 0); ``drop``: those
paths are put back as the pristine image has them and the rest is graded."""

TAMPER_POLICIES: tuple[str, ...] = TamperPolicy.__args__

ScreenPolicy = Literal["reject", "flag", "off"]
"""What a static-screen finding does: ``reject`` (tampering, reward 0), ``flag`` (recorded only),
``off`` (the screen does not run)."""

SCREEN_POLICIES: tuple[str, ...] = ScreenPolicy.__args__

PROTECTED_NAMES = frozenset({
    "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py",
    "sitecustomize.py", "usercustomize.py", "entry_points.txt", "tests.py", ".coveragerc", "pytest.toml",
    ".pytest.toml", ".gitattributes",
})
"""File names protected wherever they are (test configuration, plugins, start-up hooks)."""

TEST_DIR_NAMES = frozenset({"test", "tests", "testing"})
"""Directory names whose whole content is test infrastructure."""

RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "exceptiongroup",
                            "tomli", "attr", "attrs", "forgeflow_pytest_report"})
"""Modules the test run imports besides the standard library (pytest and its dependencies, the
verifier's report plugin): shadowing them is refused even where the probe did not run."""

_MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
_TEXT_SUFFIXES = (".py", ".pyw", ".pyi", ".pth", ".cfg", ".ini", ".toml", ".txt", ".json", ".yaml", ".yml", ".sh")
_COMPILED_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd")
_TEST_FILE = re.compile(r"^(test_.*|.*_test)\.py$")

SCREEN_PATTERNS: dict[str, str] = {
    "test framework internals": r"\b_pytest\b|\bpluggy\b|\bpytest_[a-z_]+\b|hookimpl|hookwrapper|pluginmanager"
                                r"|forgeflow|FORGEFLOW",
    "process exit hooks": r"\bos\._exit\b|\bos\.(?:kill|killpg|abort)\b|\bsignal\.(?:signal|SIG[A-Z]+)\b|\batexit\b"
                          r"|\bfaulthandler\b",
    "interpreter introspection": r"\bgc\.get_(?:objects|referrers|referents)\b|\bsys\._getframe\b"
                                 r"|\bsys\.(?:settrace|setprofile|modules)\b|\binspect\.(?:stack|currentframe)\b"
                                 r"|\bctypes\b",
    "the runner's descriptors": r"/proc/|/dev/fd|\bos\.dup2?\b",
}
"""What the static screen looks for in added lines, by what it reaches (regular expressions)."""

_SCREEN = {kind: re.compile(pattern) for kind, pattern in SCREEN_PATTERNS.items()}


class ScreenFinding(BaseModel):
    """One added line the static screen matched."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="the file (repository-relative).")
    kind: str = Field(description="what it reaches (a key of SCREEN_PATTERNS).")
    line: str = Field(max_length=200, description="the added line (at most 200 characters).")


def test_files(test_ids: Iterable[str]) -> set[str]:
    """The files of test ids (``tests/test_x.py::test_a[p]`` -> ``tests/test_x.py``)."""
    return {t.split("::", 1)[0] for t in test_ids if "::" in t}


def protected_reason(path: str, task_test_files: Iterable[str] = ()) -> str | None:
    """Why ``path`` (relative to the repository root) is the task's (a short reason such as ``"pytest
    configuration"``), or None if it is not."""
    pure = PurePosixPath(path)
    name = pure.name
    if path in set(task_test_files):
        return "test file of FAIL_TO_PASS/PASS_TO_PASS"
    if name in ("sitecustomize.py", "usercustomize.py") or name.endswith(".pth"):
        return "interpreter start-up hook"
    if name == "conftest.py":
        return "pytest conftest (fixtures, hooks, plugins)"
    if name == ".gitattributes":
        return "git attributes (how git reads the tree the verifier judges)"
    if name in PROTECTED_NAMES:
        return "test-run configuration or plugin registration"
    for part in pure.parts[:-1]:
        if part in TEST_DIR_NAMES:
            return f"test directory {part}/"
        if part.endswith((".egg-info", ".dist-info")):
            return "packaging metadata (plugin entry points)"
        if part == "__pycache__":
            return "bytecode cache (__pycache__/)"
        if part == ".pytest_cache":
            return "pytest's cache (.pytest_cache/)"
    if name.endswith((".egg-info", ".dist-info")):
        return "packaging metadata (plugin entry points)"
    if name.endswith(_COMPILED_SUFFIXES):
        return "compiled module (loaded instead of, or without, a source file)"
    if _TEST_FILE.match(name):
        return "test file"
    return None


def shadowed_module(path: str, probe: RunnerProbe | None = None, repo: str = "/testbed") -> str | None:
    """The module outside the repository that a *new* ``path`` would shadow, or None.

    Returns:
        The shadowed module's name, or None.
    """
    entries = list(probe.repo_entries) if probe is not None and probe.repo_entries else [repo, f"{repo}/src"]
    names = set(RUNNER_MODULES) | (set(probe.names) | set(probe.startup_names) if probe is not None and probe.names
                                   else set(sys.stdlib_module_names) | set(sys.builtin_module_names))
    absolute = PurePosixPath(repo) / path
    for entry in entries:
        try:
            parts = absolute.relative_to(PurePosixPath(entry)).parts
        except ValueError:
            continue
        if not parts:
            continue
        if len(parts) == 1:
            if not parts[0].endswith(_MODULE_SUFFIXES):
                continue
            name = parts[0].split(".", 1)[0]
        else:
            name = parts[0]
        if name in names:
            return name
    return None


def classify_changes(changes: TreeChanges, test_ids: Iterable[str], repo: str = "/testbed") -> dict[str, str]:
    """The protected paths among what git saw the submission change, each with why, sorted by path.

    Returns:
        ``{path: reason}`` for every changed path that is the task's (see the module docstring).
    """
    files = test_files(test_ids)
    out: dict[str, str] = {}
    for change in changes.changes:
        reason = protected_reason(change.path, files)
        if reason is None and change.is_symlink:
            reason = "symbolic link (the runner would read whatever it points to)"
        if reason is None and change.status == "A":
            module = shadowed_module(change.path, changes.probe, repo)
            if module is not None:
                reason = (f"new module shadowing {module!r} (importable from outside the repository: the "
                          "standard library, the test runner or an installed package)")
        if reason is not None:
            out[change.path] = reason
    return dict(sorted(out.items()))


def screen_added_lines(patch: str, skip: Iterable[str] = ()) -> list[ScreenFinding]:
    """Search the lines a submission added for what :data:`SCREEN_PATTERNS` names.

    Returns:
        The findings, in patch order (at most one per added line).
    """
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    if not patch.strip():
        return []
    try:
        parsed = PatchSet(patch)
    except UnidiffParseError as exc:  # git's own output: a parse failure is a finding, never a pass
        return [ScreenFinding(path="", kind="unreadable patch", line=str(exc)[:200])]
    skipped = set(skip)
    out: list[ScreenFinding] = []
    for pfile in parsed:
        path = pfile.path
        if path in skipped:
            continue
        if pfile.is_binary_file and path.endswith(_TEXT_SUFFIXES):  # code git would not show as text
            out.append(ScreenFinding(path=path, kind="binary change of a text file", line="GIT binary patch"))
            continue
        for hunk in pfile:
            for line in hunk:
                if not line.is_added:
                    continue
                for kind, pattern in _SCREEN.items():
                    if pattern.search(line.value):
                        out.append(ScreenFinding(path=path, kind=kind, line=line.value.rstrip("\n")[:200]))
                        break
    return out


