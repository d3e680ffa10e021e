"""kill -9 of a process running an SFT burst (forgeflow.training.burst.run_sft_burst, TRL + peft on the tiny
Qwen2 model) in the middle of training, then the same burst run again in a fresh process.

The burst runs in its own process, as a flow run would, and is killed with SIGKILL once the trainer
logged its first step (``logging_steps=1``: transformers' PrinterCallback prints each step's
``{'loss': ...}``), so training is under way and nothing is published. What a user checks:

* no adapter under the final name after the kill (nothing that could pass for a finished burst),
  only the killed run's staging folder (``.<name>.XXXX``, without ``lineage.json``);
* the rerun trains all its steps and publishes a complete adapter (its own run id, digest
  matching its files, every step logged);
* while the burst is alive, its staging folder carries its owner lock (``flock`` + pid, boot id,
  start time) and a cleanup from another process (and from this one) leaves it alone;
* the staging leftover is not reused: the published folder is the rerun's own staging folder
  renamed, and the rerun removed the leftover (its owner is provably dead: the kernel released the
  killed process' lock), so nothing but the adapter is left beside it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgeflow.common.settings import cache_dir
from forgeflow.training.adapters import (
    LINEAGE_FILE,
    adapter_sha256,
    read_adapter_record,
)
from forgeflow.training.staging import STAGING_LOCK_FILE, remove_dead_staging_dirs

pytestmark = [pytest.mark.slow]

MAX_STEPS = 8
SAMPLES = [{"instance_id": f"toolz__{i}", "source": "unit-test", "messages": [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": f"Tests fail in module {i}."},
    {"role": "assistant", "content": f"--- a/m{i}.py\n+++ b/m{i}.py\n-    return x\n+    return x + 1"}]}
    for i in range(3)]
BURST_SCRIPT = (
    "import json, sys; from pathlib import Path; "
    "from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst; "
    "data = build_sft_dataset(json.loads(Path(sys.argv[3]).read_text())); "
    "r = run_sft_burst(Path(sys.argv[1]), data, Path(sys.argv[2]), BurstConfig(max_steps=int(sys.argv[4])), "
    "run_id=sys.argv[5]); print('DONE', r.steps, r.sha256, flush=True)"
)
CLEANUP_SCRIPT = (
    "import sys; from pathlib import Path; from forgeflow.training.staging import remove_dead_staging_dirs; "
    "print('REMOVED', [str(p) for p in remove_dead_staging_dirs(Path(sys.argv[1]))], flush=True)"
)


@pytest.fixture(scope="module")
def base_model() -> Path:
    """The seed-0 tiny model (built once per machine, shared with test_swap_kill.py)."""
    from forgeflow.packaging.base_model import build_tiny_model

    return build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0).path


def _burst(base: Path, out_dir: Path, samples: Path, run_id: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-u", "-c", BURST_SCRIPT, str(base), str(out_dir), str(samples),
                                 str(MAX_STEPS), run_id], stdout=handle, stderr=subprocess.STDOUT)


def _logged_steps(log: Path) -> int:
    return sum(line.startswith("{") and "'loss'" in line for line in log.read_text(errors="replace").splitlines())


def test_burst_killed_mid_training_leaves_nothing_that_looks_done_and_the_rerun_completes(
        base_model: Path, tmp_path: Path) -> None:
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps(SAMPLES))
    out_dir = tmp_path / "adapter"

    victim_log = tmp_path / "killed.log"
    victim = _burst(base_model, out_dir, samples, "killed-run", victim_log)
    try:
        deadline = time.monotonic() + 120
        while _logged_steps(victim_log) < 1:
            assert victim.poll() is None, victim_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the burst logged no training step within 120 s"
            time.sleep(0.05)
        # a live burst's staging folder: owned (lock record names the victim), never removed by a
        # cleanup in another process or in this one, and the burst keeps training afterwards
        (live,) = sorted(tmp_path.glob(".adapter.*"))
        owner = json.loads((live / STAGING_LOCK_FILE).read_text())
        assert owner["pid"] == victim.pid and owner["start_ticks"] is not None and owner["boot_id"]
        other = subprocess.run([sys.executable, "-c", CLEANUP_SCRIPT, str(out_dir)], capture_output=True,
                               text=True, timeout=60)
        assert other.stdout.strip() == "REMOVED []", other.stdout + other.stderr
        assert remove_dead_staging_dirs(out_dir) == [] and (live / STAGING_LOCK_FILE).is_file()
        steps_at_cleanup = _logged_steps(victim_log)
        while _logged_steps(victim_log) <= steps_at_cleanup:
            assert victim.poll() is None, victim_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the burst stopped training after the cleanup"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.kill()
        victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    steps_before_kill = _logged_steps(victim_log)
    assert 1 <= steps_before_kill < MAX_STEPS, "killed mid-training, not after it"

    # nothing under the final name; the killed run's staging folder is all that is left
    assert not out_dir.exists()
    (leftover,) = sorted(tmp_path.glob(".adapter.*"))
    assert leftover == live and not (leftover / LINEAGE_FILE).exists()
    assert json.loads((leftover / STAGING_LOCK_FILE).read_text())["pid"] == victim.pid

    rerun_log = tmp_path / "rerun.log"
    rerun = _burst(base_model, out_dir, samples, "rerun", rerun_log)
    try:
        assert rerun.wait(timeout=240) == 0, rerun_log.read_text()[-3000:]
    finally:
        rerun.kill()
    (done,) = [line for line in rerun_log.read_text().splitlines() if line.startswith("DONE")]
    record = read_adapter_record(out_dir)
    assert done.split() == ["DONE", str(MAX_STEPS), record.sha256]
    assert record.steps == MAX_STEPS and _logged_steps(rerun_log) == MAX_STEPS, "the rerun trained from step 0"
    assert record.lineage.run_id == "rerun" and record.promotable
    assert adapter_sha256(out_dir) == record.sha256
    # the leftover was neither reused nor published, and the rerun removed it (its owner is dead)
    assert not leftover.exists() and sorted(tmp_path.glob(".adapter.*")) == []
    assert not (out_dir / STAGING_LOCK_FILE).exists()  # the owner lock is not part of the adapter
