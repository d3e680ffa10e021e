"""Typed parameters of the lifecycle (the demo's embedded defaults).

:class:`LifecycleConfig` keeps the run's identity at its top level and one typed group per stage; a stage
flow's or the core's parameter model is reused where one exists, and each group builds the core object its
stage passes to its tasks. Unknown fields are refused at every level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.freeze import FreezeName, SplitQuotas, feasibility_text, quota_feasibility
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.canary_params import CanaryRunSettings
from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.packaging.checkpoint import BaseModelSource
from forgeflow.packaging.gguf import QuantSpec, quant_plan
from forgeflow.packaging.gguf_metadata import MetadataEdit, validate_metadata_edits
from forgeflow.registry.layout import ShardLayout
from forgeflow.registry.migration import TransferLimits
from forgeflow.training.burst import BurstConfig

DEMO_PROJECTS = ("boltons", "cachetools", "inflection", "six", "tabulate", "toolz")

DEMO_QUOTAS = SplitQuotas(train=2, validation=1, test=2, max_per_repo=4, min_repos=2)
"""The demo's freeze quotas: a few tasks per split from at least two repositories."""

DEMO_VL_SERVING_BLOCK = "forgeflow-demo-tiny-vl"
"""Name of the ``forgeflow-serving`` block the ``tiny-vl`` demo profile saves and serves with
(``forgeflow demo --base-model tiny-vl``): llama-server with :data:`DEMO_VL_SERVING`."""

DEMO_VL_SERVING: dict[str, Any] = {
    "kind": "llama-server", "n_ctx": 4096, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}
"""The ``tiny-vl`` demo's llama-server options: the seeds' ``-ctk q8_0 -ctv q8_0 -fa on`` and a 4,096-token
context as the text demo's. The projector (``mmproj``) is not here: each serve stage passes the one its
package run wrote. No ``image_min_tokens``: the tiny model's image takes llama-server's default budget (a team's
block sets the seeds' 1,024 beside its projector-less options; a server started without a projector refuses it)."""

DEMO_PROFILES = ("tiny", "tiny-vl")
"""The demo's base-model profiles: the tiny text model (the default) and the tiny multimodal one."""


def demo_profile(base_model: str) -> dict[str, Any]:
    """The :class:`LifecycleConfig` fields a demo profile sets (``forgeflow demo --base-model``).

    ``{}`` for ``"tiny"``; for ``"tiny-vl"``: ``base_model`` and ``serving.block`` (:data:`DEMO_VL_SERVING_BLOCK`,
    which the caller saves first).

    Raises:
        ValueError: an unknown profile (the known ones listed).
    """
    if base_model not in DEMO_PROFILES:
        raise ValueError(f"unknown demo profile {base_model!r}; known: {', '.join(DEMO_PROFILES)}")
    if base_model == "tiny":
        return {}
    return {"base_model": base_model, "serving": {"block": DEMO_VL_SERVING_BLOCK}}

_GROUP = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class RegistrySettings(BaseModel):
    """The two registries (the team's, or embedded loopback ones) and how the migrate stage copies between them."""

    model_config = _GROUP

    source_port: int = Field(5701, ge=1024, le=65535, description="loopback port of the source registry")
    target_port: int = Field(5702, ge=1024, le=65535, description="loopback port of the target registry")
    source_block: str | None = Field(None, min_length=1, description="a forgeflow-registry block for the source "
                                     "registry (None: the embedded one on source_port)")
    target_block: str | None = Field(None, min_length=1, description="a forgeflow-registry block for the target "
                                     "registry (None: the embedded one on target_port)")
    transfer: TransferLimits = Field(TransferLimits(), description="how the migrate stage copies: images above "
                                     "max_size_bytes are skipped; images at once, per second, retry delays")

    @property
    def source_address(self) -> str:
        """``127.0.0.1:PORT`` of the embedded source registry."""
        return f"127.0.0.1:{self.source_port}"

    @property
    def target_address(self) -> str:
        """``127.0.0.1:PORT`` of the embedded target registry."""
        return f"127.0.0.1:{self.target_port}"


class PrewarmSettings(BaseModel):
    """The shard layout of the task images and how fast basecache tags are copied."""

    model_config = _GROUP

    shards: int = Field(8, ge=1, le=10_000, description="shard repositories (task-00..)")
    lanes: int = Field(2, ge=1, description="base lanes: repositories a base image's tasks spread over")
    tag_cap: int = Field(100, ge=1, description="maximum tags per shard repository")
    concurrency: int = Field(5, ge=1, le=16, description="basecache tags copied at once")

    @model_validator(mode="after")
    def _lanes_within_shards(self) -> "PrewarmSettings":
        if self.lanes > self.shards:
            raise ValueError(f"lanes ({self.lanes}) cannot exceed shards ({self.shards})")
        return self

    def layout(self, namespace: str = "") -> ShardLayout:
        """The ``base-sharded-tags`` layout: prefix ``task``, or ``<namespace>/task`` in a namespaced target."""
        namespace = namespace.strip("/")
        prefix = f"{namespace}/task" if namespace else "task"
        return ShardLayout(shards=self.shards, lanes=self.lanes, tag_cap=self.tag_cap, prefix=prefix)


class FreezeSettings(BaseModel):
    """The frozen dataset: its (immutable) name and the quotas its splits must meet.

    The lifecycle needs a train split (the burst) and a test split (the canaries); ``validation`` 0: none.
    """

    model_config = _GROUP

    name: FreezeName = Field("demo-v1", description="name of the frozen dataset (immutable)")
    quotas: SplitQuotas = Field(DEMO_QUOTAS, description="minimum train/validation/test tasks (validation 0: no "
                                "validation split), per-repository cap, repositories overall")

    @field_validator("quotas")
    @classmethod
    def _train_and_test(cls, value: SplitQuotas) -> SplitQuotas:
        for split, why in (("train", "the burst trains on it"), ("test", "the canaries run on it")):
            if value.target(split) < 1:
                raise ValueError(f"quotas.{split} must be at least 1 ({why}), got {value.target(split)}")
        return value


DEMO_BURST: dict[str, Any] = {"max_steps": 4, "max_length": 4096}
"""The lifecycle's SFT burst values where its ``burst`` leaves them out: 4 optimizer steps and 4,096 tokens per sample
(an Oracle sample of the demo's tasks is longer than :class:`~forgeflow.training.burst.BurstConfig`'s 2,048, and a
longer sample is refused); every other value is BurstConfig's own."""

DEMO_VALIDATION: dict[str, Any] = {"concurrency": 2}
"""The lifecycle's validation values where its ``validation`` leaves them out: 2 NOP/Oracle validations at once on
this machine's two cores; every other value is :class:`~forgeflow.curation.curate_settings.CurateSettings`' own
(no sandbox block: ``memory_mb`` / ``cpus`` left None are the defaults, 2,048 MiB and 1 CPU)."""

DEMO_AGENT: dict[str, Any] = {"step_limit": 3, "max_tokens": 96, "agent_timeout_s": 300.0}
"""The lifecycle's canary agent values where its ``canary.agent_config`` leaves them out: a few short steps on this
machine's CPU; every other value is :class:`~forgeflow.evaluation.agent_config.AgentConfig`'s own."""


def _given(value: Any) -> Any:
    """The fields a caller set: a model's set fields as a dict, a dict as is (anything else is left for pydantic
    to refuse by name)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return {} if value is None else value


def _over(defaults: dict[str, Any], value: Any, **fixed: Any) -> Any:
    """``defaults``, then what ``value`` sets, then ``fixed``; a ``value`` that is no dict or model: as is."""
    given = _given(value)
    return {**defaults, **given, **fixed} if isinstance(given, dict) else given


class PackageSettings(BaseModel):
    """What the package stage makes of a checkpoint: GGUF quantizations and metadata edits (the lifecycle's
    ``package`` group; the ``package`` flow's parameters hold it too).

    Both are checked when the model is validated, before any compute, the field named: an unknown plan or preset,
    two artifacts with one key (:func:`~forgeflow.packaging.gguf.quant_plan`), an edit that does not fit
    (:func:`~forgeflow.packaging.gguf_metadata.validate_metadata_edits`, ``artifacts`` among ``f16`` and the
    quantizations' keys).
    """

    model_config = _GROUP

    quantizations: tuple[str | QuantSpec, ...] = Field(
        ("Q8_0", "Q4_K_M"), description="quantization plan: QUANT_PLANS names (Q8_0, Q4_K_M, "
                                        "Q4_K_M+attn-embd-output-Q8_0) and/or {preset, tensor_types, name} specs")
    metadata_edits: tuple[MetadataEdit, ...] = Field(
        (), description="GGUF metadata edits {op: set|add|delete, key, value, type, sub_type, artifacts}, applied "
                        "after every artifact passed its check and loaded")

    @field_validator("quantizations")
    @classmethod
    def _known_quantizations(cls, value: tuple[str | QuantSpec, ...]) -> tuple[str | QuantSpec, ...]:
        quant_plan(value)  # InputError (a ValueError): the unknown plan or preset, or the repeated key
        return value

    @field_validator("metadata_edits", mode="before")
    @classmethod
    def _edits_fit(cls, value: Any, info: ValidationInfo) -> Any:
        if "quantizations" not in info.data:  # refused already: the edits are checked without the artifact keys
            return validate_metadata_edits(value)
        return validate_metadata_edits(value, ("f16", *(s.key for s in quant_plan(info.data["quantizations"]))))

    @property
    def artifact_keys(self) -> tuple[str, ...]:
        """The keys of the quantized artifacts (``model-<key>.gguf``), in plan order; ``f16`` is not among them."""
        return tuple(spec.key for spec in quant_plan(self.quantizations))


class ServingSettings(BaseModel):
    """The model server: blue/green ports, its backend block, what it serves, whether it outlives the run."""

    model_config = _GROUP

    ports: tuple[int, int] = Field((8801, 8802), description="blue/green ports of the model server")
    block: str | None = Field(None, description="a forgeflow-serving block (llama-cpp-python or llama-server: "
                              "context, slots, KV cache type, GPU offload); its ports are replaced by ports; "
                              "None: llama-cpp-python, 4,096 tokens")
    quantization: str = Field("Q8_0", description="which quantization is served (one of package.quantizations)")
    keep_running: bool = Field(False, description="leave the model server running after the run")

    @field_validator("ports")
    @classmethod
    def _port_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not all(1024 <= port <= 65535 for port in value):
            raise ValueError(f"ports must be in 1024..65535, got {list(value)}")
        return value


class LifecycleConfig(BaseModel):
    """Parameters of one lifecycle run (defaults = the demo on this machine).

    Checked as a whole before any stage runs: unknown fields refused at every level, finite numbers, a valid
    freeze name, quotas the projects' candidates can meet, a served quantization that is packaged, four
    distinct registry and serving ports, and ``prewarm.lanes <= prewarm.shards``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    projects: tuple[str, ...] = Field(DEMO_PROJECTS, description="pinned projects (forgeflow/data/projects.json)")
    candidates_per_project: int = Field(5, ge=1, le=200, description="SWE-smith candidates kept per project")
    seed: int = Field(0, ge=0, description="seed for candidate choice, splits, sampling and training (it is "
                      "validation.seed, burst.seed and canary.agent_config.seed)")
    output_dir: Path = Field(Path(".forgeflow/demo"), description="where results and summary.json go")
    base_model: BaseModelSource = Field(BaseModelSource(), description="the base checkpoint: empty = the demo's "
                                        "tiny model; local_dir = a checkpoint folder; repo_id + revision = an HF Hub "
                                        "repository (token from the Secret block token_secret)")
    registries: RegistrySettings = Field(RegistrySettings(), description="registry ports and the migrate "
                                         "stage's transfer limits (image size, concurrency, rate, retries)")
    prewarm: PrewarmSettings = Field(PrewarmSettings(), description="shard layout (shards, lanes, tag cap) and "
                                     "basecache tags copied at once")
    validation: CurateSettings = Field(CurateSettings(**DEMO_VALIDATION), description="the curate flow's "
                                       "params.settings: candidates per batch, NOP/Oracle trials at once, retries, "
                                       "verifier timeout, container memory and CPUs, evidence checks; its seed is seed")
    freeze: FreezeSettings = Field(FreezeSettings(), description="name and split quotas of the frozen dataset")
    canary: CanaryRunSettings = Field(CanaryRunSettings(agent_config=AgentConfig(**DEMO_AGENT)),
                                      description="the canary flow's params.run: agent trials at once, the agent's "
                                      "limits (agent_config), verifier timeout, sample; agent_config.seed is seed")
    burst: BurstConfig = Field(BurstConfig(**DEMO_BURST), description="the sft-burst flow's params.training (steps, "
                               "learning rate, LoRA, tokens per sample, batch, health gates, device); its seed is seed")
    package: PackageSettings = Field(PackageSettings(), description="GGUF quantizations and metadata edits")
    promotion: GatePolicy = Field(GatePolicy(), description="promotion gate: largest tolerated drop, significance "
                                  "level, fewest pairs and repositories, largest cost ratios candidate / baseline")
    serving: ServingSettings = Field(ServingSettings(), description="model server ports, backend block, served "
                                     "quantization, keep it running")

    FREEZE_INPUTS: ClassVar[tuple[str, ...]] = (
        "projects", "candidates_per_project", "seed", "validation", "train_min", "validation_min", "test_min",
        "max_tasks_per_repo", "min_repos")
    """The recorded names of the inputs that decide what the lifecycle freezes (candidates generated,
    validation evidence, split quotas); flat, as a freeze's ``NAME.inputs.json`` has them since before
    the config was grouped."""

    def freeze_inputs(self) -> dict[str, Any]:
        """The :attr:`FREEZE_INPUTS` of this config as JSON-able values (recorded beside the freeze).

        Keys and values are those of the flat config that preceded the groups, so a freeze recorded before still
        matches a run with the same values.
        """
        quotas = self.freeze.quotas
        identity = self.model_dump(mode="json", include={"projects", "candidates_per_project", "seed"})
        checks = self.validation.checks
        # settings added since (the flaky-gold repeats, the NOP repeats) are recorded only when they differ
        # from their defaults, so a freeze recorded before them still matches a run with the same values
        later = {k for k in ("flaky_repeat_runs", "flaky_sample_pass_to_pass_tests", "nop_runs",
                             "flaky_sample_fail_to_pass_tests")
                 if getattr(checks, k) == type(checks).model_fields[k].default}
        inputs = {**identity, "validation": checks.model_dump(mode="json", exclude=later),
                  "train_min": quotas.train, "validation_min": quotas.validation, "test_min": quotas.test,
                  "max_tasks_per_repo": quotas.max_per_repo, "min_repos": quotas.min_repos}
        return inputs

    @model_validator(mode="before")
    @classmethod
    def _stage_values(cls, data: Any) -> Any:
        """``validation``, ``burst`` and ``canary.agent_config``: :data:`DEMO_VALIDATION` / :data:`DEMO_BURST` /
        :data:`DEMO_AGENT` where the input leaves a value out, and the run's ``seed`` always (Prefect's run form
        sends every nested default, so the run's seed cannot be told apart from a nested one left at 0: the run's
        wins)."""
        if not isinstance(data, dict):
            return data
        seed = data.get("seed", 0)
        canary = _given(data.get("canary"))
        if isinstance(canary, dict):
            canary = {**canary, "agent_config": _over(DEMO_AGENT, canary.get("agent_config"), seed=seed)}
        return {**data, "validation": _over(DEMO_VALIDATION, data.get("validation"), seed=seed),
                "burst": _over(DEMO_BURST, data.get("burst"), seed=seed), "canary": canary}

    @field_validator("projects")
    @classmethod
    def _known_projects(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from forgeflow.registry.projects import load_projects

        known = {p.name for p in load_projects()}
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown project(s) {unknown}; pinned projects: {', '.join(sorted(known))}")
        if not value:
            raise ValueError("at least one project is needed")
        if len(set(value)) != len(value):
            raise ValueError(f"projects repeat a name: {list(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "LifecycleConfig":
        if self.serving.quantization not in self.package.artifact_keys:
            raise ValueError(f"serving.quantization {self.serving.quantization!r} is not among "
                             f"package.quantizations {list(self.package.artifact_keys)}")
        registries = self.registries
        embedded = [port for port, block in ((registries.source_port, registries.source_block),
                                             (registries.target_port, registries.target_block)) if block is None]
        ports = [*embedded, *self.serving.ports]
        if len(set(ports)) != len(ports):
            raise ValueError("the embedded registries' ports (registries.source_port, registries.target_port) and "
                             f"serving.ports must be distinct, got {ports}")
        # before any image is built: projects x candidates_per_project bound what validation can accept
        unmet = quota_feasibility({p: self.candidates_per_project for p in self.projects}, self.freeze.quotas)
        if unmet:
            raise ValueError(f"freeze.quotas cannot be met by {len(self.projects)} project(s) x "
                             f"{self.candidates_per_project} candidates even if every candidate is accepted: "
                             f"{feasibility_text(unmet)}")
        return self
