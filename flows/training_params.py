"""The parameter models of the training flows: each flow takes one, ``params`` (a
:class:`flows.stagekit.StageParams`), that holds all its inputs.

* ``sft-burst``: :class:`SFTBurstParams` (base model, samples, ``training``: :class:`SFTHyperParams`,
  parent adapter, output folder);
* ``rl-burst``: :class:`RLBurstParams` (base model, tasks, ``training``: :class:`RLHyperParams`, parent
  adapter, ``sandbox`` and ``dispatcher`` blocks, output folder);
* ``ppo``: :class:`PPOParams` (verl's ``settings``, the Ray ``job``: :class:`PPOJob`, submission id,
  output folder);
* ``windows``: :class:`WindowsParams` (a canary job or a trajectories folder, the ``windows`` layout, the
  JSONL path and, to train on it, what ``sft-burst`` takes).

A run's ``params`` replaces its deployment's whole object (Prefect merges run parameters shallowly), so
the working defaults are these fields' defaults; the inputs a run must name (``hf_dir``, ``samples_jsonl``,
...) are required fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows.stagekit import StageParams
from forgeflow.curation.task_rows import TaskSource
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.training.burst import BurstConfig
from forgeflow.training.episodes import EpisodeSettings
from forgeflow.training.freeze_tasks import FreezeSplit
from forgeflow.training.ppo import DEFAULT_ADAPTER_GLOB
from forgeflow.training.rl import RLBurstConfig
from forgeflow.training.verl import VerlPPOSettings
from forgeflow.training.windows import WindowConfig

Device = Literal["auto", "cpu", "cuda"]
"""Where a burst trains: ``auto`` (CUDA in bfloat16 when the worker has a GPU, else the CPU in float32),
``cpu`` or ``cuda`` (:func:`forgeflow.training.device.device_plan`)."""


class SFTHyperParams(BaseModel):
    """Hyper-parameters of an SFT burst (the common subset of :class:`BurstConfig`).

    Attributes:
        max_steps: optimizer steps.
        learning_rate: constant learning rate (no warm-up).
        lora_r: LoRA rank; a continued adapter must have the same rank.
        max_length: tokens per sample and per packed row; a longer sample is refused, not truncated.
        batch_size: rows per optimizer step (packed rows of ``max_length`` tokens; unpacked: samples).
            Tokens per step = ``batch_size`` x ``max_length`` at most; on a GPU more rows per step
            use it better (the GPU check measures 16 rows of 2,048 tokens).
        seed: training and data-order seed.
        device: ``auto``, ``cpu`` or ``cuda`` (:data:`Device`); the lineage records what was used.
        packing: True: TRL's bfd packing of whole samples into rows of ``max_length`` tokens,
            padding-free batches; False: one sample per row, padded. The lineage records it.
        gradient_checkpointing: recompute activations in the backward pass (less GPU memory, more
            compute); None: decided by the machine (on CUDA only when a step's activations would not fit
            the GPU's free memory, :func:`forgeflow.training.burst.resolve_checkpointing`; off on the
            CPU). The lineage records what was used.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(2, ge=1, le=100_000, description="optimizer steps")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0, description="constant learning rate (no warm-up)")
    lora_r: int = Field(8, ge=1, le=256, description="LoRA rank (lora_alpha = 2 x rank); a continued adapter "
                                                     "must have the same rank")
    max_length: int = Field(2048, ge=16, le=131_072, description="tokens per sample and per packed row; a longer "
                                                                 "sample is refused, not truncated (the windows "
                                                                 "flow's default layout makes windows of about "
                                                                 "1,300-1,500 tokens)")
    batch_size: int = Field(1, ge=1, le=4096, description="rows per optimizer step: packed rows of max_length "
                                                          "tokens (unpacked: samples)")
    seed: int = Field(0, description="training and data-order seed")
    device: Device = Field("auto", description="auto: CUDA in bfloat16 when the worker has a GPU, else the CPU in "
                                               "float32; cpu; or cuda (refused where CUDA is not available)")
    packing: bool = Field(True, description="true: bfd packing of whole samples into rows of max_length tokens, "
                                            "padding-free batches; false: one sample per row, padded")
    gradient_checkpointing: bool | None = Field(None, description="recompute activations in the backward pass "
                                                "(less GPU memory, more compute); null: decided by the machine (on "
                                                "CUDA only when a step's activations would not fit the GPU's "
                                                "free memory; off on the CPU)")

    def burst_config(self) -> BurstConfig:
        """The :class:`BurstConfig` these hyper-parameters stand for (other fields at their defaults)."""
        return BurstConfig(max_steps=self.max_steps, learning_rate=self.learning_rate, lora_r=self.lora_r,
                           lora_alpha=2 * self.lora_r, max_length=self.max_length,
                           per_device_train_batch_size=self.batch_size, seed=self.seed,
                           device=self.device, packing=self.packing,
                           gradient_checkpointing=self.gradient_checkpointing)


class RLHyperParams(BaseModel):
    """Hyper-parameters of an RL burst (the common subset of :class:`RLBurstConfig`).

    Attributes:
        algorithm: ``grpo`` or ``rloo`` (TRL trainers).
        max_steps: optimizer steps.
        learning_rate: constant learning rate.
        lora_r: LoRA rank; a continued adapter must have the same rank.
        num_generations: completions sampled per prompt (the group), >= 2.
        max_completion_length: tokens per completion.
        seed: training and sampling seed.
        verifier_timeout_multiplier: the training verifier's timeout = each task's original per-task
            timeout (``task_timeout_s``, default SWE-smith's 3000 s) x this, never below 5 x its recorded
            pristine run (:func:`forgeflow.training.rewards.training_timeout_s`); curation's timeout plays no part.
        verifier_concurrency: verifier sandboxes at once.
        device: as :class:`SFTHyperParams`'.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: Literal["grpo", "rloo"] = Field("grpo", description="grpo or rloo (TRL trainers)")
    max_steps: int = Field(2, ge=1, le=100_000, description="optimizer steps")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="constant learning rate")
    lora_r: int = Field(8, ge=1, le=256, description="LoRA rank (lora_alpha = 2 x rank); a continued adapter "
                                                     "must have the same rank")
    num_generations: int = Field(2, ge=2, le=64, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(128, ge=1, le=32_768, description="tokens per completion")
    seed: int = Field(0, description="training and sampling seed")
    verifier_timeout_multiplier: float = Field(0.06, gt=0.0, le=10.0, description="the training verifier's "
                                               "timeout = each task's task_timeout_s (seconds, default 3000) x "
                                               "this, never below 5 x its pristine_duration_s")
    verifier_concurrency: int = Field(1, ge=1, le=32, description="verifier sandboxes at once")
    device: Device = Field("auto", description="auto: CUDA in bfloat16 when the worker has a GPU, else the CPU in "
                                               "float32; cpu; or cuda")

    def burst_config(self, backend: str | SandboxTarget, memory_mb: int, cpus: float,
                     episode: EpisodeSettings | None = None) -> RLBurstConfig:
        """The :class:`RLBurstConfig` with the verifier sandbox ``backend`` (a kind or a target), its memory
        limit (MiB) and CPUs, and the agentic mode's ``episode`` block (None: single-turn).

        Raises:
            pydantic.ValidationError: ``episode`` with an algorithm other than ``grpo``.
        """
        return RLBurstConfig(episode=episode, algorithm=self.algorithm, max_steps=self.max_steps,
                             learning_rate=self.learning_rate,
                             lora_r=self.lora_r, lora_alpha=2 * self.lora_r, num_generations=self.num_generations,
                             max_completion_length=self.max_completion_length, seed=self.seed,
                             verifier_timeout_multiplier=self.verifier_timeout_multiplier,
                             verifier_concurrency=self.verifier_concurrency, verifier_backend=backend,
                             verifier_memory_mb=memory_mb, verifier_cpus=cpus, device=self.device)


_HF_DIR = "the base model folder (HF checkpoint with config.json, tokenizer and chat template)"
_PARENT = ("an adapter to continue: its folder, or its sha256 as recorded in the store (same base model and LoRA "
           "rank); null: a new adapter")
_OUT_DIR = ("models folder; null: $FORGEFLOW_HOME/models (trains in <out_dir>/{kind}-adapter, pins to "
            "<out_dir>/adapters/<sha256>)")


class SFTBurstParams(StageParams):
    """The ``sft-burst`` flow's parameters.

    Attributes:
        hf_dir: the base model folder (HF checkpoint with tokenizer and chat template).
        samples_jsonl: one ``{"messages": [...]}`` (or ``{"prompt", "completion"}``) row per line
            (:func:`forgeflow.training.jsonl.read_sft_jsonl`).
        training: the hyper-parameters (:class:`SFTHyperParams`).
        parent_adapter: an adapter to continue (its folder, or its recorded sha256); None: a new one.
        out_dir: the models folder; None: ``$FORGEFLOW_HOME/models``.
    """

    hf_dir: Path = Field(description=_HF_DIR)
    samples_jsonl: Path = Field(description="the chat samples: one {\"messages\": [...]} or {\"prompt\", "
                                            "\"completion\"} row per line (one format per file); a user turn may "
                                            "hold image parts {\"type\": \"image\", \"image\": <path relative "
                                            "to the JSONL, or the sha256 of a file beside it>} on an "
                                            "image-text-to-text base (tiny-vl)")
    training: SFTHyperParams = Field(SFTHyperParams(), description="max_steps, learning_rate, lora_r, max_length "
                                     "(tokens), batch_size (rows per step), seed, device, packing, "
                                     "gradient_checkpointing")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="sft"))


class RLBurstParams(StageParams):
    """The ``rl-burst`` flow's parameters.

    The tasks come from exactly one of ``tasks_jsonl`` and ``freeze_name`` (with ``split`` and ``source``: the
    canary flow's names and types, ``flows.canary.CanaryParams``).

    Attributes:
        hf_dir: the base model folder.
        tasks_jsonl: one :class:`~forgeflow.training.rl.RLTask` row per line; None: the tasks of ``freeze_name``.
        freeze_name: a freeze recorded in the store whose ``split`` the burst trains on (each task with the
            FAIL_TO_PASS / PASS_TO_PASS, known tests and pristine duration its validation recorded,
            :func:`forgeflow.training.freeze_tasks.rl_tasks_from_freeze`); None: ``tasks_jsonl``.
        split: the freeze's split (default ``train``).
        source: the freeze's task rows (:class:`forgeflow.curation.task_rows.TaskSource`: patches, task images,
            test commands; default the demo's generated-candidates file).
        training: the hyper-parameters (:class:`RLHyperParams`).
        parent_adapter: an adapter to continue (its folder, or its recorded sha256); None: a new one.
        sandbox: a ``forgeflow-sandbox`` block the verifier runs on; None: podman, 1024 MiB, 1 CPU.
        out_dir: the models folder; None: ``$FORGEFLOW_HOME/models``.
        dispatcher: a ``forgeflow-dispatcher`` block (``ray``: each rollout's reward a Ray task); None: here.
        episode: the agentic mode (:class:`~forgeflow.training.episodes.EpisodeSettings`: ``max_turns``,
            ``max_tokens`` per episode, ``wall_s`` per episode, ``tools``, ``concurrency``, ``step_wall_s``, ...):
            each rollout a multi-turn episode in a fresh sandbox of the task image on ``sandbox``'s backend,
            rewarded by the verifier on its final change; ``grpo`` only. None: single-turn rollouts.
    """

    hf_dir: Path = Field(description=_HF_DIR)
    tasks_jsonl: Path | None = Field(None, description="the tasks: one RLTask row per line (instance_id, image_ref, "
                                     "problem_statement, test_command, fail_to_pass, pass_to_pass; optional "
                                     "task_timeout_s (seconds, default 3000), pristine_duration_s (seconds) and "
                                     "known_tests); null: the tasks of freeze_name")
    freeze_name: str | None = Field(None, min_length=1, description="instead of tasks_jsonl: a freeze recorded in "
                                    "the store; the burst trains on its split, each task with the test lists, known "
                                    "tests and pristine duration its validation recorded")
    split: str = Field("train", min_length=1, description="the freeze's split the burst trains on (with freeze_name)")
    source: TaskSource = Field(TaskSource(), description="the freeze's task rows (with freeze_name): candidates_path, "
                               "dataset or generated_path (default $FORGEFLOW_HOME/demo/candidates.jsonl), "
                               "test_commands and test_specs per repository")
    training: RLHyperParams = Field(RLHyperParams(), description="algorithm, max_steps, learning_rate, lora_r, "
                                    "num_generations, max_completion_length (tokens), seed, verifier timeout "
                                    "multiplier and concurrency, device")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    sandbox: str | None = Field(None, min_length=1, description="a forgeflow-sandbox block: the verifier runs on "
                                "its backend with its memory (MiB) and CPU limits; null: podman, 1024 MiB, 1 CPU")
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="rl"))
    dispatcher: str | None = Field(None, min_length=1, description="a forgeflow-dispatcher block: ray scores each "
                                   "rollout as a Ray task on a sandbox node; null or in-process: here")
    episode: EpisodeSettings | None = Field(None, description="the agentic mode: each rollout a multi-turn episode "
                                            "(bash in the task's container, submit) in a fresh sandbox, rewarded by "
                                            "the verifier: max_turns, max_tokens (per episode), wall_s (per "
                                            "episode), tools, concurrency, step_wall_s, command_timeout_s; grpo "
                                            "only; null: single-turn rollouts")

    @model_validator(mode="after")
    def _one_task_source(self) -> RLBurstParams:
        if (self.tasks_jsonl is None) == (self.freeze_name is None):
            raise ValueError("give tasks_jsonl (a JSONL of RLTask rows) or freeze_name (a freeze recorded in the "
                             "store, with split and source), not both and not neither")
        if self.episode is not None and self.training.algorithm != "grpo":
            raise ValueError("episode (the agentic mode) needs training.algorithm grpo: TRL's RLOOTrainer takes no "
                             "rollout function")
        return self

    def freeze(self) -> FreezeSplit | None:
        """The freeze split the tasks come from, or None when they come from ``tasks_jsonl``."""
        if self.freeze_name is None:
            return None
        return FreezeSplit(freeze_name=self.freeze_name, split=self.split, source=self.source)


class PPOJob(BaseModel):
    """How the ``ppo`` flow runs verl on a Ray cluster.

    Attributes:
        dashboard_url: the cluster's dashboard (Ray job server), e.g. ``http://head:8265``.
        working_dir: the job's working directory (uploaded by Ray; must hold forgeflow for the reward
            function), or None for a cluster image that has it.
        pip: packages the job installs (e.g. a pinned ``verl``).
        entrypoint: a command replacing verl's ``python3 -m verl.trainer.main_ppo <overrides>`` (a
            wrapper script, or a CPU stand-in that writes a checkpoint); None: verl's own.
        entrypoint_num_cpus: CPUs reserved for the job's driver.
        poll_s: seconds between status polls (the job's new log lines are logged at each).
        timeout_s: stop the job after this many seconds (None: no limit).
        adapter_glob: where the LoRA adapter of a step lies under ``settings.checkpoint_dir``
            (default verl's ``global_step_*/actor/lora_adapter``); the highest step the job wrote is ingested.
        base_model_sha256: the base model's digest, when ``settings.model_path`` is not a folder
            readable here (an HF id or a cluster path); else computed from the folder.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dashboard_url: str = Field(min_length=1, description="the cluster's dashboard (Ray job server), e.g. "
                                                         "http://head:8265")
    working_dir: str | None = Field(None, description="the job's working directory, uploaded by Ray (must hold "
                                                      "forgeflow for the reward function); null: the cluster "
                                                      "image has it")
    pip: tuple[str, ...] = Field((), description="packages the job installs (e.g. a pinned verl)")
    entrypoint: str | None = Field(None, description="a command replacing verl's python3 -m "
                                                     "verl.trainer.main_ppo <overrides>; null: verl's own")
    entrypoint_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the job's driver")
    poll_s: float = Field(5.0, gt=0, description="seconds between status polls (new log lines logged at each)")
    timeout_s: float | None = Field(None, gt=0, description="stop the job after this many seconds; null: no limit")
    adapter_glob: str = Field(DEFAULT_ADAPTER_GLOB, min_length=1, description="where a step's LoRA adapter lies "
                              "under settings.checkpoint_dir; the highest step the job wrote is ingested")
    base_model_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="the base model's "
                                          "sha256_tree, when settings.model_path is not a folder readable here; "
                                          "null: computed from the folder")


class PPOParams(StageParams):
    """The ``ppo`` flow's parameters.

    Attributes:
        settings: verl's PPO settings (:class:`forgeflow.training.verl.VerlPPOSettings`), ``lora_rank`` > 0.
        job: the cluster and the job (:class:`PPOJob`).
        submission_id: the Ray job's id; None: ``forgeflow-ppo-<flow run id>``.
        out_dir: the models folder; None: ``$FORGEFLOW_HOME/models``.
    """

    settings: VerlPPOSettings = Field(description="verl's PPO settings (model_path, train_files, val_files, batch "
                                      "sizes, learning rates, lora_rank > 0, checkpoint_dir readable here, ...)")
    job: PPOJob = Field(description="the Ray cluster (dashboard_url) and the job: working_dir, pip, entrypoint, "
                                    "poll_s and timeout_s (seconds), adapter_glob, base_model_sha256")
    submission_id: str | None = Field(None, min_length=1, description="the Ray job's id; null: "
                                                                      "forgeflow-ppo-<flow run id>")
    out_dir: Path | None = Field(None, description="models folder; null: $FORGEFLOW_HOME/models (the adapter is "
                                                   "pinned to <out_dir>/adapters/<sha256>)")


class WindowsParams(StageParams):
    """The ``windows`` flow's parameters: exactly one of ``job_id`` and ``trajectories_dir``.

    Attributes:
        job_id: a canary (or recovery) job recorded in the store.
        trajectories_dir: a folder of mini-swe-agent ``*.traj.json`` instead.
        windows: the window layout and kinds (:class:`forgeflow.training.windows.WindowConfig`).
        samples_jsonl: where the JSONL goes (a file there with other samples is refused); None:
            ``$FORGEFLOW_HOME/windows/<job id or folder>-<sha12>.jsonl``, named by its content.
        hf_dir: the base model an SFT burst on the windows trains; None: only the dataset.
        training / parent_adapter / out_dir: as :class:`SFTBurstParams`'.
    """

    job_id: str | None = Field(None, min_length=1, description="a canary (or recovery) job recorded in the store")
    trajectories_dir: Path | None = Field(None, description="a folder of mini-swe-agent *.traj.json instead of "
                                                            "job_id")
    windows: WindowConfig = Field(WindowConfig(), description="window layout and kinds: replay_steps, "
                                  "stride_steps, min_steps (steps), task_excerpt_chars, recap_command_chars "
                                  "(characters), loop_threshold, loop_variants, conclude_command, include_system")
    samples_jsonl: Path | None = Field(None, description="where the JSONL goes (a file there with other samples "
                                                         "is refused); null: $FORGEFLOW_HOME/windows/<job id or "
                                                         "folder>-<sha12>.jsonl, named by its content")
    hf_dir: Path | None = Field(None, description="the base model an SFT burst on the windows trains (the "
                                                  "sft-burst flow as a subflow); null: only the dataset")
    training: SFTHyperParams = Field(SFTHyperParams(), description="the burst's hyper-parameters, as sft-burst's "
                                     "params.training")
    parent_adapter: str | None = Field(None, min_length=1, description=_PARENT)
    out_dir: Path | None = Field(None, description=_OUT_DIR.format(kind="sft"))

    @model_validator(mode="after")
    def _one_source(self) -> WindowsParams:
        if (self.job_id is None) == (self.trajectories_dir is None):
            raise ValueError("give job_id (a canary job in the store) or trajectories_dir (a folder of "
                             "*.traj.json), not both or neither")
        return self
