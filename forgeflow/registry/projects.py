"""Real projects that tasks are generated from: pinned sdists of small pure-Python libraries.

Each project in ``forgeflow/data/projects.json`` is a PyPI sdist pinned by file name and sha256
whose own pytest suite passes offline in the base image (``localhost/forgeflow/base:bookworm``:
Debian bookworm, python 3.11.2, pytest 7.2.1) with no extra dependency, with the project at
``/testbed`` on ``PYTHONPATH``. The pass counts and wall times in the file were measured there
(``podman run --rm --network none``, 2 busy cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InfraError, InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.common.sdists import pip_download_sdist
from forgeflow.common.settings import DATA_DIR, cache_dir

PROJECTS_FILE = DATA_DIR / "projects.json"
PROJECTS_SCHEMA_VERSION = 1

PRISTINE_COMMIT_MESSAGE = "pristine"
GIT_EPOCH_S = 1_700_000_000
"""Author and committer date of generated commits (2023-11-14T22:13:20Z), so the pristine commit
id depends only on the sdist's content."""

GIT_IDENTITY_ENV: dict[str, str] = {
    "GIT_AUTHOR_NAME": "forgeflow",
    "GIT_AUTHOR_EMAIL": "forgeflow@localhost",
    "GIT_COMMITTER_NAME": "forgeflow",
    "GIT_COMMITTER_EMAIL": "forgeflow@localhost",
    "GIT_AUTHOR_DATE": f"@{GIT_EPOCH_S} +0000",
    "GIT_COMMITTER_DATE": f"@{GIT_EPOCH_S} +0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}
"""Environment for git commands that make commits: fixed identity and dates, no user config."""

GIT_EXCLUDES = "__pycache__/\n*.pyc\n.pytest_cache/\n"
"""Written to ``.git/info/exclude`` (not committed) so test runs leave ``git status`` clean."""

_PIP_TIMEOUT_S = 300
_GIT_TIMEOUT_S = 120


class Project(BaseModel):
    """One pinned real project."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$",
                      description="PyPI distribution name (also the key in projects.json).")
    version: str = Field(min_length=1, description="pinned release.")
    sdist_filename: str = Field(pattern=r"^[A-Za-z0-9._-]+\.tar\.gz$",
                                description="the sdist's file name on PyPI (<name>-<version>.tar.gz).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="hex sha256 of that sdist (64 lowercase hex characters).")
    pristine_commit: str = Field(pattern=r"^[0-9a-f]{40}$",
                                 description="the git commit id prepare_checkout makes from the sdist (the same on "
                                             "every machine: fixed author, committer and dates).")
    source_path: str = Field(min_length=1,
                             description="package source relative to the project root, where bugs are generated")
    tests_path: str = Field(min_length=1, description="the tests directory or file relative to the project root.")
    test_command: str = Field(min_length=1,
                              description="shell command, run in /testbed, that runs the whole suite and prints "
                                          "pytest -rA summary lines (PASSED <nodeid> / FAILED <nodeid>).")
    pythonpath: str = Field(pattern=r"^/testbed(/.*)?$",
                            description="PYTHONPATH value inside the image (under /testbed).")
    expected_passed: int = Field(gt=0,
                                 description="number of tests the pristine suite passes in the base image "
                                             "(measured).")
    suite_wall_s: float = Field(gt=0, le=600,
                                description="measured wall time of one podman run of the suite, in seconds.")

    @property
    def requirement(self) -> str:
        """The pinned requirement string, ``name==version``."""
        return f"{self.name}=={self.version}"


@lru_cache(maxsize=1)
def _load(path: str) -> tuple[Project, ...]:
    raw = json.loads(Path(path).read_text())
    if raw.get("schema_version") != PROJECTS_SCHEMA_VERSION:
        raise InputError(
            f"{path}: schema_version {raw.get('schema_version')!r}, expected {PROJECTS_SCHEMA_VERSION}"
        )
    projects = tuple(Project.model_validate(item) for item in raw["projects"])
    names = [p.name for p in projects]
    if len(set(names)) != len(names):
        raise InputError(f"{path}: duplicate project names in {names}")
    return projects


def load_projects() -> list[Project]:
    """Return every pinned project from ``forgeflow/data/projects.json``, in file order.

    Raises:
        InputError: the file's schema version is not :data:`PROJECTS_SCHEMA_VERSION` or a name
            repeats.
        pydantic.ValidationError: an entry is malformed.
    """
    return list(_load(str(PROJECTS_FILE)))


def get_project(name: str) -> Project:
    """Return the pinned project called ``name``.

    Raises:
        InputError: no project has that name (the message lists the valid names).
    """
    projects = load_projects()
    for project in projects:
        if project.name == name:
            return project
    valid = ", ".join(p.name for p in projects)
    raise InputError(f"unknown project {name!r}; valid projects: {valid}")


def _verify(project: Project, path: Path) -> Path:
    found = sha256_file(path)
    if found != project.sha256:
        raise InputError(
            f"sdist {path} of {project.requirement} has sha256 {found}, expected {project.sha256} "
            "(delete the file to download it again)"
        )
    return path


def fetch_sdist(project: Project) -> Path:
    """Return the verified sdist of ``project`` (``cache_dir()/sdists/<sdist_filename>``), downloading it if absent.

    Raises:
        InputError: the file's sha256 differs from the pin (file and both digests named), or pip saved
            another file name.
        TransientInfraError: pip could not download the sdist (index unreachable, timeout).
    """
    sdists = cache_dir() / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    target = sdists / project.sdist_filename
    if target.is_file():
        return _verify(project, target)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=sdists))
    try:
        downloaded = pip_download_sdist(project.requirement, project.sdist_filename, tmp, _PIP_TIMEOUT_S)
        _verify(project, downloaded)
        os.replace(downloaded, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _git(root: Path, *args: str) -> str:
    env = dict(os.environ)
    env.update(GIT_IDENTITY_ENV)
    proc = subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false",
         "-c", "core.autocrlf=false", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise InfraError(f"git {' '.join(args)} in {root} failed: {proc.stderr.strip()}")
    return proc.stdout


def git_commit_all(root: Path, message: str) -> str:
    """Make ``root`` a fresh git repository with one commit of all its files; return the commit id.

    Raises:
        InfraError: git failed (not expected on a writable directory).
    """
    _git(root, "init", "-q")
    (root / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (root / ".git" / "info" / "exclude").write_text(GIT_EXCLUDES)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "--no-verify", "-m", message)
    return _git(root, "rev-parse", "HEAD").strip()


def prepare_checkout(project: Project, dest: Path) -> Path:
    """Unpack the verified sdist under ``dest`` as a git repository with one ``pristine`` commit; returns its root.

    Raises:
        InputError: the sdist fails verification, is not a single-directory archive, or the root exists and
            is not a clean pristine checkout.
        TransientInfraError: the sdist could not be downloaded.
    """
    sdist = fetch_sdist(project)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as archive:
        tops = {Path(m.name).parts[0] for m in archive.getmembers() if m.name not in ("", ".")}
        if len(tops) != 1:
            raise InputError(f"sdist {sdist} has {len(tops)} top-level entries {sorted(tops)}, expected one")
        top = tops.pop()
        root = dest / top
        if root.exists():
            if (root / ".git").is_dir() and _is_pristine(root):
                return root
            raise InputError(f"checkout {root} already exists and is not a clean pristine checkout")
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest))
        try:
            archive.extractall(tmp, filter="data")
            git_commit_all(tmp / top, PRISTINE_COMMIT_MESSAGE)
            os.replace(tmp / top, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _is_pristine(root: Path) -> bool:
    try:
        message = _git(root, "log", "-1", "--format=%s").strip()
        status = _git(root, "status", "--porcelain").strip()
    except InfraError:
        return False
    return message == PRISTINE_COMMIT_MESSAGE and status == ""
