"""The ``promote`` flow: the promotion gate on two canary jobs, then the blue/green swap only on ``promote``."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import Field

from flows.stages import ServeParams, serve
from forgeflow.common.settings import home_dir
from forgeflow.evaluation.compare import ComparisonSettings
from forgeflow.serving.bluegreen import SwapResult
from tasks import evaluation as evaluation_tasks
from tasks import serving as serving_tasks


class PromoteParams(ServeParams):
    """The ``promote`` flow's parameters: the two canary jobs and the gate, then the ``serve`` flow's own
    (``gguf_path`` the candidate GGUF, ``state_path``, ``ports``, ``hf_dir``, ``block``, ``mmproj_path``),
    handed to it on ``promote``."""

    baseline_job: str = Field(description="the canary job id of the model serving now")
    candidate_job: str = Field(description="the canary job id of gguf_path (its recorded model sha256 must be "
                                           "the file's)")
    comparison: ComparisonSettings = Field(ComparisonSettings(), description="promotion gate settings, report path, "
                                                                             "recovery merge, bootstrap seed")


@flow(name="promote", log_prints=True)
def promote(params: PromoteParams) -> SwapResult:
    """Compare the candidate's canary job with the baseline's; on ``promote`` swap serving to ``params.gguf_path``.

    The swap is the ``serve`` flow as a subflow; on ``hold`` or ``reject`` nothing starts. The serving
    block is loaded first, so a bad block is refused before any comparison runs. A multimodal candidate
    needs a ``llama-server`` block with ``mmproj`` (the gate then sends an image).

    Args:
        params: the two canary jobs to compare, the gate policy and the serving block that swaps the candidate in.

    Returns:
        The ``serve`` flow's swap with the gate's ``decision`` and ``report_path``; on ``hold``/``reject`` a
        ``rolled_back`` one, nothing started (``current`` the recorded endpoint). Promoted: not ``rolled_back``.

    Raises:
        InputError: a missing GGUF or job, a job that canaried another model than expected, other frozen splits.
        GGUFError, SwapRolledBackError: see the ``serve`` flow (the old server serves on).
    """
    gguf_sha256 = serving_tasks.model_file_sha256(params.gguf_path)  # refuses a missing file
    state_path = Path(params.state_path or home_dir() / "serving" / "state.json")
    serving_tasks.serving_backend(params.block, params.ports, ports_field="params.ports")  # refused up front
    baseline_job, candidate_job, comparison = params.baseline_job, params.candidate_job, params.comparison
    evaluation_tasks.check_promotion_jobs(baseline_job, candidate_job, gguf_sha256, state_path)
    md_path = Path(comparison.report_path or home_dir() / f"compare-{baseline_job}-vs-{candidate_job}.md")
    result = evaluation_tasks.compare_stored(baseline_job, candidate_job, md_path, comparison.merge_recovery,
                                             comparison.seed, comparison.gate)
    decision = result.decision
    logger = get_run_logger()
    logger.info("promotion gate: %s (%s); wins %d ties %d losses %d; report %s", decision.verdict, decision.reason,
                result.paired.wins, result.paired.ties, result.paired.losses, md_path)
    if decision.verdict != "promote":
        logger.info("the recorded endpoint stays where it is (%s)", state_path)
        return serving_tasks.hold_promotion(state_path, decision, md_path)
    outcome = serve(ServeParams.model_validate({**params.model_dump(include=set(ServeParams.model_fields)),
                                                "state_path": state_path}))
    return outcome.model_copy(update={"decision": decision, "report_path": md_path})
