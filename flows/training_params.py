"""The parameter models of the training flows: each flow takes one, ``params``, that holds all its inputs.

A run's ``params`` replaces its deployment's whole object (Prefect merges run parameters shallowly), so the
working defaults are these fields' defaults; the inputs a run must name are required fields.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from flows.stagekit import StageParams
from forgeflow.curation.task_rows import TaskSource
from forgeflow.training.burst import BurstConfig
from forgeflow.training.rl import RLBurstConfig
from forgeflow.training.verl import PPOJob, VerlPPOSettings
from forgeflow.training.windows import WindowConfig

_HF_DIR = "the base model folder (HF checkpoint with config.json, tokenizer and chat template)"
_PARENT = ("an adapter to continue: its folder, or its sha256 as recorded in the store (same base model and LoRA "
           "rank); null: a new adapter")
_OUT_DIR = ("models folder; null: $FORGEFLOW_HOME/models (trains in <out_dir>/{kind}-adapter, pins to "
            "<out_dir>/adapters/<sha256>)")


class SFTBurstParams(StageParams):
    """The ``sft-burst`` flow's parameters."""

    hf_dir: Path = Field(description=_HF_DIR)
    samples_jsonl: Path = Field(description="the chat samples: one {\"messages\": [...]} or {\"prompt\", "
                                            "\"completion\"} row per line (one format per file); a user turn may "
                                            "hold image parts {\"type\": \"image\", \"image\": <path relative "
                                            "to the JSONL, or the sha256 of a file beside it>} on an "
                                            "image-text-to-text base (tiny-vl)")
    training: BurstConfig = Field(default_factory=BurstConfig, description="the burst's hyper-parameters (each "
                                  "field described in the form)")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="sft"))


class RLBurstParams(StageParams):
    """The ``rl-burst`` flow's parameters: the tasks come from exactly one of ``tasks_jsonl`` and ``freeze_name``."""

    hf_dir: Path = Field(description=_HF_DIR)
    tasks_jsonl: Path | None = Field(None, description="the tasks: one RLTask row per line (instance_id, image_ref, "
                                     "problem_statement, test_command, FAIL_TO_PASS, PASS_TO_PASS; optional "
                                     "task_timeout_s (seconds, default 3000), pristine_duration_s (seconds) and "
                                     "known_tests); null: the tasks of freeze_name")
    freeze_name: str | None = Field(None, min_length=1, description="instead of tasks_jsonl: a freeze recorded in "
                                    "the store; the burst trains on its split, each task with the test lists, known "
                                    "tests and pristine duration its validation recorded")
    split: str = Field("train", min_length=1, description="the freeze's split the burst trains on (with freeze_name)")
    source: TaskSource = Field(TaskSource(), description="the freeze's task rows (with freeze_name): candidates_path, "
                               "dataset or generated_path (default $FORGEFLOW_HOME/demo/candidates.jsonl), "
                               "test_commands and test_specs per repository")
    training: RLBurstConfig = Field(default_factory=RLBurstConfig, description="the burst's hyper-parameters, "
                                    "verifier limits and agentic mode (episode; each field described in the form)")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    sandbox: str | None = Field(None, min_length=1, description="a forgeflow-sandbox block: the verifier runs on "
                                "its backend with its memory (MiB) and CPU limits; null: podman, 1024 MiB, 1 CPU")
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="rl"))
    dispatcher: str | None = Field(None, min_length=1, description="a forgeflow-dispatcher block: ray scores each "
                                   "rollout as a Ray task on a sandbox node; null or in-process: here")

    @model_validator(mode="after")
    def _one_task_source(self) -> RLBurstParams:
        if (self.tasks_jsonl is None) == (self.freeze_name is None):
            raise ValueError("give tasks_jsonl (a JSONL of RLTask rows) or freeze_name (a freeze recorded in the "
                             "store, with split and source), not both and not neither")
        return self


class PPOParams(StageParams):
    """The ``ppo`` flow's parameters."""

    settings: VerlPPOSettings = Field(description="verl's PPO settings (model_path, train_files, val_files, batch "
                                      "sizes, learning rates, lora_rank > 0, checkpoint_dir readable here, ...)")
    job: PPOJob = Field(description="the Ray cluster (dashboard_url) and the job: working_dir, pip, entrypoint, "
                                    "poll_s and timeout_s (seconds), adapter_glob, base_model_sha256")
    submission_id: str | None = Field(None, min_length=1, description="the Ray job's id; null: "
                                                                      "forgeflow-ppo-<flow run id>")
    out_dir: Path | None = Field(None, description="models folder; null: $FORGEFLOW_HOME/models (the adapter is "
                                                   "pinned to <out_dir>/adapters/<sha256>)")


class WindowsParams(StageParams):
    """The ``windows`` flow's parameters: exactly one of ``job_id`` and ``trajectories_dir``."""

    job_id: str | None = Field(None, min_length=1, description="a canary (or recovery) job recorded in the store")
    trajectories_dir: Path | None = Field(None, description="a folder of mini-swe-agent *.traj.json instead of "
                                                            "job_id")
    windows: WindowConfig = Field(WindowConfig(), description="window layout and kinds: replay_steps, "
                                  "stride_steps, min_steps (steps), task_excerpt_chars, recap_command_chars "
                                  "(characters), loop_threshold, loop_variants, conclude_command, include_system")
    samples_jsonl: Path | None = Field(None, description="where the JSONL goes (a file there with other samples "
                                                         "is refused; the images its windows keep go beside it as "
                                                         "<sha256>.<ext>); null: $FORGEFLOW_HOME/windows/<job id "
                                                         "or folder>-<sha12>.jsonl, named by its content")
    hf_dir: Path | None = Field(None, description="the base model an SFT burst on the windows trains (the "
                                                  "sft-burst flow as a subflow); null: only the dataset")
    training: BurstConfig = Field(default_factory=BurstConfig, description="the burst's hyper-parameters, as "
                                  "sft-burst's params.training")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="sft"))

    @model_validator(mode="after")
    def _one_source(self) -> WindowsParams:
        if (self.job_id is None) == (self.trajectories_dir is None):
            raise ValueError("give job_id (a canary job in the store) or trajectories_dir (a folder of "
                             "*.traj.json), not both or neither")
        return self
