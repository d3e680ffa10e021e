"""verl PPO backend: rendering and validating the config and the Ray job (verl is a GPU-cluster
tool and is not installed). Submission is checked against a loopback fake of the Ray Jobs REST
API (``POST /api/jobs/``, the endpoint ``ray job submit`` uses), said so here: no Ray cluster runs
on this machine."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.training.verl import (
    CHECKPOINT_DIR_LABEL,
    ENTRYPOINT_MODULE,
    TIMEOUT_MULTIPLIER_ENV,
    PPOJob,
    compute_score,
    hydra_overrides,
    ray_job_spec,
    render_ppo_config,
    settings,
    validate_ppo_config,
    write_verl_dataset,
)

BASE = {"model_path": "Qwen/Qwen2.5-0.5B-Instruct", "train_files": ["/data/train.parquet"],
        "val_files": ["/data/val.parquet"], "n_gpus_per_node": 4, "train_batch_size_prompts": 32,
        "ppo_mini_batch_size_prompts": 8, "micro_batch_size_per_gpu": 2}


def test_rendered_config_is_ppo_with_a_critic_and_the_forgeflow_reward() -> None:
    config = render_ppo_config(settings(**BASE, lora_rank=16, experiment_name="swe rl v1"))
    assert config["algorithm"]["adv_estimator"] == "gae" and config["algorithm"]["use_kl_in_reward"] is True
    assert config["critic"]["model"]["path"] == BASE["model_path"] == config["actor_rollout_ref"]["model"]["path"]
    assert config["actor_rollout_ref"]["model"]["lora_rank"] == 16
    assert config["custom_reward_function"] == {"path": "forgeflow/training/verl.py", "name": "compute_score"}
    assert config["reward_model"] == {"enable": False}
    assert config["trainer"]["save_freq"] == 100  # by default verl saves, so the ppo flow has a checkpoint to ingest
    overrides = hydra_overrides(config)
    assert "algorithm.adv_estimator=gae" in overrides and "trainer.n_gpus_per_node=4" in overrides
    assert "data.train_files=[/data/train.parquet]" in overrides and "trainer.total_training_steps=null" in overrides
    assert "trainer.experiment_name='swe rl v1'" in overrides


def test_ray_job_runs_verl_main_ppo_with_every_override() -> None:
    s = settings(**BASE, verifier_timeout_multiplier=0.1)
    job = PPOJob(dashboard_url="http://head:8265", working_dir="/repo/forgeflow", pip=("verl==0.5.0",))
    spec = ray_job_spec(s, job, submission_id="ff-ppo-1", metadata={"run_id": "r1"})
    argv = shlex.split(spec.entrypoint)
    assert argv[:3] == ["python3", "-m", ENTRYPOINT_MODULE]
    assert argv[3:] == hydra_overrides(render_ppo_config(s))  # quoting round-trips through a shell
    assert spec.runtime_env()["env_vars"][TIMEOUT_MULTIPLIER_ENV] == "0.1"
    assert spec.runtime_env()["pip"] == ["verl==0.5.0"] and spec.metadata["run_id"] == "r1"
    assert spec.runtime_env()["working_dir"] == "/repo/forgeflow"
    # the user's entrypoint replaces verl's; no working_dir or pip: none in the runtime_env
    custom = ray_job_spec(s, PPOJob(dashboard_url="http://head:8265", entrypoint="python3 standin.py"),
                          submission_id="ff-ppo-2")
    assert custom.entrypoint == "python3 standin.py" and set(custom.runtime_env()) == {"env_vars"}
    # where the job saves, so the ppo flow can record what the folder held before it (only its own are ingested)
    assert spec.metadata[CHECKPOINT_DIR_LABEL] == s.checkpoint_dir == "checkpoints/forgeflow/ppo"


@pytest.mark.parametrize(("change", "field"), [
    ({"rollout_gpu_memory_fraction": 1.5}, "rollout_gpu_memory_fraction"),
    ({"ppo_mini_batch_size_prompts": 12}, "ppo_mini_batch_size_prompts 12 does not divide"),
    ({"train_batch_size_prompts": 30, "ppo_mini_batch_size_prompts": 30, "n_gpus_per_node": 8}, "not divisible by the 8 GPUs"),
    ({"micro_batch_size_per_gpu": 3}, "micro_batch_size_per_gpu 3"),
    ({"rollout_engine": "hf"}, "rollout_engine"),
    ({"train_files": []}, "train_files"),
    ({"gamma": 1.2}, "gamma"),
])
def test_bad_settings_are_rejected_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(InputError, match=field):
        settings(**{**BASE, **change})


def test_validation_of_a_hand_edited_config_names_the_dotted_key() -> None:
    config = render_ppo_config(settings(**BASE))
    assert validate_ppo_config(config) is config
    config["trainer"]["n_gpu_per_node"] = config["trainer"].pop("n_gpus_per_node")  # a typo Hydra would reject
    del config["algorithm"]["kl_ctrl"]["kl_coef"]  # only on the cluster
    with pytest.raises(InputError) as info:
        validate_ppo_config(config)
    assert "trainer.n_gpu_per_node: not a verl key forgeflow sets" in str(info.value)
    assert "trainer.n_gpus_per_node: missing" in str(info.value)
    assert "algorithm.kl_ctrl.kl_coef: missing" in str(info.value)
    with pytest.raises(InputError, match="submission_id"):
        ray_job_spec(settings(**BASE), PPOJob(dashboard_url="http://head:8265", working_dir="/repo"),
                     submission_id="bad id/1")


def test_verl_dataset_rows_carry_the_verifier_spec(tmp_path: Path) -> None:
    from datasets import Dataset

    from forgeflow.training.rl import RLTask, build_rl_dataset

    task = RLTask(instance_id="calc-1", image_ref="localhost/x:1", problem_statement="add is wrong",
                  test_command="pytest -rA", FAIL_TO_PASS=("t::a",), task_timeout_s=100, pristine_duration_s=2.5)
    path = write_verl_dataset(build_rl_dataset([task]), tmp_path / "train.parquet")
    row = Dataset.from_parquet(str(path))[0]
    assert row["data_source"] == "forgeflow" and row["reward_model"]["ground_truth"] == "calc-1"
    assert "add is wrong" in row["prompt"][0]["content"]
    spec = json.loads(row["extra_info"]["verifier"])
    assert (spec["FAIL_TO_PASS"], spec["PASS_TO_PASS"]) == (["t::a"], [])  # one name (issue 35)
    assert not {"fail_to_pass", "pass_to_pass"} & set(spec)
    assert (spec["task_timeout_s"], spec["pristine_duration_s"]) == (100, 2.5)  # compute_score's timeout rule reads both
    assert "known_tests" not in spec  # not recorded: not written
    known = task.model_copy(update={"known_tests": ["t::a", "t::b"]})
    row = Dataset.from_parquet(str(write_verl_dataset(build_rl_dataset([known]), tmp_path / "k.parquet")))[0]
    assert json.loads(row["extra_info"]["verifier"])["known_tests"] == ["t::a", "t::b"]  # the verifier's known-ids check
    with pytest.raises(InputError, match="no forgeflow verifier spec"):
        compute_score("openai/gsm8k", "#### 4", "4", {"index": 0})


def test_a_verl_row_written_before_issue_35_with_lowercase_test_keys_still_scores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from forgeflow.sandbox.scoring import SubmissionVerdict
    from forgeflow.training import rewards

    seen = []

    def verify_on(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202
        seen.append(tests)
        return SubmissionVerdict(reward=1.0)

    monkeypatch.setattr(rewards, "verify_on", verify_on)
    old = {"instance_id": "calc-1", "image_ref": "localhost/x:1", "test_command": "pytest -rA",
           "fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"], "task_timeout_s": 100.0, "pristine_duration_s": None}
    answer = "```diff\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a\n+b\n```"
    score = compute_score("forgeflow", answer, "calc-1", {"index": 0, "verifier": json.dumps(old)})
    assert score["score"] == 1.0 and (seen[0].FAIL_TO_PASS, seen[0].PASS_TO_PASS) == (["t::a"], ["t::b"])


def test_compute_score_scores_a_timeout_and_never_ends_the_job_for_one_answer(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """verl has no "no reward": the submission's own hang is 0.0 (flagged), an infrastructure failure
    of one answer is 0.0 flagged ``infra_exception`` rather than an exception that ends the PPO job;
    only infrastructure failures past the job's threshold end it."""
    from datasets import Dataset

    from forgeflow.common.errors import InfraError, VerifierTimeoutError
    from forgeflow.sandbox.scoring import SubmissionVerdict
    from forgeflow.training import rewards, verl
    from forgeflow.training.rl import RLTask, build_rl_dataset

    task = RLTask(instance_id="calc-1", image_ref="localhost/x:1", problem_statement="add is wrong",
                  test_command="pytest -rA", FAIL_TO_PASS=("t::a",), pristine_duration_s=1.5)
    row = Dataset.from_parquet(str(write_verl_dataset(build_rl_dataset([task]), tmp_path / "t.parquet")))[0]
    answer = "```diff\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a\n+b\n```"
    seen: list[float] = []

    def hangs(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202  (the verifier's verdict on a hang)
        seen.append(kwargs["timeout_s"])
        return SubmissionVerdict(reward=0.0, notes=["the submission's own timeout"],
                                 evidence={"submission_failure": {"kind": "timeout"}})

    def lost(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202  (no evidence against the submission)
        raise VerifierTimeoutError("the verifier's container vanished")

    monkeypatch.setattr(verl, "_TALLY", verl._InfraTally())
    monkeypatch.setenv(verl.TIMEOUT_MULTIPLIER_ENV, "0.06")
    monkeypatch.setattr(rewards, "verify_on", hangs)
    score = compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"], row["extra_info"])
    assert score == {"score": 0.0, "resolved": 0.0, "submission_failure": 1.0, "infra_exception": 0.0}
    assert seen == [pytest.approx(180.0)]  # SWE-smith's 3000 s x 0.06: the row's default task timeout
    for _ in range(4):  # one answer in four lost (17 answers, past INFRA_MIN_ANSWERS): under 0.25, the job goes on
        monkeypatch.setattr(rewards, "verify_on", hangs)
        for _ in range(3):
            compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"], row["extra_info"])
        monkeypatch.setattr(rewards, "verify_on", lost)
        score = compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"], row["extra_info"])
        assert score == {"score": 0.0, "resolved": 0.0, "submission_failure": 0.0, "infra_exception": 1.0}
    assert (verl._TALLY.answers, verl._TALLY.infra) == (17, 4) and verl.INFRA_MIN_ANSWERS <= 17
    # a broken cluster: most answers lost -> the job fails loudly instead of training on zeros
    monkeypatch.setenv(verl.MAX_INFRA_FRACTION_ENV, "0.1")
    with pytest.raises(InfraError, match="verifier infrastructure failed on"):
        compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"], row["extra_info"])
    spec = ray_job_spec(settings(**BASE, verifier_max_infra_fraction=0.1), PPOJob(dashboard_url="http://head:8265"),
                        submission_id="ff-1")
    assert spec.env_vars[verl.MAX_INFRA_FRACTION_ENV] == "0.1"
