"""Lifecycle parameters (forgeflow.config)."""

from __future__ import annotations

import pydantic
import pytest

from forgeflow.config import DEMO_PROJECTS, LifecycleConfig
from forgeflow.registry.projects import load_projects


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


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"freeze_name": "../../etc"}, "freeze_name"),
    ({"freeze_name": "Demo V1"}, "freeze_name"),
    ({"quantizations": ()}, "at least one quantization"),
    ({"quantizations": ("BOGUS",)}, "unknown quantization"),
    ({"quantizations": ("Q8_0",), "serve_quantization": "Q4_K_M"}, "serve_quantization 'Q4_K_M' is not among"),
    ({"serve_ports": (8801, 8801)}, "four distinct ports"),
    ({"source_port": 5701, "target_port": 5701}, "four distinct ports"),
    ({"serve_ports": (80, 8802)}, "1024..65535"),
    ({"lanes": 9, "shards": 8}, r"lanes \(9\) cannot exceed shards \(8\)"),
    ({"verifier_timeout_s": float("inf")}, "verifier_timeout_s"),
    ({"freeze_nam": "x"}, "freeze_nam"),  # a typo is refused, never silently defaulted
])
def test_inconsistent_or_unknown_parameters_are_refused_before_any_stage(kwargs, named) -> None:
    with pytest.raises(pydantic.ValidationError, match=named):
        LifecycleConfig(**kwargs)


def test_projects_that_cannot_fill_the_splits_are_refused_before_any_work() -> None:
    # 2 projects, 3 repository-disjoint splits (train, validation, test): refused when parsed, i.e.
    # before a flow run builds an image; the demo's defaults (6 projects) pass
    with pytest.raises(pydantic.ValidationError, match=r"2 project\(s\) x 5 candidates .*repository-disjoint "
                                                         r"splits .*need 3, at most 2 possible"):
        LifecycleConfig(projects=("six", "toolz"))
    assert LifecycleConfig(projects=("six", "toolz"), validation_min=0).quotas.validation == 0
    with pytest.raises(pydantic.ValidationError, match="per-repository cap"):
        LifecycleConfig(candidates_per_project=1, train_min=4, test_min=4)
    assert LifecycleConfig().quotas.min_repos == 2


def test_metadata_edits_are_checked_when_the_config_is_parsed() -> None:
    from forgeflow.config import LifecycleConfig

    config = LifecycleConfig(metadata_edits=[{"op": "set", "key": "general.name", "value": "agent-v3"}])
    assert config.metadata_edits[0].key == "general.name"
    with pytest.raises(pydantic.ValidationError, match=r"metadata_edits\[0\].*cannot delete 'general.architecture'"):
        LifecycleConfig(metadata_edits=[{"op": "delete", "key": "general.architecture"}])
    with pytest.raises(pydantic.ValidationError, match=r"metadata_edits\[0\]"):
        LifecycleConfig(metadata_edits=[{"op": "set", "key": "general.name", "value": "x", "artifacts": ["Q2_K"]}])
