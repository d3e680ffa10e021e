"""The ``ppo`` flow on a real local Ray cluster (``ray start --head``, tests/raycluster.py): the job is
submitted through the Ray Jobs API, its log followed into the Prefect run, its newest LoRA
checkpoint ingested as an adapter with its lineage; a failing job fails the run with its log; a
flow-run process killed with SIGTERM (how a worker cancels a run) leaves no Ray job running.

The job's entrypoint is a CPU stand-in for verl (tests/flows/ppo_standin.py: prints its steps and
writes real peft adapters of the tiny model in verl's checkpoint layout); verl itself needs GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from forgeflow.training import ray_jobs
from tests.helpers import tiny_ggufs
from tests.raycluster import ray_head

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STANDIN = Path(__file__).with_name("ppo_standin.py")


@pytest.fixture(scope="module")
def cluster():
    with ray_head(num_cpus=2) as head:
        yield head


def _settings(tmp_path: Path, checkpoint_dir: Path) -> dict:
    train = tmp_path / "train.parquet"
    train.write_bytes(b"rows the stand-in does not read")
    return {"model_path": str(tiny_ggufs()[0].parent / "hf"), "train_files": [str(train)],
            "val_files": [str(train)], "n_gpus_per_node": 1, "train_batch_size_prompts": 2,
            "ppo_mini_batch_size_prompts": 2, "micro_batch_size_per_gpu": 2, "lora_rank": 4,
            "checkpoint_dir": str(checkpoint_dir)}


def _entrypoint(checkpoint_dir: Path, steps: int, sleep_s: float = 0.0) -> str:
    base = tiny_ggufs()[0].parent / "hf"
    return (f"{sys.executable} {STANDIN} --base {base} --checkpoint-dir {checkpoint_dir} --steps {steps} "
            f"--sleep {sleep_s}")


def wait_first_step(dashboard_url: str, job_id: str, checkpoints: Path, timeout_s: float,
                    alive: Callable[[], None] = lambda: None) -> None:
    """Until Ray job ``job_id`` runs and has written its first checkpoint; ``alive`` asserts its submitter
    still runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive()
        try:
            running = ray_jobs.status(dashboard_url, job_id)[0] == "RUNNING"
        except Exception:  # noqa: BLE001 - not submitted yet
            running = False
        if running and (checkpoints / "global_step_1").is_dir():
            return
        assert time.monotonic() < deadline, "the Ray job never took its first step"
        time.sleep(0.5)


def wait_stopped(dashboard_url: str, job_id: str, timeout_s: float) -> None:
    """Until Ray job ``job_id`` has ended; it must have been stopped."""
    deadline = time.monotonic() + timeout_s
    while ray_jobs.status(dashboard_url, job_id)[0] not in ray_jobs.TERMINAL_STATES:
        assert time.monotonic() < deadline, "the Ray job outlived its flow run"
        time.sleep(0.5)
    assert ray_jobs.status(dashboard_url, job_id)[0] == "STOPPED"


def test_ppo_follows_the_ray_job_and_ingests_its_newest_checkpoint(prefect_harness, flow_home: Path, cluster,
                                                                  tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flows.training import PPOJob, PPOParams, ppo
    from forgeflow.ledger.store import Store
    from forgeflow.training.ray_jobs import RayJobError
    from forgeflow.training.verl import settings

    checkpoints = tmp_path / "ckpt"
    state = ppo(PPOParams(settings=settings(**_settings(tmp_path, checkpoints)),
                          job=PPOJob(dashboard_url=cluster.dashboard_url, entrypoint=_entrypoint(checkpoints, 2),
                                     poll_s=0.5),
                          submission_id=f"ff-ppo-{uuid.uuid4().hex[:8]}"), return_state=True)
    result = state.result()
    assert (result.job.status, result.global_step) == ("SUCCEEDED", 2)
    assert ray_jobs.status(cluster.dashboard_url, result.job.submission_id)[0] == "SUCCEEDED"
    # the adapter is step 2's (lora_B = 0.01 + 0.02 in the stand-in), pinned under its digest, and loads
    weights = load_file(str(result.adapter.path / "adapter_model.safetensors"))
    assert all(torch.allclose(t, torch.full_like(t, 0.03)) for k, t in weights.items() if "lora_B" in k)
    assert result.adapter.path.name == result.adapter.sha256
    base = AutoModelForCausalLM.from_pretrained(tiny_ggufs()[0].parent / "hf")
    PeftModel.from_pretrained(base, str(result.adapter.path))
    # the store: the adapter's parent is the base model, its lineage names verl's run
    store = Store()
    (production,) = [p for p in store.producers(result.adapter.sha256) if p.kind == "adapter"]
    store.dispose()
    assert production.parent_sha256 == result.adapter.lineage.base_model_sha256
    assert production.lineage["algorithm"] == "ppo" and production.lineage["ray_job"] == result.job.submission_id
    assert production.lineage["global_step"] == 2
    # the job's log lines are the Prefect run's. Prefect ships a run's logs to its API in batches after the
    # records were made (CI saw the last lines missing right after the run ended on a loaded machine): wait
    # for them, up to 60 s
    deadline, messages = time.monotonic() + 60, ""
    while not ("stand-in step 2/2" in messages and "stand-in done" in messages) and time.monotonic() < deadline:
        time.sleep(0.5)
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[state.state_details.flow_run_id])))
        messages = "\n".join(log.message for log in logs)
    assert "stand-in step 2/2" in messages and "stand-in done" in messages

    # a job that fails fails the run, with its log
    with pytest.raises(RayJobError, match=r"ended FAILED.*no such step"):
        ppo(PPOParams(settings=settings(**_settings(tmp_path, tmp_path / "ckpt-failed")),
                      job=PPOJob(dashboard_url=cluster.dashboard_url, entrypoint="echo no such step; exit 3",
                                 poll_s=0.5),
                      submission_id=f"ff-ppo-{uuid.uuid4().hex[:8]}"))


def test_ppo_never_credits_a_run_with_an_earlier_jobs_checkpoint(prefect_harness, flow_home: Path, cluster,
                                                                 tmp_path: Path) -> None:
    """Regression (new-user trial): a second run into the same checkpoint_dir whose job wrote nothing
    completed with the first job's ``global_step_2`` adapter. Only a checkpoint the job wrote is ingested."""
    import torch
    from safetensors.torch import load_file
    from sqlalchemy import select

    from flows.training import PPOJob, PPOParams, ppo
    from forgeflow.common.errors import InfraError
    from forgeflow.ledger.store import Store
    from forgeflow.ledger.tables import ArtifactProduction
    from forgeflow.training.verl import settings

    checkpoints = tmp_path / "ckpt"  # one folder for every run, as the default checkpoint_dir is

    def run(entrypoint: str):
        return ppo(PPOParams(settings=settings(**_settings(tmp_path, checkpoints)),
                             job=PPOJob(dashboard_url=cluster.dashboard_url, entrypoint=entrypoint, poll_s=0.5),
                             submission_id=f"ff-ppo-{uuid.uuid4().hex[:8]}"))

    def productions() -> list[tuple[str, str]]:
        store = Store()
        try:
            with store.session() as session:
                rows = session.execute(select(ArtifactProduction.sha256, ArtifactProduction.lineage)).all()
        finally:
            store.dispose()
        return sorted((sha, lineage["ray_job"]) for sha, lineage in rows if (lineage or {}).get("algorithm") == "ppo")

    first = run(_entrypoint(checkpoints, 2))
    assert first.global_step == 2 and (checkpoints / "global_step_2").is_dir()
    assert productions() == [(first.adapter.sha256, first.job.submission_id)]

    with pytest.raises(InfraError) as info:
        run("echo I trained nothing")
    message = str(info.value)
    assert f"under {checkpoints} was written by Ray job ff-ppo-" in message and "the job wrote no adapter" in message
    assert "The 2 checkpoints there (steps 1, 2) predate the job" in message
    assert productions() == [(first.adapter.sha256, first.job.submission_id)]  # no adapter recorded for it

    # a job that saves only step 1 there is credited with its own step 1, not the older step 2
    third = run(_entrypoint(checkpoints, 1))
    assert third.global_step == 1 and third.adapter.sha256 != first.adapter.sha256
    weights = load_file(str(third.adapter.path / "adapter_model.safetensors"))
    assert all(torch.allclose(t, torch.full_like(t, 0.01)) for k, t in weights.items() if "lora_B" in k)
    assert productions() == sorted([(first.adapter.sha256, first.job.submission_id),
                                    (third.adapter.sha256, third.job.submission_id)])


def test_the_default_checkpoint_dir_is_a_folder_per_job(prefect_harness, flow_home: Path, cluster,
                                                        tmp_path: Path) -> None:
    """Left unset, ``settings.checkpoint_dir`` is ``checkpoints/forgeflow/ppo/<submission id>`` under the job's
    working_dir: two default runs never share a folder (the trial's stale ingest needed a shared one). The job
    gets it in its metadata, the lineage records it, and the adapter is ingested from there."""
    from flows.training import PPOJob, PPOParams, ppo
    from forgeflow.ledger.store import Store
    from forgeflow.training import ray_jobs
    from forgeflow.training.verl import CHECKPOINT_DIR_LABEL, settings

    given = {k: v for k, v in _settings(tmp_path, tmp_path / "unused").items() if k != "checkpoint_dir"}
    work = tmp_path / "work"
    work.mkdir()
    job_id = f"ff-ppo-{uuid.uuid4().hex[:8]}"
    own = work / "checkpoints" / "forgeflow" / "ppo" / job_id
    result = ppo(PPOParams(settings=settings(**given), submission_id=job_id,
                           job=PPOJob(dashboard_url=cluster.dashboard_url, working_dir=str(work),
                                      entrypoint=_entrypoint(own, 1), poll_s=0.5)))
    assert result.global_step == 1 and (own / "global_step_1").is_dir()
    metadata = ray_jobs.client(cluster.dashboard_url).get_job_info(job_id).metadata
    assert metadata[CHECKPOINT_DIR_LABEL] == f"checkpoints/forgeflow/ppo/{job_id}"
    (production,) = [p for p in Store().producers(result.adapter.sha256) if p.kind == "adapter"]
    assert production.lineage["hyperparameters"]["checkpoint_dir"] == f"checkpoints/forgeflow/ppo/{job_id}"


def test_a_killed_ppo_run_leaves_no_ray_job_running(prefect_harness, flow_home: Path, cluster, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    checkpoints = tmp_path / "ckpt"
    job_id = f"ff-ppo-{uuid.uuid4().hex[:8]}"
    params = {"settings": _settings(tmp_path, checkpoints), "submission_id": job_id,
              "job": {"dashboard_url": cluster.dashboard_url, "entrypoint": _entrypoint(checkpoints, 5, 30.0),
                      "poll_s": 0.5}}
    # the run's parameters as the API holds them (JSON): the cancel hook reads params.job and params.submission_id
    script = ("import json, sys\n"
              "from flows.training import ppo\n"
              "ppo(params=json.loads(sys.argv[1]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(params)], cwd=Path(__file__).parents[2],
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    def alive() -> None:
        assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]

    try:
        wait_first_step(cluster.dashboard_url, job_id, checkpoints, 180, alive)
        proc.send_signal(signal.SIGTERM)  # what a worker does to cancel a flow run
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_stopped(cluster.dashboard_url, job_id, 60)
    assert not (checkpoints / "global_step_5").exists()
