"""Lifecycle parameters (forgeflow.config)."""

from __future__ import annotations

import re

import pydantic
import pytest

from forgeflow.config import DEMO_PROJECTS, LifecycleConfig
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.evaluation.canary_params import CanaryRunSettings
from forgeflow.registry.projects import load_projects
from forgeflow.training.burst import BurstConfig


def _refusal(**kwargs) -> tuple[str, str]:
    """The place (dotted loc; empty for a check of the whole config) and message of the one error
    that refuses ``LifecycleConfig(**kwargs)``."""
    with pytest.raises(pydantic.ValidationError) as info:
        LifecycleConfig(**kwargs)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    return ".".join(map(str, errors[0]["loc"])), errors[0]["msg"]


def test_canary_concurrency_above_the_limit_is_refused_naming_the_field():
    with pytest.raises(pydantic.ValidationError, match=r"canary\.concurrency"):
        LifecycleConfig(canary={"concurrency": 5})
    assert LifecycleConfig(canary={"concurrency": 4}).canary.concurrency == 4


def test_demo_projects_are_all_pinned():
    assert set(DEMO_PROJECTS) <= {p.name for p in load_projects()}
    assert len(DEMO_PROJECTS) >= 6


def test_unknown_project_is_refused_listing_the_pinned_ones():
    with pytest.raises(pydantic.ValidationError, match=r"unknown project\(s\) \['nosuch'\]; pinned projects: .*boltons"):
        LifecycleConfig(projects=("six", "nosuch"))


@pytest.mark.parametrize(("kwargs", "place", "message"), [
    ({"freeze": {"name": "../../etc"}}, "freeze.name", "freeze name"),
    ({"freeze": {"name": "Demo V1"}}, "freeze.name", "freeze name"),
    ({"package": {"quantizations": ()}}, "", "serving.quantization 'Q8_0' is not among package.quantizations []"),
    ({"package": {"quantizations": ("BOGUS",)}}, "package.quantizations", "quantization 'BOGUS' is not a named plan"),
    ({"package": {"quantizations": ("Q8_0",)}, "serving": {"quantization": "Q4_K_M"}}, "",
     "serving.quantization 'Q4_K_M' is not among package.quantizations ['Q8_0']"),
    ({"serving": {"ports": (8801, 8801)}}, "", "the embedded registries' ports (registries.source_port, "
                                               "registries.target_port) and serving.ports must be distinct"),
    ({"registries": {"source_port": 5701, "target_port": 5701}}, "", "must be distinct, got [5701, 5701, 8801"),
    ({"registries": {"target_port": 8801}}, "", "must be distinct, got [5701, 8801, 8801, 8802]"),
    # the team's target registry: its unused embedded port may be anything, the source's still counts
    ({"registries": {"target_port": 8801, "target_block": "team", "source_port": 8802}}, "",
     "must be distinct, got [8802, 8801, 8802]"),
    ({"registries": {"target_block": ""}}, "registries.target_block", "at least 1 character"),
    ({"serving": {"ports": (80, 8802)}}, "serving.ports", "ports must be in 1024..65535, got [80, 8802]"),
    ({"prewarm": {"lanes": 9, "shards": 8}}, "prewarm", "lanes (9) cannot exceed shards (8)"),
    ({"validation": {"verifier_timeout_s": float("inf")}}, "validation.verifier_timeout_s", "finite"),
    ({"validation": {"memory_mb": 8}}, "validation.memory_mb", "greater than or equal to 16"),  # MemoryMb, one bound
    ({"promotion": {"max_drop": 1.5}}, "promotion.max_drop", "less than or equal to 1"),
    ({"burst": {"lora_r": 512}}, "burst.lora_r", "less than or equal to 256"),
    ({"burst": {"max_length": 8}}, "burst.max_length", "greater than or equal to 16"),
    ({"canary": {"agent_config": {"step_limit": 0}}}, "canary.agent_config.step_limit", "greater than or equal to 1"),
    ({"canary": "fast"}, "canary", "valid dictionary or instance of CanaryRunSettings"),
    ({"registries": {"transfer": {"max_size_bytes": -1}}}, "registries.transfer.max_size_bytes", "greater than"),
    ({"freeze": {"quotas": {"train": 0, "validation": 1, "test": 2, "max_per_repo": 4}}}, "freeze.quotas",
     "quotas.train must be at least 1 (the burst trains on it), got 0"),
    ({"freeze": {"quotas": {"train": 2, "validation": 1, "test": 0, "max_per_repo": 4}}}, "freeze.quotas",
     "quotas.test must be at least 1"),
])
def test_inconsistent_parameters_are_refused_naming_the_nested_field(kwargs, place, message) -> None:
    where, msg = _refusal(**kwargs)
    assert where == place and message in msg, (where, msg)


def test_a_registry_block_frees_the_embedded_registrys_port() -> None:
    config = LifecycleConfig(registries={"source_block": "team-src", "target_block": "team-dst",
                                         "source_port": 8801, "target_port": 8802})
    assert (config.registries.source_block, config.registries.target_block) == ("team-src", "team-dst")


@pytest.mark.parametrize(("kwargs", "place"), [
    ({"freeze_nam": "x"}, "freeze_nam"),  # a typo is refused, never silently defaulted
    ({"promotion_min_pairs": 3}, "promotion_min_pairs"),  # the flat names before the groups: refused, named
    ({"validate_concurrency": 3}, "validate_concurrency"),
    ({"freeze": {"nam": "x"}}, "freeze.nam"),
    ({"freeze": {"quotas": {"train": 2, "validation": 1, "test": 2, "max_per_repo": 4, "trian": 1}}},
     "freeze.quotas.trian"),
    ({"validation": {"oracle_runs": 3}}, "validation.oracle_runs"),  # it lives in validation.checks now
    ({"validation": {"checks": {"oracle_run": 3}}}, "validation.checks.oracle_run"),
    ({"registries": {"transfer": {"max_size": 1}}}, "registries.transfer.max_size"),
    ({"registries": {"max_image_size_bytes": 1}}, "registries.max_image_size_bytes"),
    ({"prewarm": {"prewarm_concurrency": 1}}, "prewarm.prewarm_concurrency"),
    ({"canary": {"agent_step_limit": 1}}, "canary.agent_step_limit"),
    ({"canary": {"step_limit": 1}}, "canary.step_limit"),  # the agent's knobs live in canary.agent_config
    ({"burst": {"burst_max_steps": 1}}, "burst.burst_max_steps"),
    ({"package": {"quantization": "Q8_0"}}, "package.quantization"),
    ({"promotion": {"min_pair": 3}}, "promotion.min_pair"),
    ({"serving": {"keep_serving": True}}, "serving.keep_serving"),
    ({"base_model": {"repo": "x/y"}}, "base_model.repo"),
])
def test_unknown_fields_are_refused_at_every_level(kwargs, place) -> None:
    where, msg = _refusal(**kwargs)
    assert where == place and "Extra inputs are not permitted" in msg, (where, msg)


def test_the_groups_hold_the_demo_defaults() -> None:
    config = LifecycleConfig(serving={"keep_running": True}, freeze={"name": "demo-v2"})
    assert config.freeze.name == "demo-v2" and config.serving.keep_running is True
    assert config.registries.source_address == "127.0.0.1:5701"
    assert config.registries.target_address == "127.0.0.1:5702"
    assert (config.prewarm.shards, config.prewarm.lanes, config.prewarm.tag_cap, config.prewarm.concurrency) \
        == (8, 2, 100, 5)
    assert (config.validation.concurrency, config.validation.verifier_timeout_s, config.validation.memory_mb) \
        == (2, 180.0, None)  # None: no sandbox block in the lifecycle, so the default 2048 MiB
    assert config.validation.validation().memory_mb == 2048
    assert config.serving.ports == (8801, 8802) and config.serving.block is None
    assert config.package.quantizations == ("Q8_0", "Q4_K_M") and config.serving.quantization == "Q8_0"


def test_what_the_stages_pass_to_their_tasks_is_unchanged_for_the_demo_defaults() -> None:
    """The objects the lifecycle hands its cached tasks (Prefect keys them by class and fields) are the
    same classes with the same values as those the flat config made: a demo home keeps its cache."""
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.evaluation.agent_config import AgentConfig
    from forgeflow.evaluation.compare.gate import GatePolicy
    from forgeflow.registry.layout import ShardLayout
    from forgeflow.registry.migration import TransferLimits
    from forgeflow.sandbox.trial import ValidationChecks, ValidationSettings

    config = LifecycleConfig()
    made = {
        "quotas": (config.freeze.quotas, SplitQuotas(train=2, validation=1, test=2, max_per_repo=4, min_repos=2)),
        "gate": (config.promotion, GatePolicy(max_drop=0.05, alpha=0.05, min_pairs=30, min_repos=3,
                                              max_wall_s_ratio=1.5, max_input_tokens_ratio=1.25,
                                              max_agent_steps_ratio=1.25)),
        "layout": (config.prewarm.layout(), ShardLayout(shards=8, lanes=2, tag_cap=100)),
        "canary run": (config.canary, CanaryRunSettings(concurrency=1, agent_config=AgentConfig(
            step_limit=3, max_tokens=96, agent_timeout_s=300.0, seed=0), verifier_timeout_s=180.0)),
        "burst": (config.burst, BurstConfig(max_steps=4, learning_rate=1e-3, lora_r=8, max_length=4096, seed=0)),
        "transfer": (config.registries.transfer, TransferLimits(max_size_bytes=2_000_000_000)),
        "checks": (config.validation.checks, ValidationChecks()),
        "validation": (config.validation.validation(), ValidationSettings(memory_mb=2048, cpus=1.0,
                                                                           verifier_timeout_s=180.0)),
    }
    for name, (now, flat) in made.items():
        assert type(now) is type(flat), name
        assert now.model_dump(mode="json") == flat.model_dump(mode="json"), name


def test_the_stage_groups_are_the_stage_flows_models_with_the_demos_values_and_the_runs_seed() -> None:
    """``validation`` is the curate flow's ``params.settings``, ``burst`` the sft-burst flow's ``params.training`` and
    ``canary`` the canary flow's ``params.run``, so a
    knob has one name from the lifecycle's form to the trainer; what the input leaves out is the demo's value, and
    the run's seed is theirs (the form sends every nested default, so a nested 0 cannot mean "mine")."""
    config = LifecycleConfig(seed=7, burst={"lora_r": 16, "seed": 0, "batch_size": 2},
                             canary={"concurrency": 2, "sample": 3, "agent_config": {"step_limit": 2, "seed": 0}})
    assert type(config.burst) is BurstConfig and type(config.canary) is CanaryRunSettings
    assert type(config.validation) is CurateSettings
    assert (config.validation.concurrency, config.validation.seed, config.validation.batch_size) == (2, 7, 40)
    mine = LifecycleConfig(seed=7, validation={"concurrency": 3, "memory_mb": 512, "seed": 0}).validation
    assert (mine.concurrency, mine.memory_mb, mine.seed) == (3, 512, 7)
    assert (config.burst.lora_r, config.burst.lora_alpha, config.burst.batch_size) == (16, 32, 2)
    assert (config.burst.max_steps, config.burst.max_length, config.burst.seed) == (4, 4096, 7)  # demo's, run's
    agent = config.canary.agent_config
    assert (agent.step_limit, agent.max_tokens, agent.agent_timeout_s, agent.seed) == (2, 96, 300.0, 7)
    assert (config.canary.concurrency, config.canary.sample) == (2, 3)
    # a model instance passes too, its set fields over the demo's values
    assert LifecycleConfig(burst=BurstConfig(max_steps=1)).burst.max_length == 4096
    assert LifecycleConfig(seed=3).model_dump() == LifecycleConfig(**LifecycleConfig(seed=3).model_dump()).model_dump()


def test_freeze_inputs_keep_the_flat_keys_and_values_recorded_before_the_groups() -> None:
    """A demo home's ``freezes/NAME.inputs.json`` was written by the flat config: the grouped one must
    produce exactly that object for the same values, or a re-run would refuse its own freeze."""
    assert LifecycleConfig().freeze_inputs() == {
        "projects": ["boltons", "cachetools", "inflection", "six", "tabulate", "toolz"],
        "candidates_per_project": 5, "seed": 0,
        "validation": {"oracle_runs": 2, "flaky_policy": "reject", "log_parser": None},
        "train_min": 2, "validation_min": 1, "test_min": 2, "max_tasks_per_repo": 4, "min_repos": 2}
    other = LifecycleConfig(
        projects=("six", "toolz", "boltons", "tabulate"), candidates_per_project=7, seed=3, output_dir="elsewhere",
        validation={"concurrency": 4, "checks": {"oracle_runs": 3, "flaky_policy": "drop_flaky_pass_to_pass",
                                                 "log_parser": "parse_log_pytest"}},
        freeze={"name": "other-v1", "quotas": {"train": 3, "validation": 0, "test": 2, "max_per_repo": 5,
                                               "min_repos": 3}},
        canary={"concurrency": 2}, serving={"ports": (8901, 8902)})
    inputs = other.freeze_inputs()
    assert inputs == {
        "projects": ["six", "toolz", "boltons", "tabulate"], "candidates_per_project": 7, "seed": 3,
        "validation": {"oracle_runs": 3, "flaky_policy": "drop_flaky_pass_to_pass", "log_parser": "parse_log_pytest"},
        "train_min": 3, "validation_min": 0, "test_min": 2, "max_tasks_per_repo": 5, "min_repos": 3}
    assert tuple(inputs) == LifecycleConfig.FREEZE_INPUTS  # the order the flat config wrote them in
    # what does not decide the freeze's content is not recorded
    assert other.freeze_inputs() == other.model_copy(update={"canary": LifecycleConfig().canary}).freeze_inputs()
    # settings added since the flat config are recorded when they differ from their defaults (they change
    # which candidates validation accepts), and only then (older freezes keep matching)
    repeats = LifecycleConfig(validation={"checks": {"flaky_repeat_runs": 3}}).freeze_inputs()["validation"]
    assert repeats == {"oracle_runs": 2, "flaky_policy": "reject", "log_parser": None, "flaky_repeat_runs": 3}


def test_projects_that_cannot_fill_the_splits_are_refused_before_any_work() -> None:
    # 2 projects, 3 repository-disjoint splits (train, validation, test): refused when parsed, i.e.
    # before a flow run builds an image; the demo's defaults (6 projects) pass
    with pytest.raises(pydantic.ValidationError, match=r"freeze\.quotas cannot be met by 2 project\(s\) x 5 "
                                                         r"candidates .*repository-disjoint splits .*need 3, at "
                                                         r"most 2 possible"):
        LifecycleConfig(projects=("six", "toolz"))
    no_validation = {"quotas": {"train": 2, "validation": 0, "test": 2, "max_per_repo": 4, "min_repos": 2}}
    assert LifecycleConfig(projects=("six", "toolz"), freeze=no_validation).freeze.quotas.validation == 0
    with pytest.raises(pydantic.ValidationError, match="per-repository cap"):
        LifecycleConfig(candidates_per_project=1, freeze={"quotas": {"train": 4, "validation": 1, "test": 4,
                                                                     "max_per_repo": 4, "min_repos": 2}})
    assert LifecycleConfig().freeze.quotas.min_repos == 2


def test_metadata_edits_are_checked_when_the_config_is_parsed() -> None:
    config = LifecycleConfig(package={"metadata_edits": [{"op": "set", "key": "general.name", "value": "agent-v3"}]})
    assert config.package.metadata_edits[0].key == "general.name"
    where, msg = _refusal(package={"metadata_edits": [{"op": "delete", "key": "general.architecture"}]})
    assert where == "package.metadata_edits" and re.search(r"metadata_edits\[0\].*cannot delete 'general.architecture'", msg), msg
    where, msg = _refusal(package={"metadata_edits": [{"op": "set", "key": "general.name", "value": "x",
                                                       "artifacts": ["Q2_K"]}]})
    assert where == "package.metadata_edits" and "metadata_edits[0]" in msg, msg
    # an edit may name an artifact made with the quantizations it is packaged with, and only those
    edit = {"op": "set", "key": "general.name", "value": "x", "artifacts": ["Q4_K_M"]}
    assert LifecycleConfig(package={"metadata_edits": [edit]}).package.metadata_edits[0].artifacts == ("Q4_K_M",)
    where, msg = _refusal(package={"quantizations": ("Q8_0",), "metadata_edits": [edit]})
    assert where == "package.metadata_edits" and "metadata_edits[0]" in msg, msg
