"""Health gates of a burst (SFT and RL): logged values must stay finite, in band and not rising."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError


class BurstHealthError(InputError):
    """A burst failed a health gate; ``report`` holds every logged loss and gradient norm. Never retried."""

    def __init__(self, message: str, report: "HealthReport | None" = None) -> None:
        super().__init__(message)
        self.report = report


class BurstDivergedError(BurstHealthError):
    """Training produced a NaN or infinite loss or gradient norm, or logged no loss at all (the
    message lists the logged values)."""


# --- health gates ----------------------------------------------------------------------------
class HealthGates(BaseModel):
    """Health gates checked during and after a burst."""

    model_config = ConfigDict(frozen=True)

    grad_norm_min: float = Field(default=0.0, ge=0.0,
        description="smallest allowed gradient norm (L2, before clipping); 0 allows zero-advantage RL steps")
    grad_norm_max: float = Field(default=1e4, gt=0.0,
        description="largest allowed gradient norm; above it the step is an explosion")
    loss_trend_window: int = Field(default=10, ge=0,
        description="recent losses the trend gate fits a line to (evaluated once full); 0: off")
    loss_trend_max_slope: float = Field(0.05, description="largest allowed loss slope (nats per token per logged step)")

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
    """One gate's verdict."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="finite, grad_norm_band or loss_trend")
    passed: bool = Field(description="False iff the gate was evaluated and failed")
    evaluated: bool = Field(True, description="False when there was not enough history (the gate then passes)")
    detail: str = Field("", description="the evidence in words (values, steps, bounds)")


class HealthReport(BaseModel):
    """The health of one burst: every gate's verdict and the logged values behind them."""

    model_config = ConfigDict(frozen=True)

    passed: bool = Field(description="True iff every gate passed")
    gates: list[HealthGateResult]
    losses: list[tuple[int, float]] = Field(
        description="(step, loss) as logged (nats per token for SFT; the policy surrogate for GRPO/RLOO)")
    grad_norms: list[tuple[int, float]] = Field(description="(step, gradient norm) as logged")
    loss_slope: float | None = Field(None,
        description="the trend gate's fitted slope (loss per step); None when not evaluated")
    gates_config: dict[str, Any] = Field(description="the gates checked, as a dict")

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
    """Evaluate the gates on ``trainer.state.log_history`` (never raises): ``finite``, ``grad_norm_band``, and
    ``loss_trend`` (``numpy.polyfit`` slope of the last ``loss_trend_window`` losses).
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
        BurstDivergedError: the ``finite`` gate failed (the message lists (step, loss) and (step, grad_norm)).
        BurstHealthError: another gate failed (each failed gate and its evidence).
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
    """A ``TrainerCallback`` that stops training at the first non-finite or out-of-band logged value."""
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
