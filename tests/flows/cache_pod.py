"""One flow-run "pod" for tests/flows/test_result_storage.py: a separate Python process that runs
forgeflow's cached ``tasks.evaluation.compare_jobs`` (cache policy RESUMABLE: inputs + task source)
on fixed inputs inside a flow, against the Prefect API that ``PREFECT_API_URL`` names.

Its Prefect home, working directory and local result storage are whatever the caller's environment
says (each "pod" its own); the result storage block, if any, comes from
``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``. Prints one JSON line: the task run's state name
(``Completed`` when the body ran, ``Cached`` when the result came from a cache record) and the
comparison's decision, for the caller to compare across processes.

Usage: python cache_pod.py
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from prefect import flow

from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.sandbox.trial import TrialResult
from tasks.evaluation import compare_jobs

STARTED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)  # fixed: the inputs, and so the cache key, are equal in every pod


def _trial(instance_id: str, reward: float, agent_s: float) -> TrialResult:
    return TrialResult(trial_id=f"t-{instance_id}-{agent_s}", instance_id=instance_id, kind="agent", reward=reward,
                       started_at=STARTED, env_setup_s=0.1, agent_s=agent_s, verifier_s=1.0, agent_steps=2,
                       input_tokens=100)


@flow(name="cache-pod")
def cache_pod() -> dict:
    """Compare two fixed three-trial jobs; return the task run's state name and the decision."""
    base = [_trial("six.t1", 1.0, 4.0), _trial("six.t2", 0.0, 4.0), _trial("toolz.t1", 0.0, 4.0)]
    cand = [_trial("six.t1", 1.0, 2.0), _trial("six.t2", 1.0, 2.0), _trial("toolz.t1", 1.0, 2.0)]
    repo_of = {"six.t1": "six", "six.t2": "six", "toolz.t1": "toolz"}
    state = compare_jobs(base, cand, "baseline", "candidate", repo_of, GatePolicy(), 0, return_state=True)
    comparison = state.result()
    return {"state": state.name, "verdict": comparison.decision.verdict, "reason": comparison.decision.reason}


if __name__ == "__main__":
    print(json.dumps(cache_pod()))
