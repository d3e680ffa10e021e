"""Burst health gates (forgeflow.training.health; no training: log histories shaped as
``transformers.Trainer`` writes them, the real ``TrainerCallback`` machinery)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from forgeflow.training.health import (
    BurstDivergedError,
    BurstHealthError,
    HealthGates,
    check_health,
    enforce_health,
    health_callback,
)


def _history(losses: list[float], grad_norms: list[float] | None = None) -> list[dict]:
    """A Trainer log history: one entry per step, then the end-of-training summary."""
    norms = grad_norms or [1.0] * len(losses)
    entries = [{"loss": loss, "grad_norm": norm, "learning_rate": 1e-3, "step": i + 1, "epoch": 0.1 * (i + 1)}
               for i, (loss, norm) in enumerate(zip(losses, norms))]
    return entries + [{"train_runtime": 1.0, "train_loss": 1.0, "step": len(losses)}]


# --- gates -----------------------------------------------------------------------------------
def test_healthy_history_passes_every_gate() -> None:
    report = check_health(_history([3.0, 2.8, 2.9, 2.5, 2.4]), HealthGates(loss_trend_window=5))
    assert report.passed and [g.name for g in report.gates] == ["finite", "grad_norm_band", "loss_trend"]
    assert report.loss_slope is not None and report.loss_slope < 0
    enforce_health(report, {})  # no raise


def test_injected_nan_loss_fails_its_gate_with_the_logged_values() -> None:
    report = check_health(_history([3.0, float("nan"), 2.5]), HealthGates())
    assert not report.passed and [g.name for g in report.failed()] == ["finite"]
    with pytest.raises(BurstDivergedError, match=r"not finite \(step, loss\): \[\(1, 3\.0\), \(2, nan\)") as info:
        enforce_health(report, {"learning_rate": 1.0})
    assert "learning_rate" in str(info.value) and math.isnan(info.value.report.losses[1][1])


def test_infinite_grad_norm_and_missing_loss_fail_the_finite_gate() -> None:
    with pytest.raises(BurstDivergedError, match="grad_norm"):
        enforce_health(check_health(_history([3.0, 2.0], [1.0, float("inf")]), HealthGates()), {})
    with pytest.raises(BurstDivergedError, match="logged no loss"):
        enforce_health(check_health([{"train_runtime": 1.0, "step": 0}], HealthGates()), {})


@pytest.mark.parametrize(("norms", "bad"), [([1.0, 5e4, 2.0], "(2, 50000.0)"), ([1.0, 0.001, 2.0], "(2, 0.001)")])
def test_grad_norm_outside_the_band_fails_naming_step_and_value(norms: list[float], bad: str) -> None:
    gates = HealthGates(grad_norm_min=0.01, grad_norm_max=1e4)
    report = check_health(_history([3.0, 2.9, 2.8], norms), gates)
    assert [g.name for g in report.failed()] == ["grad_norm_band"]
    with pytest.raises(BurstHealthError, match=r"grad_norm_band: .*\[0\.01, 10000\.0\]") as info:
        enforce_health(report, {})
    assert bad in str(info.value) and not isinstance(info.value, BurstDivergedError)


def test_rising_loss_trend_fails_and_short_history_is_not_evaluated() -> None:
    gates = HealthGates(loss_trend_window=4, loss_trend_max_slope=0.01)
    rising = check_health(_history([5.0, 2.0, 2.1, 2.3, 2.2, 2.6]), gates)
    trend = rising.failed()[0]
    assert trend.name == "loss_trend" and rising.loss_slope == pytest.approx(0.7 / 5)  # sum(dx*dy)/sum(dx^2) over steps 3..6
    with pytest.raises(BurstHealthError, match=r"loss_trend: least-squares slope 0\.14 .* exceeds"):
        enforce_health(rising, {})
    short = check_health(_history([2.0, 2.5, 3.0]), gates)
    assert short.passed and not short.gates[2].evaluated and short.loss_slope is None
    off = check_health(_history([1.0, 2.0, 3.0, 4.0]), HealthGates(loss_trend_window=0))
    assert off.passed


def test_gate_bounds_are_validated_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="grad_norm_min"):
        HealthGates(grad_norm_min=10.0, grad_norm_max=1.0)
    with pytest.raises(ValidationError, match="loss_trend_window"):
        HealthGates(loss_trend_window=2)


def test_health_callback_stops_training_at_the_first_bad_value() -> None:
    from transformers import TrainerControl, TrainerState

    callback, state, control = health_callback(HealthGates(grad_norm_max=100.0)), TrainerState(), TrainerControl()
    state.global_step = 1
    callback.on_log(None, state, control, logs={"loss": 2.0, "grad_norm": 3.0})
    assert not control.should_training_stop
    state.global_step = 2
    callback.on_log(None, state, control, logs={"loss": 2.0, "grad_norm": 500.0})
    assert control.should_training_stop and callback.stopped_at == 2
    control = TrainerControl()
    callback.on_log(None, state, control, logs={"loss": float("nan")})
    assert control.should_training_stop


# --- preflight -------------------------------------------------------------------------------
