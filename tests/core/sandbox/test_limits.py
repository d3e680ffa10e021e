"""One limits model: every model that sizes a sandbox has the same default and bound for memory and CPUs,
and a stage's own limit wins over its sandbox block's (the block fills in what the stage leaves None)."""

import pydantic
import pytest

from forgeflow.config import LifecycleConfig
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.harbor import HarborTaskLimits
from forgeflow.evaluation.sandbox_env import SandboxEnvironmentConfig
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.kubernetes_manifests import KubernetesSandboxSpec
from forgeflow.sandbox.limits import SandboxLimits
from forgeflow.sandbox.podman import PodmanSandbox
from forgeflow.sandbox.trial import ValidationSettings
from forgeflow.training.rl import RLBurstConfig

SIZED = {SandboxSpec: {}, ValidationSettings: {}, HarborTaskLimits: {},
         KubernetesSandboxSpec: {}, SandboxEnvironmentConfig: {"image": "img", "name": "ff-x"}}


def test_every_sandbox_sizing_model_has_one_default_and_one_bound() -> None:
    for model, required in SIZED.items():
        made = model(**required)
        assert (made.memory_mb, made.cpus) == (2048, 1.0), model
        assert model(**required, memory_mb=16).memory_mb == 16, model
        with pytest.raises(pydantic.ValidationError, match="greater than or equal to 16"):
            model(**required, memory_mb=15)
        with pytest.raises(pydantic.ValidationError, match="greater than 0"):
            model(**required, cpus=0)
    for overrides in (CurateSettings, AgentConfig):  # a stage's own limits: none set by default
        assert (overrides().memory_mb, overrides().cpus) == (None, None)
        with pytest.raises(pydantic.ValidationError, match="greater than or equal to 16"):
            overrides(memory_mb=15)
    assert RLBurstConfig().verifier_memory_mb is None  # the rl-burst verifier's: none set, the block's fill in
    assert RLBurstConfig().resolved().verifier_memory_mb == 1024  # else the RL verifier's own default, unchanged
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 16"):
        RLBurstConfig(verifier_memory_mb=15)


def test_a_stage_limit_wins_over_the_block_and_the_block_fills_in_the_rest() -> None:
    block = SandboxLimits(memory_mb=768, cpus=0.5)
    # curate: settings.memory_mb set, cpus left to the block -> podman gets 512 MiB and 0.5 CPUs
    validation = CurateSettings(memory_mb=512).validation(block)
    assert (validation.memory_mb, validation.cpus) == (512, 0.5)
    args = PodmanSandbox("img", SandboxSpec.of(validation), name="ff-x")._limit_args()
    assert args[args.index("--memory") + 1] == "512m" and args[args.index("--cpus") + 1] == "0.5"
    assert CurateSettings().validation(block).limits() == block  # nothing set: the block's
    assert CurateSettings().validation().limits() == SandboxLimits()  # no block: the defaults
    # canary: the agent config's own limits win, resolved once (what the job records)
    resolved = AgentConfig(cpus=2.0).resolved(block)
    assert (resolved.memory_mb, resolved.cpus) == (768, 2.0)
    assert AgentConfig().resolved().over() == SandboxLimits()
    # the lifecycle's validation group is the curate flow's settings; it names no block: the defaults
    stage = LifecycleConfig(validation={"cpus": 2.0}).validation
    assert type(stage) is CurateSettings and stage.validation().limits() == SandboxLimits(memory_mb=2048, cpus=2.0)


def test_every_verifier_timeout_has_one_bound_and_the_forgeflow_default() -> None:
    from flows.rescore import RescoreParams
    from forgeflow.evaluation.canary_params import CanaryRunSettings
    from forgeflow.evaluation.rescore import RescorePlan

    for model in (ValidationSettings, CurateSettings, CanaryRunSettings):
        field = model.model_fields["verifier_timeout_s"]
        assert field.default == 180.0, model
    for model in (ValidationSettings, CurateSettings, CanaryRunSettings, RescorePlan,
                  RescoreParams, HarborTaskLimits):  # RescorePlan: what ran; RescoreParams: None, the job's; Harbor: 600
        with pytest.raises(pydantic.ValidationError) as info:
            model(verifier_timeout_s=0)
        assert ("verifier_timeout_s",) in [e["loc"] for e in info.value.errors() if e["type"] == "greater_than"]
