"""Lifecycle parameters (forgeflow.config)."""

from __future__ import annotations

import pydantic
import pytest

from forgeflow.config import DEMO_PROJECTS, LifecycleConfig
from forgeflow.projects import load_projects


def test_canary_concurrency_above_the_limit_is_refused_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match="canary_concurrency"):
        LifecycleConfig(canary_concurrency=5)
    assert LifecycleConfig(canary_concurrency=4).canary_concurrency == 4


def test_demo_projects_are_all_pinned():
    assert set(DEMO_PROJECTS) <= {p.name for p in load_projects()}
    assert len(DEMO_PROJECTS) >= 6


def test_unknown_project_is_refused_listing_the_pinned_ones():
    with pytest.raises(pydantic.ValidationError, match=r"unknown project\(s\) \['nosuch'\]; pinned projects: .*boltons"):
        LifecycleConfig(projects=("six", "nosuch"))
