"""The ``sft-burst`` and ``rl-burst`` flows on a user's own data, in the session's Prefect harness.

An sft-burst from a small chat JSONL on the seed-0 tiny model (real TRL + peft, CPU), then a second one
continuing the first adapter by its recorded sha256: the store's lineage (``forgeflow lineage``'s
report) shows base -> adapter1 -> adapter2 with the dataset digest, hyper-parameters and run ids, and
the second adapter's weights differ from the first's. Bad input is refused before any model loads
(no adapter folder appears). A real RL burst needs podman and the task image
(tests/integration/test_rl_burst.py runs one); here the rl-burst flow's refusals are checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_tree
from forgeflow.ledger.store import Store
from forgeflow.sandbox.limits import SandboxLimits
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.slow]

CHATS = [
    [{"role": "user", "content": "add(2, 3) returns -1; fix it"},
     {"role": "assistant", "content": "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"}],
    [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "mul(2, 3) returns 5"},
     {"role": "assistant", "content": "--- a/calc.py\n+++ b/calc.py\n@@ -4,2 +4,2 @@\n def mul(a, b):\n-    return a + b\n+    return a * b\n"}],
]


@pytest.fixture
def home(tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    return home


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The cached seed-0 tiny model folder (tests/helpers.py builds it once per machine)."""
    return tiny_ggufs()[0].parent / "hf"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_two_sft_bursts_continue_one_lineage_in_the_store(prefect_harness, home: Path, tiny_model: Path,
                                                          tmp_path: Path) -> None:
    from flows.training import SFTBurstParams, sft_burst
    from forgeflow.packaging.lineage import lineage_of
    from forgeflow.training.adapters import adapter_sha256
    from forgeflow.training.burst import BurstConfig

    samples = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    training = BurstConfig(max_steps=2, learning_rate=5e-3, lora_r=4, max_length=256, seed=1)
    params = SFTBurstParams(hf_dir=tiny_model, samples_jsonl=samples, training=training)
    first = sft_burst(params)
    base_sha = sha256_tree(tiny_model)
    assert first.parent_sha256 == base_sha == first.lineage.base_model_sha256
    assert first.path == home / "models" / "adapters" / first.sha256
    assert adapter_sha256(first.path) == first.sha256
    assert [s for s, _ in first.health.losses] == [1, 2] and all(loss > 0 for _, loss in first.health.losses)

    # the 12-character prefix the flow's log and `forgeflow lineage` show names the parent as well as the whole digest
    second = sft_burst(params.model_copy(update={"parent_adapter": first.sha256[:12]}))
    assert second.parent_sha256 == first.sha256 != second.sha256
    w1 = (first.path / "adapter_model.safetensors").read_bytes()
    w2 = (second.path / "adapter_model.safetensors").read_bytes()
    assert w1 != w2  # the continued adapter trained further

    report = lineage_of(Store(), second.sha256[:12])
    chain = [(step.sha256, step.kind) for step in report.chain]
    assert chain == [(base_sha, "base"), (first.sha256, "adapter"), (second.sha256, "adapter")]
    [production] = Store().producers(second.sha256)
    assert production.parent_sha256 == first.sha256
    assert production.lineage["dataset_sha256"] == second.lineage.dataset_sha256 == first.lineage.dataset_sha256
    assert production.lineage["hyperparameters"]["max_steps"] == 2
    assert production.lineage["hyperparameters"]["lora_r"] == 4
    assert production.run_id and production.lineage["run_id"] == production.run_id
    assert production.run_id != Store().producers(first.sha256)[0].run_id

    # a third burst continuing the folder (not the sha256) with another rank is refused before training
    with pytest.raises(InputError, match=r"^params.training.lora_r 8 differs from the parent adapter's r 4"):
        sft_burst(SFTBurstParams(hf_dir=tiny_model, samples_jsonl=samples, parent_adapter=str(second.path)))
    # a parent trained on another base model is refused naming the field as written, not the core's name
    other_base = tmp_path / "other-base"
    shutil.copytree(tiny_model, other_base)
    (other_base / "README.md").write_text("another base model\n")
    with pytest.raises(InputError, match=rf"^params.parent_adapter: the adapter at {second.path} was trained "
                                         rf"on base model {base_sha}, not {sha256_tree(other_base)}"):
        sft_burst(SFTBurstParams(hf_dir=other_base, samples_jsonl=samples, training=training,
                                 parent_adapter=second.sha256[:12]))
    with pytest.raises(InputError, match=r"^params.parent_adapter: adapter '0123456789ab' is not in the store"):
        sft_burst(params.model_copy(update={"parent_adapter": "0123456789ab"}))


def test_an_unpacked_checkpointed_sft_burst_trains_and_its_lineage_says_so(prefect_harness, home: Path,
                                                                         tiny_model: Path, tmp_path: Path) -> None:
    """Issue 17: ``params.training.packing=False`` (one sample per row, padded),
    ``gradient_checkpointing=True`` and ``batch_size=2`` reach the burst; it trains, and the store's lineage
    records them."""
    from flows.training import SFTBurstParams, sft_burst
    from forgeflow.training.burst import BurstConfig

    samples = _jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    training = BurstConfig(max_steps=1, lora_r=4, max_length=256, batch_size=2, packing=False,
                           gradient_checkpointing=True)
    state = sft_burst(SFTBurstParams(hf_dir=tiny_model, samples_jsonl=samples, training=training), return_state=True)
    result = state.result()
    # the core's line on checkpointing reaches the run's log (forwarded from forgeflow.training.burst)
    from tests.flows.test_publish_flow import _run_records

    said = "burst: gradient checkpointing on, as the burst's config sets it"
    assert said in _run_records(state.state_details.flow_run_id)
    assert result.steps == 1 and result.final_loss > 0
    (production,) = [p for p in Store().producers(result.sha256) if p.kind == "adapter"]
    lineage = production.lineage
    assert (lineage["packing"], lineage["attention"], lineage["gradient_checkpointing"]) == ("none", "sdpa", True)
    assert (lineage["hyperparameters"]["packing"], lineage["hyperparameters"]["gradient_checkpointing"]) == (False, True)
    assert lineage["hyperparameters"]["batch_size"] == 2


def test_sft_burst_refuses_bad_input_before_any_model_loads(prefect_harness, home: Path, tiny_model: Path,
                                                            tmp_path: Path) -> None:
    from flows.training import SFTBurstParams, sft_burst

    def burst(hf_dir: Path, samples: Path, parent_adapter: str | None = None):
        return sft_burst(SFTBurstParams(hf_dir=hf_dir, samples_jsonl=samples, parent_adapter=parent_adapter))

    good = _jsonl(tmp_path / "good.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(InputError, match=rf"^params.hf_dir {tmp_path / 'nope'} is not a folder"):
        burst(tmp_path / "nope", good)
    bad_row = _jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(InputError, match=rf"^params.samples_jsonl {bad_row} line 2: messages has no assistant turn"):
        burst(tiny_model, bad_row)
    (tmp_path / "broken.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n\n{not json\n")
    with pytest.raises(InputError, match=r"^params.samples_jsonl .*broken.jsonl line 3 is not JSON"):
        burst(tiny_model, tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match=r"empty.jsonl is empty"):
        burst(tiny_model, tmp_path / "empty.jsonl")
    with pytest.raises(InputError, match=r"^params.parent_adapter 0{64} is not an adapter recorded in the store"):
        burst(tiny_model, good, parent_adapter="0" * 64)
    with pytest.raises(InputError, match=r"^params.parent_adapter .* is neither a recorded adapter sha256 nor an "
                                         r"adapter folder"):
        burst(tiny_model, good, parent_adapter=str(tmp_path))
    # a model folder without a chat template fails the preflight, listing it
    no_template = tmp_path / "base"
    no_template.mkdir()
    (no_template / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(PreflightError, match=r"chat_template.jinja does not exist"):
        burst(no_template, good)
    assert not (home / "models").exists()  # nothing trained, pinned or staged


def test_rl_burst_refuses_bad_tasks_parent_and_sandbox_before_any_model_loads(
        prefect_harness, home: Path, tiny_model: Path, tmp_path: Path) -> None:
    from flows.training import RLBurstParams, rl_burst
    from forgeflow.training.rl import RLBurstConfig

    def burst(tasks_jsonl: Path, **fields):
        return rl_burst(RLBurstParams(hf_dir=tiny_model, tasks_jsonl=tasks_jsonl, **fields))

    task = {"instance_id": "calc-1", "image_ref": "localhost/calc:1", "problem_statement": "add fails",
            "test_command": "pytest -rA", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "task_timeout_s": 60.0}
    good = _jsonl(tmp_path / "tasks.jsonl", [task])
    no_timeout = _jsonl(tmp_path / "t1.jsonl", [task, {**task, "instance_id": "calc-2", "task_timeout_s": 0}])
    with pytest.raises(InputError, match=rf"^params.tasks_jsonl {no_timeout} line 2 is not an RL task: "
                                         "task_timeout_s: Input should be greater than 0"):
        burst(no_timeout)
    repeated = _jsonl(tmp_path / "t2.jsonl", [task, task])
    with pytest.raises(InputError, match=r"line 2: instance_id 'calc-1' repeats line 1"):
        burst(repeated)
    with pytest.raises(InputError, match=r"^params.parent_adapter f{64} is not an adapter recorded"):
        burst(good, parent_adapter="f" * 64)
    with pytest.raises(InputError, match=r"^params.sandbox: sandbox block 'no-such-sandbox' does not exist"):
        burst(good, sandbox="no-such-sandbox")
    with pytest.raises(InputError, match=r"^params.dispatcher: .*'no-such-dispatcher'"):
        burst(good, dispatcher="no-such-dispatcher")
    # tasks from a freeze instead of a JSONL: an unknown one is named as the user wrote it
    with pytest.raises(InputError, match=r"^params.freeze_name 'no-such-freeze' \(split 'train'\): freeze "
                                         r"'no-such-freeze' is not recorded in the store"):
        rl_burst(RLBurstParams(hf_dir=tiny_model, freeze_name="no-such-freeze"))
    with pytest.raises(ValueError, match=r"verifier_timeout_multiplier"):
        RLBurstConfig(verifier_timeout_multiplier=0)
    # the training verifier's timeout: the task's own timeout x the multiplier (curation's timeout plays no part)
    block = SandboxLimits(memory_mb=2048, cpus=2.0)
    config = RLBurstConfig(verifier_timeout_multiplier=0.5).resolved(block)
    assert (config.verifier_timeout_multiplier, config.verifier_memory_mb) == (0.5, 2048)
    # the verifier's limits: the stage's own win over the block's, the block's fill in, else RL's 1024 MiB, 1 CPU
    own, default = RLBurstConfig(verifier_memory_mb=512).resolved(block), RLBurstConfig().resolved()
    assert (own.verifier_memory_mb, own.verifier_cpus, default.verifier_memory_mb, default.verifier_cpus) \
        == (512, 2.0, 1024, 1.0)
    assert not (home / "models").exists()


def test_the_rl_reward_table_counts_the_submissions_own_failures_apart_from_exceptions() -> None:
    from flows.training import reward_rows
    from forgeflow.training.rewards import StepRewardCounts

    counts = [StepRewardCounts(step=1, completions=4, resolved=1, unresolved=2, submission_failures=1, exceptions=1,
                               submission_failure_kinds={"timeout": 1}, exception_types={"SandboxError": 1}),
              StepRewardCounts(step=2, completions=4, resolved=0, unresolved=4, submission_failures=2,
                               submission_failure_kinds={"oom": 1, "timeout": 1}, tampering=1)]
    rows = reward_rows(counts)
    assert [r["step"] for r in rows] == ["1", "2", "total"]
    assert rows[-1] == {"step": "total", "completions": 8, "resolved": 1, "unresolved": 6, "submission failures": 3,
                        "by kind": "oom 1, timeout 2", "exceptions": 1, "by type": "SandboxError 1", "tampering": 1}
    assert reward_rows([]) == []
