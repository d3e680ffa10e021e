"""Typed parameters of the lifecycle (the demo's embedded defaults).

Every field carries its unit and a description; the Prefect flows take these models as
parameters, so the UI renders them as a form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.curation.freeze import SplitQuotas, feasibility_text, quota_feasibility
from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.packaging.checkpoint import BaseModelSource
from forgeflow.packaging.gguf_metadata import MetadataEdit
from forgeflow.sandbox.trial import ValidationChecks

DEMO_PROJECTS = ("boltons", "cachetools", "inflection", "six", "tabulate", "toolz")


class LifecycleConfig(BaseModel):
    """Parameters of one lifecycle run (defaults = the demo on this machine).

    Checked as a whole before any stage runs: unknown fields are refused (a typo never falls back
    to a default), numbers are finite, the freeze name follows :func:`forgeflow.curation.freeze.validate_freeze_name`,
    the served quantization is one of those packaged, the two registry ports and the two serving
    ports are four distinct ports, and ``lanes <= shards``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    projects: tuple[str, ...] = Field(DEMO_PROJECTS, description="pinned projects (forgeflow/data/projects.json)")
    candidates_per_project: int = Field(5, ge=1, le=200, description="SWE-smith candidates kept per project")
    seed: int = Field(0, description="seed for candidate choice, splits and training")
    output_dir: Path = Field(Path(".forgeflow/demo"), description="where results and summary.json go")
    source_port: int = Field(5701, ge=1024, le=65535, description="loopback port of the source registry")
    target_port: int = Field(5702, ge=1024, le=65535, description="loopback port of the target registry")
    max_image_size_bytes: int = Field(2_000_000_000, ge=1, description="migration skips images above this size")
    shards: int = Field(8, ge=1, description="shard repositories (task-00..)")
    lanes: int = Field(2, ge=1, description="base lanes: repositories a base image's tasks spread over")
    tag_cap: int = Field(100, ge=1, description="maximum tags per shard repository")
    prewarm_concurrency: int = Field(5, ge=1, le=16, description="basecache tags copied at once")
    validate_concurrency: int = Field(2, ge=1, le=16, description="NOP/Oracle trials run at once")
    verifier_timeout_s: float = Field(180.0, gt=0, description="absolute timeout of one test run")
    sandbox_memory_mb: int = Field(2048, ge=64, description="memory limit of a trial container")
    validation: ValidationChecks = Field(ValidationChecks(), description="evidence a validation gathers: "
                                         "Oracle runs per task that would be accepted, flaky policy, log parser")
    freeze_name: str = Field("demo-v1", description="name of the frozen dataset (immutable)")
    train_min: int = Field(2, ge=1, description="freeze quota: minimum train tasks")
    validation_min: int = Field(1, ge=0, description="freeze quota: minimum validation tasks (0: no validation split)")
    test_min: int = Field(2, ge=1, description="freeze quota: minimum test tasks")
    max_tasks_per_repo: int = Field(4, ge=1, description="freeze quota: per-repository cap")
    min_repos: int = Field(2, ge=1, description="freeze quota: repositories overall (split shares in proportion)")
    agent_step_limit: int = Field(3, ge=1, description="mini-swe-agent steps per canary trial")
    agent_max_tokens: int = Field(96, ge=1, description="completion tokens per model call")
    agent_timeout_s: float = Field(300.0, gt=0, description="wall-clock budget of one agent run")
    canary_concurrency: int = Field(1, ge=1, le=4, description="agent trials at once (at most 4)")
    base_model: BaseModelSource = Field(BaseModelSource(), description="the base checkpoint: empty = the demo's "
                                        "tiny model; local_dir = a checkpoint folder; repo_id + revision = an HF Hub "
                                        "repository (token from the Secret block token_secret)")
    burst_max_steps: int = Field(4, ge=1, description="optimizer steps of the SFT burst")
    burst_learning_rate: float = Field(1e-3, gt=0, description="LoRA learning rate")
    lora_r: int = Field(8, ge=1, description="LoRA rank")
    burst_max_length: int = Field(4096, ge=64, description="tokens per SFT sample (mini-swe-agent prompts are long)")
    promotion_max_drop: float = Field(0.05, ge=0, le=1, description="promotion gate: largest tolerated "
                                      "drop in pass rate (non-inferiority margin)")
    promotion_alpha: float = Field(0.05, gt=0, le=0.5, description="promotion gate: significance level")
    promotion_min_pairs: int = Field(30, ge=1, description="promotion gate: fewest pairs (tasks scored by both "
                                     "models) for a verdict other than hold")
    promotion_min_repos: int = Field(3, ge=1, description="promotion gate: fewest repositories those pairs come from")
    promotion_max_wall_s_ratio: float | None = Field(1.5, gt=0, description="promotion gate: largest mean wall "
                                                     "seconds per trial, candidate / baseline (None: not checked)")
    promotion_max_input_tokens_ratio: float | None = Field(1.25, gt=0, description="promotion gate: largest mean "
                                                           "input tokens per trial, candidate / baseline")
    promotion_max_agent_steps_ratio: float | None = Field(1.25, gt=0, description="promotion gate: largest mean "
                                                          "agent steps per trial, candidate / baseline")
    serve_ports: tuple[int, int] = Field((8801, 8802), description="blue/green ports of the model server")
    serving_block: str | None = Field(None, description="a forgeflow-serving block (llama-cpp-python or "
                                      "llama-server: context, slots, KV cache type, GPU offload); its ports "
                                      "are replaced by serve_ports; None: llama-cpp-python, 4,096 tokens")
    quantizations: tuple[str, ...] = Field(("Q8_0", "Q4_K_M"),
                                           description="GGUF quantizations (names of gguf.QUANT_PLANS)")
    metadata_edits: tuple[MetadataEdit, ...] = Field((), description="GGUF metadata set/add/delete edits applied "
                                                     "to the candidate's GGUFs after their check (package flow's)")
    serve_quantization: str = Field("Q8_0", description="which quantization is served")
    keep_serving: bool = Field(False, description="leave the model server running after the run")

    FREEZE_INPUTS: ClassVar[tuple[str, ...]] = (
        "projects", "candidates_per_project", "seed", "train_min", "validation_min", "test_min",
        "max_tasks_per_repo", "min_repos", "validation")
    """The fields that decide what the lifecycle freezes (candidates generated, split quotas)."""

    def freeze_inputs(self) -> dict[str, Any]:
        """The :attr:`FREEZE_INPUTS` of this config as JSON-able values (recorded beside the
        freeze; :func:`forgeflow.curation.freeze.check_freeze_inputs`)."""
        return self.model_dump(mode="json", include=set(self.FREEZE_INPUTS))

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

    @field_validator("freeze_name")
    @classmethod
    def _freeze_name(cls, value: str) -> str:
        from forgeflow.curation.freeze import validate_freeze_name

        return validate_freeze_name(value)

    @field_validator("quantizations")
    @classmethod
    def _known_quantizations(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from forgeflow.packaging.gguf import QUANT_PLANS

        if not value:
            raise ValueError("at least one quantization type is needed")
        unknown = [q for q in value if q not in QUANT_PLANS]
        if unknown:
            raise ValueError(f"unknown quantization type(s) {unknown}; known: {sorted(QUANT_PLANS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"quantizations repeat a type: {list(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "LifecycleConfig":
        if self.serve_quantization not in self.quantizations:
            raise ValueError(f"serve_quantization {self.serve_quantization!r} is not among quantizations "
                             f"{list(self.quantizations)}")
        for port in self.serve_ports:
            if not 1024 <= port <= 65535:
                raise ValueError(f"serve_ports must be in 1024..65535, got {list(self.serve_ports)}")
        ports = [self.source_port, self.target_port, *self.serve_ports]
        if len(set(ports)) != len(ports):
            raise ValueError(f"source_port, target_port and serve_ports must be four distinct ports, got {ports}")
        from forgeflow.packaging.gguf_metadata import validate_metadata_edits

        validate_metadata_edits(self.metadata_edits, ("f16", *self.quantizations))  # InputError names the edit
        if self.lanes > self.shards:
            raise ValueError(f"lanes ({self.lanes}) cannot exceed shards ({self.shards})")
        # before any image is built: projects x candidates_per_project bound what validation can accept
        unmet = quota_feasibility({p: self.candidates_per_project for p in self.projects}, self.quotas)
        if unmet:
            raise ValueError(f"the freeze quotas cannot be met by {len(self.projects)} project(s) x "
                             f"{self.candidates_per_project} candidates even if every candidate is accepted: "
                             f"{feasibility_text(unmet)}")
        return self

    @property
    def quotas(self) -> SplitQuotas:
        """The freeze quotas (``train_min``, ``validation_min``, ``test_min``, ``max_tasks_per_repo``,
        ``min_repos``)."""
        return SplitQuotas(train=self.train_min, validation=self.validation_min, test=self.test_min,
                           max_per_repo=self.max_tasks_per_repo, min_repos=self.min_repos)

    @property
    def gate_policy(self) -> GatePolicy:
        """The promotion gate's settings (the ``promotion_*`` fields) as a
        :class:`forgeflow.evaluation.compare.gate.GatePolicy`."""
        return GatePolicy(max_drop=self.promotion_max_drop, alpha=self.promotion_alpha,
                          min_pairs=self.promotion_min_pairs, min_repos=self.promotion_min_repos,
                          max_wall_s_ratio=self.promotion_max_wall_s_ratio,
                          max_input_tokens_ratio=self.promotion_max_input_tokens_ratio,
                          max_agent_steps_ratio=self.promotion_max_agent_steps_ratio)

    @property
    def source_address(self) -> str:
        """``127.0.0.1:PORT`` of the source registry."""
        return f"127.0.0.1:{self.source_port}"

    @property
    def target_address(self) -> str:
        """``127.0.0.1:PORT`` of the target registry."""
        return f"127.0.0.1:{self.target_port}"
