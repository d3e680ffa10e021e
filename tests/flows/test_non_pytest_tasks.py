"""A team's own tasks whose tests are not pytest, end to end in real flow runs (session Prefect
harness, real podman): SWE-bench-style rows in a JSONL (test lists as JSON strings, their own
problem statements), a unittest suite read by SWE-bench's ``parse_log_django`` through a per-repository
test specification. ``curate`` accepts them with unittest's test ids as FAIL_TO_PASS, ``freeze``
freezes them, and the ``canary`` grades an agent's fix with the same parser (reward 1 only when the
fix makes the FAIL_TO_PASS test pass). The model is the scripted OpenAI-compatible loopback server of
``tests/integration/test_agent_supervision.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_agent import BUG_PATCH, CONTAINERFILE  # noqa: E402
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE = "localhost/forgeflow/test-unittest-calc:1"
FIX = "sed -i 's/a - b/a + b/' calc.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
NO_FIX = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNITTEST = {"test_command": "python3 -m unittest -v tests.test_calc", "log_parser": "parse_log_django"}
F2P = "test_add (tests.test_calc.CalcTest.test_add)"
P2P = "test_mul (tests.test_calc.CalcTest.test_mul)"


@pytest.fixture(scope="module")
def unittest_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bugged calc project with a unittest suite at /testbed (a git repo with one commit)."""
    from forgeflow.common.settings import apply_container_env, tool_env
    from forgeflow.registry.images import ensure_base_image, image_exists

    apply_container_env()
    if image_exists(IMAGE):
        return IMAGE
    ensure_base_image()
    ctx = tmp_path_factory.mktemp("unittest-image")
    (ctx / "testbed" / "tests").mkdir(parents=True)
    (ctx / "testbed" / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (ctx / "testbed" / "tests" / "__init__.py").write_text("")
    (ctx / "testbed" / "tests" / "test_calc.py").write_text(
        "import unittest\n\nfrom calc import add, mul\n\n\nclass CalcTest(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n")
    (ctx / "Containerfile").write_text(CONTAINERFILE)
    subprocess.run(["podman", "build", "-q", "-t", IMAGE, "-f", str(ctx / "Containerfile"), str(ctx)],
                   env=tool_env(), check=True, capture_output=True, text=True, timeout=600)
    return IMAGE


def team_rows(image: str) -> list[dict]:
    """Four SWE-bench-format rows (test lists as JSON strings, their own problem statements) of two repositories,
    ``team/alpha`` and ``team/beta``, whose tests are the unittest suite of ``image``."""
    return [{"instance_id": f"team__{repo}-{n}", "repo": f"team/{repo}", "patch": BUG_PATCH, "image": image,
             "FAIL_TO_PASS": json.dumps([F2P]), "PASS_TO_PASS": json.dumps([P2P]),
             "problem_statement": f"Issue {repo}-{n}: add(2, 3) returns -1 instead of 5."}
            for repo in ("alpha", "beta") for n in range(2)]


def test_unittest_tasks_are_curated_frozen_and_canaried_with_their_log_parser(
        prefect_harness, unittest_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.canary import CanaryParams, canary
    from flows.curate import CurateParams, curate
    from flows.stages import FreezeParams, freeze
    from forgeflow.curation.curate_settings import CurateSettings
    from forgeflow.curation.freeze import SplitQuotas
    from forgeflow.curation.task_rows import TaskSource
    from forgeflow.ledger.store import Store

    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    rows = team_rows(unittest_image)
    path = tmp_path / "team.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    specs = {"team/alpha": UNITTEST, "team/beta": UNITTEST}
    quotas = SplitQuotas(train=1, validation=0, test=1, max_per_repo=2, min_repos=2)

    out = curate(CurateParams(source=TaskSource(candidates_path=path, test_specs=specs), quotas=quotas,
                 settings=CurateSettings(batch_size=4, concurrency=2, verifier_timeout_s=120),
                 freeze_name="team-unittest-v1"))
    assert out.status == "freeze-ready", out
    store = Store()
    accepted = store.accepted_tasks()
    assert len(accepted) == 4
    assert all(t.FAIL_TO_PASS == [F2P] and t.PASS_TO_PASS == [P2P] for t in accepted)  # unittest's ids, parsed

    manifest = freeze(FreezeParams(name="team-unittest-v1", quotas=quotas, instance_ids=[r["instance_id"] for r in rows]))
    common = dict(freeze_name="team-unittest-v1", source={"candidates_path": path, "test_specs": specs},
                  out_dir=tmp_path / "canary",
                  run={"verifier_timeout_s": 120.0,
                       "agent_config": {"step_limit": 5, "agent_timeout_s": 120, "memory_mb": 512}})
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        fixed = canary(CanaryParams(endpoint={"base_url": url, "model_sha256": "e" * 64}, job_id="unittest-fixed", **common))
    assert fixed.report.requested == len(manifest.splits["test"]) == 2
    assert fixed.report.reward_1 == 2, fixed.trials
    assert any("add(2, 3) returns -1 instead of 5" in json.dumps(body["messages"]) for body in bodies)
    with scripted_endpoint(lambda i: text_answer(NO_FIX)) as (url, _):
        unfixed = canary(CanaryParams(endpoint={"base_url": url, "model_sha256": "e" * 64}, job_id="unittest-unfixed", **common))
    assert unfixed.report.scored == 2 and unfixed.report.reward_1 == 0  # the parser sees the failure
    trials = store.trials_for(job_id="unittest-fixed")  # each job keeps its own trials
    assert len(trials) == 2 and len(store.trials_for(job_id="unittest-unfixed")) == 2
    assert all(t.verifier and t.verifier["run"]["log_parser"] == "parse_log_django" for t in trials), \
        [t.verifier for t in trials]
