"""The ``windows`` flow: a canary job's trajectories (found through the store) -> replay and anti-loop
windows -> a prompt-completion JSONL that keeps tool calls and provenance -> an SFT burst on the tiny
model that trains on it and records the dataset's digest in the adapter's lineage.

Trajectories are mini-swe-agent's two formats as the canary writes them (text fences and OpenAI
tool calls; the builders of tests/core/training/test_windows.py); the store rows are the job and
its agent trials, as a canary run records them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from tests.core.training.test_windows import text_trajectory, toolcall_trajectory
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _record_job(store, job_id: str, folder: Path, trajectories: dict[str, dict]) -> None:
    from forgeflow.ledger.records import JobRecord, TrialRecord

    folder.mkdir(parents=True)
    store.record_job(JobRecord(job_id=job_id, kind="canary", freeze_name="f", split="test",
                               params={"trajectories_dir": str(folder)}))
    for trial_id, trajectory in trajectories.items():
        (folder / f"{trial_id}.traj.json").write_text(json.dumps(trajectory))
        store.record_trial(TrialRecord(trial_id=trial_id, instance_id=trajectory["instance_id"], kind="agent",
                                       job_id=job_id, reward=0.0))


def test_windows_from_a_canary_job_train_an_sft_burst(prefect_harness, flow_home: Path, tmp_path: Path) -> None:
    from flows.training import WindowsParams, windows
    from forgeflow.ledger.store import Store
    from forgeflow.training.burst import BurstConfig
    from forgeflow.training.jsonl import read_sft_jsonl
    from forgeflow.training.windows import WindowConfig

    store = Store()
    looping = ["ls", "cat setup.py", "pytest -x", "pytest -x", "pytest -x", "git diff", "sed -i s/a/b/ x.py"]
    _record_job(store, "canary-job-1", tmp_path / "trajectories", {
        "t-replay": text_trajectory([f"cat file{i}.py" for i in range(9)]),
        "t-loop": text_trajectory(looping),
        "t-tools": toolcall_trajectory([["ls"], ["pytest"], ["pytest"], ["pytest"], ["git diff"]]),
    })
    config = WindowConfig(replay_steps=2, stride_steps=3, min_steps=6, include_system=False)
    with pytest.raises(ValueError, match="give job_id .* or trajectories_dir"):
        WindowsParams()
    with pytest.raises(InputError, match="^params.job_id 'nope' is not recorded"):
        windows(WindowsParams(job_id="nope"))
    with pytest.raises(InputError, match=rf"^params.trajectories_dir {tmp_path} holds no \*.traj.json"):
        windows(WindowsParams(trajectories_dir=tmp_path))
    with pytest.raises(InputError, match=rf"^params.trajectories_dir {tmp_path / 'nope'} does not exist"):
        windows(WindowsParams(trajectories_dir=tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "t-1.traj.json").write_text(json.dumps({"instance_id": "x", "steps": []}))
    with pytest.raises(InputError, match=rf"{broken / 't-1.traj.json'}: trajectory has no 'messages' list"):
        windows(WindowsParams(trajectories_dir=broken))

    training = BurstConfig(max_steps=2, learning_rate=5e-3, lora_r=4, max_length=2048, seed=0)
    result = windows(WindowsParams(job_id="canary-job-1", windows=config, hf_dir=tiny_ggufs()[0].parent / "hf",
                                   training=training))
    assert result.trajectories == 3
    assert result.windows_by_kind["replay"] >= 2
    assert all(result.windows_by_kind[k] >= 1 for k in ("stop_and_conclude", "early_switch", "one_call_quota"))
    rows = [json.loads(line) for line in result.samples_jsonl.read_text().splitlines()]
    assert len(rows) == sum(result.windows_by_kind.values())
    # provenance on every sample; the tool-call trajectory's conclude target keeps its tool call
    assert {r["provenance"]["kind"] for r in rows} == {"replay", "stop_and_conclude", "early_switch", "one_call_quota"}
    assert all(r["source"] == f"window:{r['provenance']['kind']}:{r['provenance']['trajectory_sha256']}:"
                              f"{r['provenance']['target_step']}" for r in rows)
    tool_targets = [r["completion"][0] for r in rows if r["completion"][0].get("tool_calls")]
    assert tool_targets and all(c["tool_calls"][0]["function"]["name"] == "bash" for c in tool_targets)
    assert len(read_sft_jsonl(result.samples_jsonl)) == len(rows)  # sft-burst reads the file as it is

    # the burst trained on exactly these samples: its lineage's dataset digest is theirs
    from forgeflow.training.burst import build_sft_dataset

    burst = result.burst
    assert burst is not None and burst.steps == 2
    assert burst.lineage.dataset_sha256 == build_sft_dataset(read_sft_jsonl(result.samples_jsonl)).sha256
    (production,) = [p for p in Store().producers(burst.sha256) if p.kind == "adapter"]
    assert production.lineage["dataset_sha256"] == burst.lineage.dataset_sha256 == result.dataset_sha256
    # the file is named by its content in $FORGEFLOW_HOME/windows
    assert result.samples_jsonl == flow_home / "windows" / f"canary-job-1-{result.samples_sha256[:12]}.jsonl"
    assert (production.lineage["device"], production.lineage["dtype"]) == ("cpu", "float32")  # no GPU here
    # prompt/completion windows are packed too (their completion masks survive packing)
    assert (production.lineage["attention"], production.lineage["packing"]) == ("sdpa", "bfd")

    # an adapter's training data is never overwritten: other windows go to another file by default, and a
    # samples_jsonl holding other samples is refused; the same windows to the same file are written again
    trained_on = result.samples_jsonl.read_bytes()
    other_config = WindowConfig(replay_steps=3, stride_steps=2, min_steps=6, include_system=False)
    other = windows(WindowsParams(job_id="canary-job-1", windows=other_config))
    assert other.samples_jsonl != result.samples_jsonl and other.samples_sha256 != result.samples_sha256
    with pytest.raises(InputError, match=rf"^params.samples_jsonl {result.samples_jsonl} already holds other "
                                         rf"samples \(sha256 {result.samples_sha256[:12]}"):
        windows(WindowsParams(job_id="canary-job-1", windows=other_config, samples_jsonl=result.samples_jsonl))
    assert result.samples_jsonl.read_bytes() == trained_on
    again = windows(WindowsParams(job_id="canary-job-1", windows=config, samples_jsonl=result.samples_jsonl))
    assert again.samples_sha256 == result.samples_sha256 and again.dataset_sha256 == result.dataset_sha256

    # a trajectory the job recorded but that is gone is named, not skipped
    (tmp_path / "trajectories" / "t-loop.traj.json").unlink()
    with pytest.raises(InputError, match=r"^params.job_id 'canary-job-1': 1 of its 3 trajectories are not in "
                                         r".*t-loop.traj.json"):
        windows(WindowsParams(job_id="canary-job-1", windows=config))
