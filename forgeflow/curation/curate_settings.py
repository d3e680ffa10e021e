"""How a ``curate`` run validates its candidates (one parameter group of the ``curate`` flow)."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from forgeflow.curation.selection import DEFAULT_BATCH_SIZE
from forgeflow.sandbox.limits import DEFAULT_VERIFIER_TIMEOUT_S, LimitOverrides, SandboxLimits, VerifierTimeoutS
from forgeflow.sandbox.trial import ValidationChecks, ValidationSettings

DEFAULT_CONCURRENCY = 10
"""NOP/Oracle validations a curate run keeps in flight by default."""


class CurateSettings(LimitOverrides):
    """How a curate run validates: its batches, their pace and retries, each validation's limits
    (``memory_mb`` and ``cpus``: :class:`~forgeflow.sandbox.limits.LimitOverrides`, None leaves them to
    the run's sandbox block, else the defaults).

    Attributes:
        batch_size: candidates per batch (:func:`forgeflow.curation.selection.select_batch`), >= 1.
        concurrency: NOP/Oracle validations in flight at once, >= 1.
        max_retries: extra attempts for a validation that ended in an infrastructure error, >= 0.
        verifier_timeout_s: absolute limit per test run, seconds (> 0).
        seed: orders the candidates and the splits (same seed, same batches; part of the default
            freeze name and of the freeze-ready event).
        checks: Oracle runs per task that would be accepted (default 2: a task whose runs disagree is
            flaky), the flaky policy (``reject`` or ``drop_flaky_pass_to_pass``) and the log parser
            for runners without forgeflow's pytest report (:class:`forgeflow.sandbox.trial.ValidationChecks`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, ge=1, description="Candidates per batch.")
    concurrency: int = Field(default=DEFAULT_CONCURRENCY, ge=1,
                             description="NOP/Oracle validations in flight at once.")
    max_retries: int = Field(default=2, ge=0, description="Extra attempts for a validation that ended in an "
                                                          "infrastructure error.")
    verifier_timeout_s: VerifierTimeoutS = DEFAULT_VERIFIER_TIMEOUT_S
    seed: int = Field(default=0, description="Orders candidates and splits (same seed, same batches).")
    checks: ValidationChecks = Field(default_factory=ValidationChecks,
                                     description="Oracle repeats, flaky policy and log parser.")

    def validation(self, block: SandboxLimits | None = None) -> ValidationSettings:
        """What each validation of the run takes: the verifier's limit, the limits (these settings' own,
        else ``block``'s, the run's sandbox block's; :meth:`LimitOverrides.over`) and the checks."""
        return ValidationSettings(verifier_timeout_s=self.verifier_timeout_s, checks=self.checks,
                                  **self.over(block).model_dump())
