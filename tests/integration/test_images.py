"""Real sdists and real podman images: base, environment and task images.

The base rootfs is built once per machine (``cache_dir()/base``, ~1 min the first time); the
environment image used here is inflection's (455 tests, ~1 s suite).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PatchApplyError
from forgeflow.common.settings import tool_env
from forgeflow.registry.images import (
    ImageRef,
    build_env_image,
    build_task_image,
    debian_mirror,
    ensure_base_image,
    image_exists,
)
from forgeflow.registry.projects import (
    Project,
    fetch_sdist,
    get_project,
    prepare_checkout,
)
from forgeflow.sandbox.grading import failed, parse_test_log

pytestmark = pytest.mark.integration

PROJECT = "inflection"
BUG_FILE = "inflection/__init__.py"
BUG_LINE = "    return word.replace('_', '-')"  # dasherize()
BUGGY_LINE = "    return word.replace('_', '+')"


def _run(image: str, script: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", "run", "--rm", "--network", "none", image, "sh", "-c", script],
        env=tool_env(), capture_output=True, text=True, errors="replace", timeout=timeout_s,
    )


def _bug_patch(root: Path, tmp_path: Path, old: str, new: str) -> str:
    """A git diff that changes one line ``old`` -> ``new`` in BUG_FILE of a copy of ``root``."""
    copy = tmp_path / "bugcopy"
    shutil.copytree(root, copy)
    source = copy / BUG_FILE
    text = source.read_text()
    assert text.count(old) == 1
    source.write_text(text.replace(old, new))
    return subprocess.run(
        ["git", "diff"], cwd=copy, capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def project() -> Project:
    return get_project(PROJECT)


@pytest.fixture(scope="module")
def base() -> ImageRef:
    return ensure_base_image()


@pytest.fixture(scope="module")
def checkout(project: Project, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_checkout(project, tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="module")
def env_image(project: Project, checkout: Path, base: ImageRef) -> ImageRef:
    return build_env_image(project, checkout, base.name)


def test_fetch_sdist_verifies_and_detects_a_corrupted_cache(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGEFLOW_CACHE", str(tmp_path / "cache"))
    path = fetch_sdist(project)
    assert path == tmp_path / "cache" / "sdists" / project.sdist_filename
    assert fetch_sdist(project) == path  # reused after verification
    path.write_bytes(path.read_bytes()[:-10] + b"corrupted!")
    with pytest.raises(InputError) as info:
        fetch_sdist(project)
    message = str(info.value)
    assert project.sdist_filename in message and project.sha256 in message
    assert "has sha256" in message


def test_pristine_commit_is_deterministic(project: Project, checkout: Path, tmp_path: Path) -> None:
    again = prepare_checkout(project, tmp_path)
    head = ["git", "log", "-1", "--format=%H %s %an"]
    first = subprocess.run(head, cwd=checkout, capture_output=True, text=True, check=True).stdout
    second = subprocess.run(head, cwd=again, capture_output=True, text=True, check=True).stdout
    assert first == second == f"{project.pristine_commit} pristine forgeflow\n"


def test_base_image_has_pytest_without_network(base: ImageRef) -> None:
    assert image_exists(base.name)
    done = _run(base.name, "python3 -c 'import pytest' && git --version && patch --version")
    assert done.returncode == 0, done.stderr
    assert "git version" in done.stdout and "GNU patch" in done.stdout


def test_env_image_passes_the_projects_own_suite(project: Project, env_image: ImageRef) -> None:
    done = _run(env_image.name, f"{project.test_command}; git log --format=%s; git status --porcelain")
    assert f" {project.expected_passed} passed" in done.stdout
    assert sum(line.startswith("PASSED ") for line in done.stdout.splitlines()) == project.expected_passed
    status = parse_test_log(done.stdout)
    assert status and not any(failed(s) for s in status.values())
    assert done.stdout.rstrip().endswith("pristine")  # clean tree at the pristine commit


def test_env_image_rebuild_is_a_lookup(
    project: Project, checkout: Path, base: ImageRef, env_image: ImageRef
) -> None:
    assert build_env_image(project, checkout, base.name) == env_image


def test_task_image_breaks_tests_and_hides_the_bug(
    project: Project, checkout: Path, env_image: ImageRef, tmp_path: Path
) -> None:
    patch = _bug_patch(checkout, tmp_path, BUG_LINE, BUGGY_LINE)
    task = build_task_image(env_image.name, "inflection.dasherize__plus", patch)
    assert task.name != env_image.name
    done = _run(task.name, project.test_command)
    status = parse_test_log(done.stdout)
    broken = [t for t, s in status.items() if failed(s)]
    assert broken and all("dasherize" in t for t in broken)
    lines = done.stdout.splitlines()
    n_passed = sum(line.startswith("PASSED ") for line in lines)
    n_failed = sum(line.startswith("FAILED ") for line in lines)
    assert n_failed >= len(broken) and n_passed + n_failed == project.expected_passed

    history = _run(task.name, "git log -p --all; ls -a /testbed")
    assert history.stdout.count("\ncommit ") + history.stdout.startswith("commit ") == 1
    removed = [
        line for line in history.stdout.splitlines()
        if line.startswith("-") and not line.startswith("--- /dev/null")
    ]
    assert removed == []  # one root commit: the diff only adds files, the change is invisible
    assert "bug.patch" not in history.stdout
    # No git object anywhere under /testbed holds the pristine line (the fix is not recoverable).
    objects = _run(task.name, "git cat-file --batch-all-objects --batch")
    assert objects.returncode == 0 and "replace('_', '+')" in objects.stdout
    assert "replace('_', '-')" not in objects.stdout
    assert build_task_image(env_image.name, "inflection.dasherize__plus", patch) == task


def test_patch_that_does_not_apply_names_the_instance(
    checkout: Path, env_image: ImageRef, tmp_path: Path
) -> None:
    patch = _bug_patch(checkout, tmp_path, BUG_LINE, BUGGY_LINE)
    stale = patch.replace("-    return word.replace('_', '-')", "-    return word.replace('-', '_')")
    with pytest.raises(PatchApplyError, match="inflection.stale_patch"):
        build_task_image(env_image.name, "inflection.stale_patch", stale)


def test_env_image_refuses_a_modified_checkout(
    project: Project, checkout: Path, base: ImageRef, tmp_path: Path
) -> None:
    copy = tmp_path / "modified"
    shutil.copytree(checkout, copy)
    (copy / BUG_FILE).write_text((copy / BUG_FILE).read_text().replace(BUG_LINE, BUGGY_LINE))
    with pytest.raises(InputError, match="uncommitted changes"):
        build_env_image(project, copy, base.name)


def test_debian_mirror_reads_both_apt_source_formats(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "nodesource.sources").write_text(
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\n"
    )
    assert debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://old.example/debian bookworm main\n")
    assert debian_mirror(tmp_path) == "http://old.example/debian"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="bookworm"):
        debian_mirror(empty)
