"""What the ``curate`` and ``recover`` flows return: frozen models whose field names are the keys those
flows returned as dicts before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.curation.recovery import Summary

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


class RecoverResult(BaseModel):
    """What one ``recover`` run listed (dry run: ``void``, ``requeue``, ``kept``) or did (applied: the other
    fields); the other group stays None.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dry_run: bool = Field(description="True: nothing changed; the lists say what would.")
    void: list[str] | None = Field(default=None, description="Dry run: trial ids that would be voided.")
    requeue: list[str] | None = Field(default=None, description="Dry run: instance ids that would be requeued.")
    kept: list[str] | None = Field(default=None, description="Dry run: selected trial ids left as they are.")
    recovery_id: str | None = Field(default=None, description="Applied: the recovery's id.")
    voided: int | None = Field(default=None, ge=0, description="Applied: trials newly marked void (count).")
    requeued: int | None = Field(default=None, ge=0, description="Applied: tasks put back to candidate (count).")
    backup_path: Path | None = Field(default=None, description="Applied: the backup JSON (None: nothing to back up).")
    backup_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                      description="Applied: the backup's sha256.")
    after: Summary | None = Field(default=None, description="Applied: the store's counts after the recovery.")

    @model_validator(mode="after")
    def _one_kind(self) -> RecoverResult:
        """A dry run carries only the lists; an applied recovery only what it did."""
        listed = (self.void, self.requeue, self.kept)
        applied = (self.recovery_id, self.voided, self.requeued, self.after)
        if self.dry_run and (any(v is None for v in listed) or any(v is not None for v in applied)):
            raise ValueError("a dry run lists void, requeue and kept, and has no recovery_id, counts or after")
        if not self.dry_run and (any(v is not None for v in listed) or any(v is None for v in applied)):
            raise ValueError("an applied recovery has recovery_id, voided, requeued and after, and no dry-run lists")
        if self.dry_run and (self.backup_path is not None or self.backup_sha256 is not None):
            raise ValueError("a dry run writes no backup")
        return self
