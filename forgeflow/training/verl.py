"""verl backend: PPO with a critic for GPU clusters (TRL 1.x has none), rendered for ``verl.trainer.main_ppo``
(key names as in verl's ``_generated_ppo_trainer.yaml``) and submitted as a Ray job; the keys and the
batch arithmetic verl asserts (``RayPPOTrainer._validate_config``) are checked before submission.
"""

from __future__ import annotations

import os
import shlex
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_output_file
from forgeflow.training.ppo import DEFAULT_ADAPTER_GLOB

ENTRYPOINT_MODULE = "verl.trainer.main_ppo"
REWARD_FUNCTION_NAME = "compute_score"
TIMEOUT_MULTIPLIER_ENV = "FORGEFLOW_VERIFIER_TIMEOUT_MULTIPLIER"
"""Environment variable (set in the Ray job's ``runtime_env``) carrying the training verifier
timeout multiplier to :func:`compute_score` on the cluster."""
MAX_INFRA_FRACTION_ENV = "FORGEFLOW_VERIFIER_MAX_INFRA_FRACTION"
"""Environment variable (set in the Ray job's ``runtime_env``) carrying
:attr:`VerlPPOSettings.verifier_max_infra_fraction` to :func:`compute_score` on the cluster."""
INFRA_MIN_ANSWERS = 16
"""Answers a process scores before :func:`compute_score` judges its infrastructure-failure fraction (a
first unlucky answer does not end a job)."""
DATA_SOURCE = "forgeflow"
CHECKPOINT_DIR_LABEL = "checkpoint_dir"
"""The Ray job's metadata label that holds ``settings.checkpoint_dir`` (:func:`ray_job_spec`): where the job
saves, so what the folder held before it can be recorded when it is submitted."""


def _field_error(exc: ValidationError, prefix: str = "") -> errors.InputError:
    """An InputError naming each invalid field (dotted path) and what was wrong."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(model)"
        parts.append(f"{prefix}{loc}: {err['msg']}")
    return errors.InputError("; ".join(parts))


# --- forgeflow-side settings -------------------------------------------------------------------
class VerlPPOSettings(BaseModel):
    """PPO on verl, in forgeflow's flat words (translated by :func:`render_ppo_config`; unknown keys refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(min_length=1, description="actor (and reference) model: HF id or a path on the cluster")
    critic_model_path: str | None = Field(None, description="value model; default model_path")
    train_files: tuple[str, ...] = Field(min_length=1,
        description="parquet files on the cluster (forgeflow rl-tasks --verl)")
    val_files: tuple[str, ...] = Field(min_length=1,
        description="parquet files on the cluster (forgeflow rl-tasks --verl)")
    max_prompt_length_tokens: int = Field(default=2048, ge=16)
    max_response_length_tokens: int = Field(default=1024, ge=16)
    train_batch_size_prompts: int = Field(default=64, ge=1,
        description="prompts per PPO iteration (data.train_batch_size)")
    ppo_mini_batch_size_prompts: int = Field(default=16, ge=1,
        description="prompts per actor/critic update (must divide the batch)")
    micro_batch_size_per_gpu: int = Field(default=2, ge=1, description="samples per forward/backward on one GPU")
    actor_learning_rate: float = Field(default=1e-6, gt=0)
    critic_learning_rate: float = Field(default=1e-5, gt=0)
    lora_rank: int = Field(default=0, ge=0, description="0 trains all weights; > 0 a LoRA adapter of that rank")
    lora_alpha: int = Field(default=16, ge=1)
    lora_target_modules: str | tuple[str, ...] = Field("all-linear",
        description="verl's all-linear or a list of module names")
    rollout_engine: Literal["vllm", "sglang"] = "vllm"
    rollout_n: int = Field(default=1, ge=1, description="responses per prompt (1 for PPO)")
    rollout_tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per rollout engine")
    rollout_gpu_memory_fraction: float = Field(default=0.5, gt=0, le=1,
        description="share of GPU memory the rollout engine may take")
    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount (Schulman et al. 2016)")
    gae_lambda: float = Field(default=1.0, ge=0, le=1, description="GAE lambda (Schulman et al. 2016)")
    kl_coef: float = Field(default=0.001, ge=0, description="KL penalty coefficient in the reward (fixed controller)")
    total_epochs: int = Field(default=1, ge=1)
    total_training_steps: int | None = Field(default=None, ge=1,
        description="run length in steps; overrides total_epochs when set")
    nnodes: int = Field(default=1, ge=1)
    n_gpus_per_node: int = Field(default=8, ge=1)
    project_name: str = Field(default="forgeflow", min_length=1)
    experiment_name: str = Field(default="ppo", min_length=1)
    checkpoint_dir: str = Field(default="checkpoints/forgeflow/ppo", min_length=1,
        description="where verl saves (relative: under working_dir); the ppo flow adds the job id when unset")
    save_freq_steps: int = Field(default=100, ge=-1,
        description="save every this many steps and after the last; -1 or 0 never (the ppo flow refuses)")
    test_freq_steps: int = Field(default=-1, ge=-1, description="validate every this many steps; -1 disables")
    reward_function_path: str = Field(default="forgeflow/training/verl.py", min_length=1,
        description="this module's path on the cluster, relative to the job's working_dir")
    verifier_timeout_multiplier: float = Field(default=0.06, gt=0, le=10,
        description="training verifier timeout = task timeout x this (>= 5 x the pristine run)")
    verifier_max_infra_fraction: float = Field(default=0.25, ge=0, le=1,
        description="share of infrastructure failures compute_score tolerates before it raises")

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> "VerlPPOSettings":
        """The divisibility verl asserts in ``RayPPOTrainer._validate_config`` (per GPU, after
        multiplying by ``rollout_n``), checked here so a bad run fails before a cluster starts."""
        world = self.nnodes * self.n_gpus_per_node
        if self.ppo_mini_batch_size_prompts > self.train_batch_size_prompts:
            raise ValueError(f"ppo_mini_batch_size_prompts {self.ppo_mini_batch_size_prompts} exceeds "
                             f"train_batch_size_prompts {self.train_batch_size_prompts}")
        if self.train_batch_size_prompts % self.ppo_mini_batch_size_prompts:
            raise ValueError(f"ppo_mini_batch_size_prompts {self.ppo_mini_batch_size_prompts} does not divide "
                             f"train_batch_size_prompts {self.train_batch_size_prompts}")
        if (self.train_batch_size_prompts * self.rollout_n) % world:
            raise ValueError(f"train_batch_size_prompts x rollout_n = {self.train_batch_size_prompts * self.rollout_n} "
                             f"is not divisible by the {world} GPUs (nnodes x n_gpus_per_node)")
        per_gpu = self.ppo_mini_batch_size_prompts * self.rollout_n / world
        if per_gpu < 1 or per_gpu != int(per_gpu) or int(per_gpu) % self.micro_batch_size_per_gpu:
            raise ValueError(f"ppo_mini_batch_size_prompts x rollout_n / GPUs = {per_gpu:g} samples per GPU must be "
                             f"a whole multiple of micro_batch_size_per_gpu {self.micro_batch_size_per_gpu}")
        if world % self.rollout_tensor_parallel_size:
            raise ValueError(f"rollout_tensor_parallel_size {self.rollout_tensor_parallel_size} does not divide "
                             f"the {world} GPUs")
        return self


def settings(**values: Any) -> VerlPPOSettings:
    """Build :class:`VerlPPOSettings`, turning a validation failure into an InputError naming the field.

    Raises:
        InputError: e.g. ``rollout_gpu_memory_fraction: Input should be less than or equal to 1``.
    """
    try:
        return VerlPPOSettings(**values)
    except ValidationError as exc:
        raise _field_error(exc) from exc


# --- the verl keys forgeflow sets ----------------------------------------------------------------
VERL_KEYS = frozenset({
    "data.train_files", "data.val_files", "data.prompt_key", "data.max_prompt_length", "data.max_response_length",
    "data.train_batch_size", "data.filter_overlong_prompts", "data.truncation",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.strategy", "critic.optim.lr", "critic.model.path", "critic.model.enable_gradient_checkpointing",
    "critic.ppo_micro_batch_size_per_gpu",
    "reward_model.enable", "custom_reward_function.path", "custom_reward_function.name",
    "algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
    "trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq",
    "trainer.default_local_dir", "trainer.critic_warmup", "trainer.val_before_train",
})
"""The dotted keys of verl's ``ppo_trainer.yaml`` (``verl/trainer/config/_generated_ppo_trainer.yaml``) that
:func:`render_ppo_config` sets; their values are bounded once, in :class:`VerlPPOSettings`."""


def _leaves(config: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of ``config``'s non-mapping values, in order."""
    out: list[str] = []
    for key, value in config.items():
        out.extend(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])
    return out


def validate_ppo_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` when its keys are exactly :data:`VERL_KEYS` (a typo would fail only on the cluster, in Hydra).

    Raises:
        InputError: each unknown key (``trainer.n_gpu_per_node: not a verl key forgeflow sets``) and missing key.
    """
    keys = _leaves(config)
    problems = [f"{k}: not a verl key forgeflow sets" for k in keys if k not in VERL_KEYS]
    problems += [f"{k}: missing" for k in sorted(VERL_KEYS - set(keys))]
    if problems:
        raise errors.InputError("; ".join(problems))
    return config


def render_ppo_config(s: VerlPPOSettings) -> dict[str, Any]:
    """The validated verl PPO config for ``s``: GAE with a critic, KL penalty in the reward, :func:`compute_score`."""
    micro = s.micro_batch_size_per_gpu
    config = {
        "data": {
            "train_files": list(s.train_files), "val_files": list(s.val_files), "prompt_key": "prompt",
            "max_prompt_length": s.max_prompt_length_tokens, "max_response_length": s.max_response_length_tokens,
            "train_batch_size": s.train_batch_size_prompts, "filter_overlong_prompts": True, "truncation": "error",
        },
        "actor_rollout_ref": {
            "model": {
                "path": s.model_path, "lora_rank": s.lora_rank, "lora_alpha": s.lora_alpha,
                "target_modules": (s.lora_target_modules if isinstance(s.lora_target_modules, str)
                                   else list(s.lora_target_modules)),
                "use_remove_padding": True, "enable_gradient_checkpointing": True,
            },
            "actor": {
                "strategy": "fsdp", "optim": {"lr": s.actor_learning_rate},
                "ppo_mini_batch_size": s.ppo_mini_batch_size_prompts, "ppo_micro_batch_size_per_gpu": micro,
                "use_kl_loss": False,
            },
            "rollout": {
                "name": s.rollout_engine, "n": s.rollout_n,
                "tensor_model_parallel_size": s.rollout_tensor_parallel_size,
                "gpu_memory_utilization": s.rollout_gpu_memory_fraction, "log_prob_micro_batch_size_per_gpu": micro,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": micro},
        },
        "critic": {
            "strategy": "fsdp", "optim": {"lr": s.critic_learning_rate},
            "model": {"path": s.critic_model_path or s.model_path, "enable_gradient_checkpointing": True},
            "ppo_micro_batch_size_per_gpu": micro,
        },
        "reward_model": {"enable": False},
        "custom_reward_function": {"path": s.reward_function_path, "name": REWARD_FUNCTION_NAME},
        "algorithm": {
            "adv_estimator": "gae", "gamma": s.gamma, "lam": s.gae_lambda, "use_kl_in_reward": True,
            "kl_ctrl": {"type": "fixed", "kl_coef": s.kl_coef},
        },
        "trainer": {
            "project_name": s.project_name, "experiment_name": s.experiment_name, "logger": ["console"],
            "nnodes": s.nnodes, "n_gpus_per_node": s.n_gpus_per_node, "total_epochs": s.total_epochs,
            "total_training_steps": s.total_training_steps, "save_freq": s.save_freq_steps,
            "test_freq": s.test_freq_steps, "default_local_dir": s.checkpoint_dir, "critic_warmup": 0,
            "val_before_train": False,
        },
    }
    validate_ppo_config(config)
    return config


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    text = str(value)
    if any(c in text for c in " ,[]{}()=:'\"\\$") or text in {"null", "true", "false"}:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def hydra_overrides(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Flatten the config into Hydra command-line overrides ``a.b.c=value`` (lists as ``[x,y]``,
    strings with Hydra's special characters single-quoted, None as ``null``), in render order."""
    out: list[str] = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(hydra_overrides(value, path + "."))
        else:
            out.append(f"{path}={_hydra_value(value)}")
    return out


# --- Ray job -----------------------------------------------------------------------------------
class PPOJob(BaseModel):
    """How the ``ppo`` flow runs verl on a Ray cluster: its ``params.job``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dashboard_url: str = Field(min_length=1, description="the cluster's dashboard (Ray job server), e.g. "
                                                         "http://head:8265")
    working_dir: str | None = Field(None, min_length=1,
                                    description="the job's working directory, uploaded by Ray (must hold forgeflow for "
                                                "the reward function); null: the cluster image has it")
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


class RayJobSpec(BaseModel):
    """The Ray job of a ``ppo`` run: ``job`` as the user gave it, and what forgeflow adds for the Ray Jobs
    ``POST /api/jobs/`` request (``JobSubmitRequest``: :meth:`runtime_env` and the fields below)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: PPOJob = Field(description="the cluster, working_dir, pip, entrypoint override and driver CPUs")
    entrypoint: str = Field(min_length=1, description="the shell command the job runs on the head node: "
                            "job.entrypoint, else verl's main_ppo with every override")
    submission_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
        description="a unique id (Ray rejects a reused one)")
    env_vars: dict[str, str] = Field(default_factory=dict, description="the runtime_env's environment variables")
    metadata: dict[str, str] = Field(default_factory=dict)
    entrypoint_num_gpus: float = Field(default=0, ge=0,
        description="GPUs reserved for the driver (verl schedules its own GPU workers)")

    def runtime_env(self) -> dict[str, Any]:
        """The request's ``runtime_env``: ``working_dir``, ``pip`` and ``env_vars``, each where set."""
        env = {"working_dir": self.job.working_dir, "pip": list(self.job.pip), "env_vars": dict(self.env_vars)}
        return {k: v for k, v in env.items() if v not in (None, [], {})}


def ray_job_spec(
    s: VerlPPOSettings, job: PPOJob, *, submission_id: str, env_vars: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
) -> RayJobSpec:
    """The Ray job that runs verl's PPO (``job.working_dir`` must contain forgeflow; None: the head node's own).

    Raises:
        InputError: a bad field (named).
    """
    overrides = hydra_overrides(render_ppo_config(s))
    entrypoint = job.entrypoint or " ".join(["python3", "-m", ENTRYPOINT_MODULE, *(shlex.quote(o) for o in overrides)])
    env = {**(env_vars or {}), TIMEOUT_MULTIPLIER_ENV: repr(s.verifier_timeout_multiplier),
           MAX_INFRA_FRACTION_ENV: repr(s.verifier_max_infra_fraction)}
    try:
        return RayJobSpec(
            job=job, entrypoint=entrypoint, submission_id=submission_id, env_vars=env,
            metadata={"forgeflow": "verl-ppo", **(metadata or {}), CHECKPOINT_DIR_LABEL: s.checkpoint_dir},
        )
    except ValidationError as exc:
        raise _field_error(exc) from exc


# --- data and reward on the cluster --------------------------------------------------------------
def write_verl_dataset(data: Any, path: Path) -> Path:
    """Write an RL dataset (:func:`forgeflow.training.rl.build_rl_dataset`'s ``BurstData``) as verl's RL parquet, each
    row's ``extra_info.verifier`` the task's verifier spec as JSON (read by :func:`compute_score`; its tests as
    ``FAIL_TO_PASS`` / ``PASS_TO_PASS``, and a parquet written before issue 35 with ``fail_to_pass`` /
    ``pass_to_pass`` still scores).
    """
    import json

    from datasets import Dataset

    rows = []
    for i, row in enumerate(data.dataset):
        spec = {k: row[k] for k in ("instance_id", "image_ref", "test_command", "FAIL_TO_PASS",
                                    "PASS_TO_PASS", "task_timeout_s", "pristine_duration_s")}
        if row.get("known_tests"):  # the column exists only when some task recorded its known tests
            spec["known_tests"] = list(row["known_tests"])
        rows.append({
            "data_source": DATA_SOURCE, "prompt": row["prompt"], "ability": "swe",
            "reward_model": {"style": "rule", "ground_truth": row["instance_id"]},
            "extra_info": {"index": i, "verifier": json.dumps(spec, sort_keys=True)},
        })
    path = Path(path)
    with atomic_output_file(path) as tmp:
        Dataset.from_list(rows).to_parquet(str(tmp))
    return path


class _InfraTally:
    """Answers scored and infrastructure failures among them, in this process (verl's reward workers)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers = 0
        self.infra = 0

    def add(self, infra: bool) -> tuple[int, int]:
        with self.lock:
            self.answers += 1
            self.infra += int(infra)
            return self.answers, self.infra


_TALLY = _InfraTally()


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **_: Any) -> dict[str, float]:
    """verl's ``custom_reward_function``: the task's verifier on one answer, as
    ``{"score", "resolved", "submission_failure", "infra_exception"}`` floats (an infrastructure failure
    scores 0.0 flagged: verl has no "no reward", as its ``RateLimitedRewardManager`` does).

    Raises:
        InputError: the row has no verifier spec in ``extra_info``, or the scorer's settings are wrong.
        InfraError: infrastructure failures passed :data:`MAX_INFRA_FRACTION_ENV` of the answers scored.
    """
    import json

    from forgeflow.training.rewards import VerifierSpec, score_completion

    if data_source != DATA_SOURCE or not extra_info or "verifier" not in extra_info:
        raise errors.InputError(f"row of {data_source!r} ({ground_truth}) carries no forgeflow verifier spec")
    spec = VerifierSpec.model_validate(json.loads(extra_info["verifier"]))
    outcome = score_completion(solution_str, spec,
                               verifier_timeout_multiplier=float(os.environ.get(TIMEOUT_MULTIPLIER_ENV, "0.06")))
    infra = outcome.reward is None
    answers, failures = _TALLY.add(infra)
    if infra:
        limit = float(os.environ.get(MAX_INFRA_FRACTION_ENV, "0.25"))
        if answers >= INFRA_MIN_ANSWERS and failures / answers > limit:
            raise errors.InfraError(
                f"verifier infrastructure failed on {failures} of {answers} answers (> {limit:g}); last: "
                f"{spec.instance_id}: {outcome.exception_type}: {outcome.exception_message}")
    return {"score": outcome.reward or 0.0, "resolved": float(outcome.reward == 1.0),
            "submission_failure": float(outcome.submission_failure is not None), "infra_exception": float(infra)}
