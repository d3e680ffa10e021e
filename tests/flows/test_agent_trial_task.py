"""The canary's Prefect task ``tasks.evaluation.agent_trial`` in real flow runs (session Prefect harness):
a trial that ended in an exception is never cached, a scored one is, and a supervisor stop is
recorded in the store's ``supervision_events``.

The model is the scripted OpenAI-compatible loopback server of ``test_agent_supervision.py`` (a real
model cannot be made to fail, loop or fix the bug on demand); mini-swe-agent, podman and the
verifier are real.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_agent import BUG_PATCH, F2P, P2P, TEST_COMMAND, task_image  # noqa: E402,F401 - fixture
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402

from forgeflow.evaluation.agent import AgentConfig, problem_statement_for  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIX = "sed -i 's/a - b/a + b/' calc.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNAVAILABLE = {"error": {"message": "model crashed", "type": "server_error"}}


def test_exceptions_are_never_cached_scored_trials_are_and_stops_are_recorded(
    prefect_harness, task_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow

    from forgeflow.evaluation.canary import CanaryTask
    from forgeflow.ledger.store import Store
    from tasks.evaluation import agent_trial

    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    config = AgentConfig(step_limit=10, agent_timeout_s=120, memory_mb=512)

    states: list[str] = []

    @flow
    def canary(url: str, config: AgentConfig = config):
        task = CanaryTask(instance_id="calc-add-1", repo="calc", image_ref=task_image, image_digest="sha256:" + "1" * 64,
                          problem_statement=problem_statement_for(BUG_PATCH, F2P), test_command=TEST_COMMAND,
                          FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)
        future = agent_trial.submit(task, url, "scripted", "c" * 64, config, tmp_path / "traj", 120.0,
                                    job_id="canary-task-test")  # submitted, as the lifecycle's canary does
        future.wait()
        state = future.state
        states.append(state.name)
        return state.result()

    with scripted_endpoint(lambda i: {"status": 503, **UNAVAILABLE}) as (url, _):
        down = canary(url)
    assert down.exception_type == "ModelEndpointError" and down.reward is None
    with scripted_endpoint(lambda i: text_answer("cat calc.py")) as (url, bodies):
        looped = canary(url)
    assert len(bodies) == 3, "the endpoint error was not replayed from a cache: the trial ran again"
    assert looped.exception_type == "AgentLoopError"
    (event,) = Store().supervision_events(looped.trial_id)
    assert event.kind == "dead_loop" and event.job_id == "canary-task-test" and event.evidence["period"] == 1
    with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
        fixed = canary(url)
    assert len(bodies) == 1 and fixed.exception_type is None and fixed.reward == 1.0
    with scripted_endpoint(lambda i: {"status": 503, **UNAVAILABLE}) as (url, bodies):
        again = canary(url)
    assert bodies == [] and again.reward == 1.0, "a scored trial is cached (same model, image, config)"
    # where the verifier runs is not part of the cache key: the same trial set to verify on a Ray
    # cluster (here an address nothing listens on, so a run would fail) is answered from the cache
    from forgeflow.sandbox.dispatch import RayPlacement

    on_ray = config.model_copy(update={"verifier_ray": RayPlacement(address="127.0.0.1:9")})
    with scripted_endpoint(lambda i: {"status": 503, **UNAVAILABLE}) as (url, bodies):
        moved = canary(url, on_ray)
    assert bodies == [] and moved.reward == 1.0 and moved.trial_id == again.trial_id
    assert states == ["Completed", "Completed", "Completed", "Cached", "Cached"]
