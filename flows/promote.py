"""The ``promote`` flow: the promotion gate on two canary jobs, then the blue/green swap only on
``promote``. The standalone form of the lifecycle's compare + serve-swap stages, for a candidate
GGUF a team packaged and canaried on its own. It takes one parameter model (:class:`PromoteParams`)
and returns :class:`PromotionOutcome`.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from flows.stagekit import StageParams
from flows.stages import ServeParams, serve
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


class PromoteParams(StageParams):
    """The ``promote`` flow's parameters.

    Attributes:
        baseline_job: the canary job of the model serving now.
        candidate_job: the canary job of ``gguf_path`` (its recorded model sha256 must be the file's).
        gguf_path: the candidate GGUF.
        comparison: :class:`forgeflow.evaluation.compare.ComparisonSettings`: the promotion gate's
            settings (``gate``, default :class:`forgeflow.evaluation.compare.gate.GatePolicy`: at least
            30 pairs from 3 repositories, five points of tolerated drop at alpha 0.05), where the
            report goes (``report_path``, default ``$FORGEFLOW_HOME/compare-<baseline>-vs-<candidate>.md``),
            whether each job's recovery jobs are merged into it (``merge_recovery``, default yes) and
            the bootstrap seed (``seed``, default 0).
        state_path: the serving state file; None: ``$FORGEFLOW_HOME/serving/state.json``.
        ports: the blue/green ports; None: the serving backend's.
        hf_dir: the HF checkpoint the GGUF was converted from; None: the store's record.
        serving_block: the ``forgeflow-serving`` block the candidate is served with (see the ``serve``
            flow; None: llama-cpp-python, 4,096 tokens; ``kind="external"``: the endpoint that already
            serves the candidate is checked and recorded, nothing starts). A multimodal candidate (packaged
            with a projector) needs a ``llama-server`` block with ``mmproj``: the gate then sends an image and
            a server that did not use it rolls the swap back; without ``mmproj`` the swap is refused first.
    """

    baseline_job: str = Field(description="the canary job id of the model serving now")
    candidate_job: str = Field(description="the canary job id of gguf_path (its recorded model sha256 must be "
                                           "the file's)")
    gguf_path: Path = Field(description="the candidate GGUF")
    comparison: ComparisonSettings = Field(ComparisonSettings(), description="promotion gate settings, report path, "
                                                                             "recovery merge, bootstrap seed")
    state_path: Path | None = Field(None, description="the serving state file; None: "
                                                      "$FORGEFLOW_HOME/serving/state.json")
    ports: tuple[int, int] | None = Field(None, description="the two blue/green TCP ports on 127.0.0.1; None: "
                                                            "the serving backend's")
    hf_dir: Path | None = Field(None, description="the HF checkpoint folder the GGUF was converted from; None: "
                                                  "the store's record")
    serving_block: str | None = Field(None, description="a forgeflow-serving block name; None: llama-cpp-python, "
                                                        "4,096-token context")


@flow(name="promote", log_prints=True)
def promote(params: PromoteParams) -> PromotionOutcome:
    """Compare the candidate's canary job with the baseline's under the promotion gate; on
    ``promote`` swap the serving endpoint to ``params.gguf_path`` (the ``serve`` flow as a subflow: GGUF
    check, staged server, health gate, switch, old server stopped, swap recorded); on ``hold`` or
    ``reject`` nothing starts and the recorded endpoint stays where it is.

    The serving block is loaded before the comparison, so a missing or invalid block is refused before
    any comparison runs.

    Args:
        params: the two canary jobs to compare, the gate policy and the serving block that swaps the candidate in.

    Raises:
        InputError: ``params.gguf_path`` is missing, a job is missing, the candidate job canaried another
            model, the baseline job canaried another model than the one serving, the jobs ran other
            frozen splits.
        GGUFError, SwapRolledBackError: see the ``serve`` flow (the old server serves on).
    """
    gguf_sha256 = serving_tasks.model_file_sha256(params.gguf_path)  # refuses a missing file
    state_path = Path(params.state_path or home_dir() / "serving" / "state.json")
    serving_tasks.serving_backend(params.serving_block, params.ports, ports_field="params.ports")  # refused up front
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
        return PromotionOutcome(verdict=decision.verdict, reason=decision.reason, promoted=False, report_path=md_path)
    outcome = serve(ServeParams(gguf_path=params.gguf_path, state_path=state_path, ports=params.ports,
                                hf_dir=params.hf_dir, serving_block=params.serving_block))
    return PromotionOutcome(verdict=decision.verdict, reason=decision.reason, promoted=outcome.promoted,
                            report_path=md_path, serving=outcome)
