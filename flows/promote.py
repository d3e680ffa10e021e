"""The ``promote`` flow: the promotion gate on two canary jobs, then the blue/green swap only on
``promote``. The standalone form of the lifecycle's compare + serve-swap stages, for a candidate
GGUF a team packaged and canaried on its own.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.stages import serve
from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.common.settings import home_dir
from forgeflow.evaluation.compare import ComparisonSettings
from tasks import evaluation as evaluation_tasks
from tasks import serving as serving_tasks
from tasks.serving import SwapOutcome


class PromotionOutcome(BaseModel):
    """What :func:`promote` decided and did.

    Attributes:
        verdict: the gate's verdict (``promote``, ``hold`` or ``reject``).
        reason: the gate's reason, in words.
        promoted: the candidate became the recorded serving endpoint.
        report_path: the comparison report (markdown; PNG beside it).
        serving: the ``serve`` flow's result when the swap ran (None on hold/reject).
    """

    model_config = ConfigDict(frozen=True)

    verdict: str
    reason: str
    promoted: bool
    report_path: Path
    serving: SwapOutcome | None = None


@flow(name="promote", log_prints=True)
def promote(baseline_job: str, candidate_job: str, gguf_path: Path,
            comparison: ComparisonSettings = ComparisonSettings(), state_path: Path | None = None,
            ports: tuple[int, int] | None = None, hf_dir: Path | None = None,
            serving_block: str | None = None) -> PromotionOutcome:
    """Compare the candidate's canary job with the baseline's under the promotion gate; on
    ``promote`` swap the serving endpoint to ``gguf_path`` (the ``serve`` flow as a subflow: GGUF
    check, staged server, health gate, switch, old server stopped, swap recorded); on ``hold`` or
    ``reject`` nothing starts and the recorded endpoint stays where it is.

    Args:
        baseline_job: the canary job of the model serving now.
        candidate_job: the canary job of ``gguf_path`` (its recorded model sha256 must be the file's).
        gguf_path: the candidate GGUF.
        comparison: :class:`forgeflow.evaluation.compare.ComparisonSettings`: the promotion gate's
            settings (``gate``, default :class:`forgeflow.evaluation.compare.gate.GatePolicy`: at least
            30 pairs from 3 repositories, five points of tolerated drop at alpha 0.05), where the
            report goes (``report_path``, default ``$FORGEFLOW_HOME/compare-<baseline>-vs-<candidate>.md``),
            whether each job's recovery jobs are merged into it (``merge_recovery``, default yes) and
            the bootstrap seed (``seed``, default 0).
        state_path: the serving state file (default ``$FORGEFLOW_HOME/serving/state.json``).
        ports: the blue/green ports (default: the serving backend's).
        hf_dir: the HF checkpoint the GGUF was converted from (default: the store's record).
        serving_block: the ``forgeflow-serving`` block the candidate is served with (see the ``serve``
            flow; default llama-cpp-python, 4,096 tokens; ``kind="external"``: the endpoint that already
            serves the candidate is checked and recorded, nothing starts); loaded before the comparison,
            so a missing or invalid block is refused before any work.

    Raises:
        InputError: ``gguf_path`` is missing, a job is missing, the candidate job canaried another
            model, the baseline job canaried another model than the one serving, the jobs ran other
            frozen splits.
        GGUFError, SwapRolledBackError: see the ``serve`` flow (the old server serves on).
    """
    if not Path(gguf_path).is_file():
        raise InputError(f"gguf_path {str(gguf_path)!r} is not a file")
    state_path = Path(state_path or home_dir() / "serving" / "state.json")
    serving_tasks.serving_backend(serving_block, tuple(ports) if ports is not None else None)  # refused up front
    evaluation_tasks.check_promotion_jobs(baseline_job, candidate_job, sha256_file(gguf_path), state_path)
    md_path = Path(comparison.report_path or home_dir() / f"compare-{baseline_job}-vs-{candidate_job}.md")
    result = evaluation_tasks.compare_stored(baseline_job, candidate_job, md_path, comparison.merge_recovery,
                                             comparison.seed, comparison.gate)
    decision = result.decision
    logger = get_run_logger()
    logger.info("promotion gate: %s (%s); wins %d ties %d losses %d; report %s", decision.verdict, decision.reason,
                result.paired.wins, result.paired.ties, result.paired.losses, md_path)
    if decision.verdict != "promote":
        logger.info("the recorded endpoint stays where it is (%s)", state_path)
        return PromotionOutcome(verdict=decision.verdict, reason=decision.reason, promoted=False, report_path=md_path)
    outcome = serve(gguf_path, state_path, ports, hf_dir, serving_block)
    return PromotionOutcome(verdict=decision.verdict, reason=decision.reason, promoted=outcome.promoted,
                            report_path=md_path, serving=outcome)
