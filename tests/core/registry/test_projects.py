"""The pinned real projects (forgeflow/data/projects.json): integrity and lookup; no network."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from forgeflow.common.errors import InputError
from forgeflow.registry.projects import Project, get_project, load_projects


def test_six_distinct_projects_with_pinned_sdists() -> None:
    projects = load_projects()
    assert len(projects) == 6
    assert len({p.name for p in projects}) == 6
    for project in projects:
        assert re.fullmatch(r"[0-9a-f]{64}", project.sha256), project.name
        assert project.sdist_filename == f"{project.name}-{project.version}.tar.gz"


def test_test_commands_print_per_test_summary_lines() -> None:
    for project in load_projects():
        # -rA makes pytest print "PASSED <id>" / "FAILED <id>", which the graders parse.
        assert "-rA" in project.test_command.split(), project.name
        assert project.test_command.split()[-1] == project.tests_path, project.name
        assert project.pythonpath.startswith("/testbed"), project.name


def test_get_project_returns_the_pinned_record() -> None:
    project = get_project("cachetools")
    assert project.source_path == "src/cachetools"
    assert project.pythonpath == "/testbed/src"


def test_unknown_project_lists_valid_names() -> None:
    with pytest.raises(InputError) as info:
        get_project("numpy")
    message = str(info.value)
    assert "numpy" in message
    for project in load_projects():
        assert project.name in message


def test_project_record_is_frozen_and_rejects_a_bad_digest() -> None:
    project = get_project("six")
    with pytest.raises(ValidationError):
        project.version = "0"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="sha256"):
        Project.model_validate({**project.model_dump(), "sha256": "abc"})
