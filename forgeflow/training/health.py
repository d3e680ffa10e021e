"""Health gates of a burst (SFT and RL): the logged values must stay finite, in band and not rising.

:class:`HealthGates` holds the limits: every logged loss and gradient norm finite, gradient norms
inside ``[grad_norm_min, grad_norm_max]``, and the least-squares slope of the last
``loss_trend_window`` logged losses not above ``loss_trend_max_slope``. :func:`health_callback`
stops training at the first non-finite or out-of-band value; after training :func:`check_health`
gives the :class:`HealthReport` and :func:`enforce_health` raises :class:`BurstHealthError` (or
:class:`BurstDivergedError`) with the logged values, so no adapter is written. An adapter folder
exists only with a passing report in its ``lineage.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError


class BurstHealthError(InputError):
    """A burst failed a health gate. ``report`` is the :class:`HealthReport` with every logged
    loss and gradient norm; the message names the failed gates and their evidence. Caused by the
    inputs (hyperparameters, data, a broken checkpoint), so never retried; no adapter is written."""

    def __init__(self, message: str, report: "HealthReport | None" = None) -> None:
        super().__init__(message)
        self.report = report


class BurstDivergedError(BurstHealthError):
    """Training produced a NaN or infinite loss or gradient norm, or logged no loss at all (the
    message lists the logged values)."""


# --- health gates ----------------------------------------------------------------------------
class HealthGates(BaseModel):
    """Health gates checked during and after a burst.

    Attributes:
        grad_norm_min: smallest allowed logged gradient norm (L2 over trainable parameters, before
            clipping, as ``transformers.Trainer`` logs it). 0 allows steps with no gradient (an RL
            step whose rewards are all equal has zero advantage, hence zero gradient).
        grad_norm_max: largest allowed logged gradient norm; above it the step is taken as an
            explosion.
        loss_trend_window: number of most recent logged losses the trend gate fits a line to
            (least squares, ``numpy.polyfit`` degree 1). 0 turns the gate off. The gate is only
            evaluated once a full window is logged (a shorter history is reported as not
            evaluated: a few noisy per-step losses are no evidence of a trend).
        loss_trend_max_slope: tolerance of that slope in loss units (nats per token) per logged
            step; a larger slope fails the gate. The default 0.05 leaves room for the per-step
            noise of small batches on a flat loss; tighten it for large batches.
    """

    model_config = ConfigDict(frozen=True)

    grad_norm_min: float = Field(default=0.0, ge=0.0)
    grad_norm_max: float = Field(default=1e4, gt=0.0)
    loss_trend_window: int = Field(default=10, ge=0)
    loss_trend_max_slope: float = 0.05

    @model_validator(mode="after")
    def _consistent(self) -> "HealthGates":
        if self.grad_norm_min > self.grad_norm_max:
            raise ValueError(
                f"grad_norm_min {self.grad_norm_min} is above grad_norm_max {self.grad_norm_max}"
            )
        if self.loss_trend_window in (1, 2):
            raise ValueError(
                f"loss_trend_window must be 0 (off) or >= 3 losses, got {self.loss_trend_window}"
            )
        if not math.isfinite(self.loss_trend_max_slope):
            raise ValueError("loss_trend_max_slope must be finite")
        return self


class HealthGateResult(BaseModel):
    """One gate's verdict.

    Attributes:
        name: ``finite``, ``grad_norm_band`` or ``loss_trend``.
        passed: False iff the gate was evaluated and failed.
        evaluated: False when there was not enough history (the gate then passes).
        detail: the evidence in words (values, steps, bounds).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    passed: bool
    evaluated: bool = True
    detail: str = ""


class HealthReport(BaseModel):
    """The health of one burst: every gate's verdict and the logged values behind them.

    Attributes:
        passed: True iff every gate passed.
        gates: one :class:`HealthGateResult` per gate.
        losses: ``(step, loss)`` as logged by the trainer (nats per token for SFT; the policy
            surrogate for GRPO/RLOO).
        grad_norms: ``(step, gradient norm)`` as logged.
        loss_slope: the fitted slope of the trend gate (loss per step), None when not evaluated.
        gates_config: the :class:`HealthGates` checked, as a dict.
    """

    model_config = ConfigDict(frozen=True)

    passed: bool
    gates: list[HealthGateResult]
    losses: list[tuple[int, float]]
    grad_norms: list[tuple[int, float]]
    loss_slope: float | None = None
    gates_config: dict[str, Any]

    def failed(self) -> list[HealthGateResult]:
        """The gates that failed."""
        return [g for g in self.gates if not g.passed]


def _logged(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every log entry holding ``key`` with a number (None entries skipped)."""
    out = []
    for entry in history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((int(entry.get("step", len(out) + 1)), float(value)))
    return out


def check_health(history: Sequence[Mapping[str, Any]], gates: HealthGates) -> HealthReport:
    """Evaluate the health gates on a trainer's log history (``trainer.state.log_history``).

    Args:
        history: log entries as ``transformers.Trainer`` writes them: dicts with ``step`` and,
            on training steps, ``loss`` and ``grad_norm`` (the end-of-training summary, which
            has ``train_loss`` instead, is ignored).
        gates: the bounds.

    Returns:
        The report (never raises on a failed gate; see :func:`enforce_health`). Gates:
        ``finite`` — at least one loss logged and every loss and gradient norm finite;
        ``grad_norm_band`` — every finite gradient norm within ``[grad_norm_min, grad_norm_max]``;
        ``loss_trend`` — least-squares slope (``numpy.polyfit(steps, losses, 1)``) of the last
        ``loss_trend_window`` finite losses <= ``loss_trend_max_slope``.
    """
    import numpy as np

    losses, norms = _logged(history, "loss"), _logged(history, "grad_norm")
    results = []
    bad = [(s, v) for s, v in losses + norms if not math.isfinite(v)]
    if not losses:
        results.append(HealthGateResult(name="finite", passed=False, detail="training logged no loss"))
    else:
        results.append(HealthGateResult(
            name="finite", passed=not bad,
            detail=f"not finite (step, value): {bad}" if bad else f"{len(losses)} losses finite",
        ))
    outside = [(s, v) for s, v in norms
               if math.isfinite(v) and not gates.grad_norm_min <= v <= gates.grad_norm_max]
    results.append(HealthGateResult(
        name="grad_norm_band", passed=not outside, evaluated=bool(norms),
        detail=(f"gradient norms outside [{gates.grad_norm_min}, {gates.grad_norm_max}] "
                f"(step, grad_norm): {outside}") if outside else
               f"{len(norms)} gradient norms within [{gates.grad_norm_min}, {gates.grad_norm_max}]",
    ))
    slope = None
    finite_losses = [(s, v) for s, v in losses if math.isfinite(v)]
    window = gates.loss_trend_window
    if window == 0:
        results.append(HealthGateResult(name="loss_trend", passed=True, evaluated=False, detail="gate off"))
    elif len(finite_losses) < window:
        results.append(HealthGateResult(
            name="loss_trend", passed=True, evaluated=False,
            detail=f"{len(finite_losses)} finite losses logged, the window needs {window}",
        ))
    else:
        tail = finite_losses[-window:]
        xs = np.array([s for s, _ in tail], dtype=float)
        ys = np.array([v for _, v in tail], dtype=float)
        slope = float(np.polyfit(xs, ys, 1)[0])
        rising = slope > gates.loss_trend_max_slope
        results.append(HealthGateResult(
            name="loss_trend", passed=not rising,
            detail=(f"least-squares slope {slope:.4g} per step over the last {window} losses "
                    f"{'exceeds' if rising else 'is within'} the tolerance "
                    f"{gates.loss_trend_max_slope}; (step, loss): {tail}"),
        ))
    return HealthReport(
        passed=all(r.passed for r in results), gates=results, losses=losses, grad_norms=norms,
        loss_slope=slope, gates_config=gates.model_dump(mode="json"),
    )


def enforce_health(report: HealthReport, hyperparameters: Mapping[str, Any]) -> None:
    """Raise if a gate failed.

    Raises:
        BurstDivergedError: the ``finite`` gate failed (message: ``training loss is not finite
            (step, loss): [...]; (step, grad_norm): [...]`` or ``training logged no loss``).
        BurstHealthError: another gate failed (message: each failed gate and its evidence).
        Both carry ``report`` and name the hyperparameters.
    """
    failed = report.failed()
    if not failed:
        return
    if any(g.name == "finite" for g in failed):
        if not report.losses:
            raise BurstDivergedError(f"training logged no loss; hyperparameters {dict(hyperparameters)}", report)
        raise BurstDivergedError(
            f"training loss is not finite (step, loss): {report.losses}; (step, grad_norm): "
            f"{report.grad_norms}; hyperparameters {dict(hyperparameters)}", report,
        )
    raise BurstHealthError(
        "burst failed its health gate(s): "
        + "; ".join(f"{g.name}: {g.detail}" for g in failed)
        + f"; hyperparameters {dict(hyperparameters)}", report,
    )


def health_callback(gates: HealthGates) -> Any:
    """A ``transformers.TrainerCallback`` that stops training at the first bad logged value.

    On each log with a ``loss`` or ``grad_norm`` it sets ``control.should_training_stop`` when
    the value is not finite or the gradient norm is outside the band, so a diverged burst does
    not spend its remaining steps; :func:`check_health` then reports the evidence. The trend gate
    is only judged after training (it needs the whole window).
    """
    from transformers import TrainerCallback

    class HealthGateCallback(TrainerCallback):
        def __init__(self) -> None:
            self.stopped_at: int | None = None

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            logs = logs or {}
            values = [logs.get(k) for k in ("loss", "grad_norm")]
            bad = any(isinstance(v, (int, float)) and not math.isfinite(v) for v in values)
            norm = logs.get("grad_norm")
            if isinstance(norm, (int, float)) and math.isfinite(norm):
                bad = bad or not gates.grad_norm_min <= norm <= gates.grad_norm_max
            if bad:
                self.stopped_at = int(state.global_step)
                control.should_training_stop = True

    return HealthGateCallback()
