"""The hang watchdog on a controlled clock: it calls back once, only after the idle limit."""

from __future__ import annotations

import threading
import time

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.supervision import HangWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1_760_000_000.0

    def __call__(self) -> float:
        return self.now


def _wait(event: threading.Event, timeout_s: float = 2.0) -> bool:
    return event.wait(timeout_s)


def test_activity_keeps_the_run_alive_and_idleness_past_the_limit_is_a_hang() -> None:
    clock, calls = Clock(), []
    done = threading.Event()
    dog = HangWatchdog(60.0, lambda check: (calls.append(check), done.set()), poll_s=0.01, clock=clock)
    with dog:
        clock.now += 59.0
        dog.touch_message()
        clock.now += 59.0
        dog.touch_model_call()
        clock.now += 60.0  # exactly at the limit: not yet hung
        time.sleep(0.1)
        assert not dog.hung and calls == []
        clock.now += 0.5
        assert _wait(done)
    assert dog.hung and len(calls) == 1
    assert calls[0].idle_s == pytest.approx(60.5) and calls[0].idle_limit_s == 60.0
    assert dog.hang == calls[0]


def test_a_failing_callback_is_kept_not_raised_and_bad_limits_are_named() -> None:
    clock = Clock()

    def boom(check: object) -> None:
        raise RuntimeError("podman gone")

    dog = HangWatchdog(1.0, boom, poll_s=0.01, clock=clock).start()
    clock.now += 2.0
    assert _wait(dog.hung_event)
    dog.stop()
    assert isinstance(dog.callback_error, RuntimeError)
    with pytest.raises(InputError, match="idle_limit_s"):
        HangWatchdog(0)
    with pytest.raises(InputError, match="before start"):
        HangWatchdog(5).check()
