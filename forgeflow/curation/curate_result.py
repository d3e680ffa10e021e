"""What the ``curate`` flow returns: a frozen model whose field names are the keys that flow returned as a
dict before (the ``recover`` flow returns :class:`forgeflow.curation.recovery.RecoveryResult`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CurateStatus = Literal["freeze-ready", "exhausted"]
"""How a curate run ended: the freeze check passed, or no candidate was left to validate."""


class CurateResult(BaseModel):
    """How one ``curate`` run ended."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: CurateStatus = Field(description="freeze-ready or exhausted.")
    batches: list[str] = Field(description="Batch ids this run validated, in order.")
    trials_recorded: int = Field(ge=0, description="NOP/Oracle trials this run recorded (count).")
    counts: dict[str, int] = Field(description="Split -> accepted tasks the freeze selection puts in it.")
    unmet: list[str] = Field(description="Unmet quotas as text (empty when freeze-ready).")
    event_id: str | None = Field(default=None, description="The freeze-ready event's id (None when exhausted).")
    freeze_name: str = Field(min_length=1, description="The name the freeze-on-ready automation freezes under.")
    validated: list[str] = Field(default_factory=list, description="Instance ids this run validated, in batch "
                                 "order.")

    @model_validator(mode="after")
    def _status_agrees(self) -> CurateResult:
        """``freeze-ready`` has no unmet quota; ``exhausted`` names them and has no event."""
        if self.status == "freeze-ready" and self.unmet:
            raise ValueError(f"a freeze-ready result has no unmet quota, got {self.unmet}")
        if self.status == "exhausted" and (not self.unmet or self.event_id is not None):
            raise ValueError("an exhausted result names its unmet quotas and has no freeze-ready event")
        return self
