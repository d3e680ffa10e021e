"""The circuit breaker of :class:`forgeflow.evaluation.model_client.ModelClient` (Nygard, "Release It!",
2007; the closed/open/half-open states of Fowler's "CircuitBreaker", 2014): after
``failure_threshold`` consecutive failed attempts the circuit opens and every call is refused
(:class:`~forgeflow.common.errors.CircuitOpenError`) without being sent; after ``cooldown_s`` it is
half-open and exactly one caller is let through as the probe; the probe's success closes it, its
failure re-opens it. Thread-safe (one lock per breaker).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from forgeflow.common.errors import CircuitOpenError, InputError


class CircuitState(str, Enum):
    """States of a :class:`CircuitBreaker`."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """A thread-safe circuit breaker for one endpoint (share one instance per endpoint).

    Args:
        failure_threshold: Consecutive failures that open the circuit (>= 1).
        cooldown_s: Seconds the circuit stays open before admitting a probe (>= 0).

    Raises:
        InputError: a bound is violated.
    """

    def __init__(
        self, failure_threshold: int = 5, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise InputError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise InputError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    @property
    def state(self) -> CircuitState:
        """The current state (an open circuit past its cool-down reads as half-open)."""
        with self._lock:
            if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                return CircuitState.HALF_OPEN
            return self._state

    @property
    def consecutive_failures(self) -> int:
        """Failures since the last success."""
        with self._lock:
            return self._failures

    def acquire(self) -> None:
        """Admit one call, or refuse it.

        Raises:
            CircuitOpenError: the circuit is open, or half-open with its probe already in flight.
        """
        with self._lock:
            if self._state is CircuitState.CLOSED:
                return
            if self._state is CircuitState.OPEN:
                waited_s = self._clock() - self._opened_at
                if waited_s < self.cooldown_s:
                    raise CircuitOpenError(
                        f"circuit open after {self._failures} consecutive failures; "
                        f"next probe in {self.cooldown_s - waited_s:.1f} s"
                    )
                self._state = CircuitState.HALF_OPEN
                self._probe_in_flight = False
            if self._probe_in_flight:
                raise CircuitOpenError("circuit half-open and its one probe is in flight")
            self._probe_in_flight = True

    def record_success(self) -> None:
        """The admitted call reached a working endpoint: close the circuit."""
        with self._lock:
            self._state = CircuitState.CLOSED
            self._failures = 0
            self._probe_in_flight = False

    def record_failure(self) -> None:
        """The admitted call failed at the endpoint: count it, open the circuit at the threshold."""
        with self._lock:
            self._failures += 1
            if self._state is CircuitState.HALF_OPEN or self._failures >= self.failure_threshold:
                self._state = CircuitState.OPEN
                self._opened_at = self._clock()
            self._probe_in_flight = False

    def release(self) -> None:
        """The admitted call ended without a verdict (cancelled): let the next caller probe."""
        with self._lock:
            self._probe_in_flight = False
