"""Group commit: rows that many threads record as their work ends, written in shared transactions, each caller
returning only once its own row is committed.

The canary records every agent trial the moment it ends (a crash must lose no trial), from as many threads as it
runs trials at once. One transaction per trial costs a commit (and its fixed cost) per trial. :class:`GroupCommit`
keeps the guarantee and shares the commits: a caller queues its rows; when no write is under way it becomes the
writer and writes everything queued (its own rows and any other thread's) in ONE call of ``write``; callers that
queued while a write was under way wait on their own event, and when the write ends the oldest of them writes
next, taking every row queued by then (after yielding the interpreter once, so that the callers the last write
released can queue their next rows and join it). Nothing is held back by a timer or a size: a lone caller writes
at once (the latency of one transaction, as before). This is the group commit of database logs (Gray and Reuter,
*Transaction Processing: Concepts and Techniques*, 1993; PostgreSQL's ``commit_delay`` without the delay:
https://www.postgresql.org/docs/current/wal-configuration.html). Measured (``benchmarks.scale_ledger``, 8 threads,
2 busy cores): ~3.5 trials per transaction with a plain condition variable, ~7 with the hand-over and the yield,
and twice the trials/s.

What a crash can lose: nothing a caller was told is recorded. A process killed while a write is under way loses
that write's rows with the transaction (all or none of them); their callers had not returned, so their trials had
not been reported as recorded either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

_T = TypeVar("_T")


class _Queued(Generic[_T]):
    """One caller's rows, the event its thread waits on, and the outcome of the write that took them."""

    __slots__ = ("done", "error", "item", "woken")

    def __init__(self, item: _T) -> None:
        self.item = item
        self.done = False
        self.error: BaseException | None = None
        self.woken = threading.Event()


class GroupCommit(Generic[_T]):
    """Items recorded by many threads, written together by whichever caller finds no write under way.

    A caller that queues while a write is under way waits on its own event (no thread is woken for another's
    rows): the writer wakes the callers of the batch it wrote, and hands the next write to the oldest caller
    still queued, who writes every item queued by then.

    Args:
        write: writes a batch of items in ONE transaction (all or none), raising when it cannot; called by one
            thread at a time with 1 to ``max_batch`` items, oldest first.
        max_batch: most items one ``write`` takes (>= 1): bounds one transaction's size.

    Raises:
        ValueError: ``max_batch`` < 1.
    """

    def __init__(self, write: Callable[[Sequence[_T]], None], max_batch: int = 1000) -> None:
        if max_batch < 1:
            raise ValueError(f"GroupCommit: max_batch {max_batch} must be >= 1")
        self._write = write
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Queued[_T]] = []
        self._writing = False
        self.writes = 0
        """Calls of ``write`` so far (transactions)."""
        self.items_written = 0
        """Items those calls wrote."""

    def record(self, item: _T) -> None:
        """Queue ``item`` and return once a write that took it has committed.

        Raises:
            BaseException: whatever ``write`` raised for the batch that held ``item`` (the batch is not written;
                each of its callers gets the error; later batches are tried afresh).
        """
        mine = _Queued(item)
        with self._lock:
            self._queue.append(mine)
            leading = not self._writing
            self._writing = True
        if not leading:
            mine.woken.wait()  # set when a write took it (done) or when this thread is to write next
        if not mine.done:
            self._write_queued()
        if mine.error is not None:
            raise mine.error

    def _write_queued(self) -> None:
        """Write the oldest ``max_batch`` queued items (this thread is the one writer), wake their callers, then
        hand the next write to the oldest caller left (or end the writing when none is)."""
        time.sleep(0)  # let callers just woken by the last write queue their next rows: they join this one
        with self._lock:
            batch, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
        error: BaseException | None = None
        try:
            self._write([queued.item for queued in batch])
        except BaseException as exc:  # noqa: BLE001 - handed to every caller of the batch below
            error = exc
        with self._lock:
            self.writes += 1
            self.items_written += 0 if error is not None else len(batch)
            successor = self._queue[0] if self._queue else None
            self._writing = successor is not None
        for queued in batch:
            queued.done, queued.error = True, error
            queued.woken.set()
        if successor is not None:
            successor.woken.set()
