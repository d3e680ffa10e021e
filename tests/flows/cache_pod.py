"""One flow-run "pod" for tests/flows/test_result_storage.py: a separate Python process that runs
forgeflow's cached ``tasks.evaluation.compare_stored_jobs`` (the ``compare`` flow's comparison; cache
policy RESUMABLE + a digest of what it reads from the store) on two canary jobs the caller recorded
in the store, inside a flow, against the Prefect API that ``PREFECT_API_URL`` names.

Its Prefect home, working directory and local result storage are whatever the caller's environment
says (each "pod" its own); the result storage block, if any, comes from
``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``. The store is ``FORGEFLOW_STORE_URL`` (the same one in
every pod: what is under test is Prefect's result storage, not the store). Prints one JSON line:
the task run's state name (``Completed`` when the body ran, ``Cached`` when the result came from a
cache record) and the comparison's decision, for the caller to compare across processes.

Usage: python cache_pod.py JOB_A JOB_B
"""

from __future__ import annotations

import json
import sys

from prefect import flow

from forgeflow.evaluation.compare.gate import GatePolicy
from tasks.evaluation import compare_stored_jobs


@flow(name="cache-pod")
def cache_pod(job_a: str, job_b: str) -> dict:
    """Compare the two stored jobs; return the task run's state name and the decision."""
    state = compare_stored_jobs(job_a, job_b, True, 0, GatePolicy(), None, return_state=True)
    comparison = state.result()
    return {"state": state.name, "verdict": comparison.decision.verdict, "reason": comparison.decision.reason}


if __name__ == "__main__":
    print(json.dumps(cache_pod(sys.argv[1], sys.argv[2])))
