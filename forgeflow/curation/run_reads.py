"""A curate run's reads of the store, scoped to the run's own candidates (never the whole store).

Every query filters on the run's ids in chunks of :data:`IDS_PER_QUERY`, so a batch's cost does not
grow with the store. The candidate set is recorded once as a batch row of kind
:data:`CANDIDATE_SET_KIND`, which the freeze-ready event names (a fixed-size reference).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_json
from forgeflow.curation.freeze import TaskRef
from forgeflow.ledger.records import BatchRecord
from forgeflow.ledger.tables import Batch, TaskInstance, Trial

IDS_PER_QUERY = 500
"""Instance ids per ``IN`` list (well under SQLite's oldest bound of 999 bound parameters)."""

CANDIDATE_SET_KIND = "candidates"
"""The ``batches.kind`` of a curate run's candidate set (:func:`candidate_set_record`)."""


def _chunks(ids: Sequence[str]) -> Iterator[list[str]]:
    """``ids`` (deduplicated, sorted) in lists of at most :data:`IDS_PER_QUERY`."""
    unique = sorted(set(ids))
    for start in range(0, len(unique), IDS_PER_QUERY):
        yield unique[start:start + IDS_PER_QUERY]


class CurationState(BaseModel):
    """What the store says about a curate run's candidates before a batch."""

    model_config = ConfigDict(frozen=True)

    accepted: list[TaskRef] = Field(description="the accepted tasks among the run's candidates, by instance id")
    processed: set[str] = Field(description="the run's candidates with a final status (accepted, rejected or error)")
    accepted_per_repo: dict[str, int] = Field(
        description="repository -> accepted tasks among the run's candidates (none: absent)")


def curation_state(engine: Engine, instance_ids: Sequence[str]) -> CurationState:
    """The state of the run whose candidates are ``instance_ids`` (ids without a store row count as not processed)."""
    accepted: list[TaskRef] = []
    processed: set[str] = set()
    per_repo: dict[str, int] = {}
    with Session(engine) as session:
        for chunk in _chunks(instance_ids):
            statement = (select(TaskInstance.instance_id, TaskInstance.repo, TaskInstance.status)
                         .where(TaskInstance.instance_id.in_(chunk), TaskInstance.status != "candidate"))
            for instance_id, repo, status in session.execute(statement):
                processed.add(instance_id)
                if status == "accepted":
                    accepted.append(TaskRef(instance_id=instance_id, repo=repo))
                    per_repo[repo] = per_repo.get(repo, 0) + 1
    accepted.sort(key=lambda task: task.instance_id)
    return CurationState(accepted=accepted, processed=processed, accepted_per_repo=per_repo)


def known_instance_ids(engine: Engine, instance_ids: Sequence[str]) -> set[str]:
    """Which of ``instance_ids`` the store has a task row for (primary-key lookups in chunks)."""
    known: set[str] = set()
    with Session(engine) as session:
        for chunk in _chunks(instance_ids):
            known.update(session.scalars(select(TaskInstance.instance_id).where(TaskInstance.instance_id.in_(chunk))))
    return known


def voided_nop_attempts(engine: Engine, instance_ids: Sequence[str]) -> dict[str, int]:
    """Instance id -> how many of its NOP trials were voided (``recover``), for every id given (0 when none):
    one grouped count per chunk on the ``trials.instance_id`` index. At least the voided attempts (a validation
    that reached its NOP repeats has more than one NOP trial), so a run key numbered from it is never reused."""
    counts = dict.fromkeys(instance_ids, 0)
    with Session(engine) as session:
        for chunk in _chunks(instance_ids):
            statement = (select(Trial.instance_id, func.count()).where(
                Trial.instance_id.in_(chunk), Trial.kind == "nop", Trial.voided_at.is_not(None))
                .group_by(Trial.instance_id))
            counts.update({instance_id: n for instance_id, n in session.execute(statement)})
    return counts


def candidate_set_digest(instance_ids: Sequence[str]) -> str:
    """The hex sha256 of the sorted, deduplicated ``instance_ids`` (canonical JSON): what names a candidate set."""
    return sha256_json(sorted(set(instance_ids)))


def candidate_set_record(instance_ids: Sequence[str], run_id: str | None) -> BatchRecord:
    """The batch row recording a curate run's candidate set: id ``candidates-<32 hex of its digest>``, kind
    :data:`CANDIDATE_SET_KIND`, the sorted ids.

    Raises:
        InputError: ``instance_ids`` is empty.
    """
    if not instance_ids:
        raise InputError("a candidate set needs at least one instance id")
    ids = sorted(set(instance_ids))
    return BatchRecord(batch_id=f"{CANDIDATE_SET_KIND}-{candidate_set_digest(ids)[:32]}", kind=CANDIDATE_SET_KIND,
                       instance_ids=ids, concurrency=1, run_id=run_id)


def candidate_set_ids(engine: Engine, batch_id: str) -> list[str]:
    """The instance ids of the candidate set ``batch_id`` (:func:`candidate_set_record`), sorted.

    Raises:
        InputError: no candidate set of that id in the store, or its ids do not match its digest.
    """
    with Session(engine) as session:
        row = session.execute(select(Batch.kind, Batch.instance_ids).where(Batch.batch_id == batch_id)).first()
    if row is None or row.kind != CANDIDATE_SET_KIND:
        raise InputError(f"the store holds no candidate set {batch_id!r} (a curate run's freeze-ready event names "
                         f"one: {CANDIDATE_SET_KIND}-<32 hex>)")
    ids = sorted(row.instance_ids)
    if f"{CANDIDATE_SET_KIND}-{candidate_set_digest(ids)[:32]}" != batch_id:
        raise InputError(f"candidate set {batch_id!r}: its {len(ids)} recorded ids do not match its digest")
    return ids
