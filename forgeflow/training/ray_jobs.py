"""Ray Jobs through Ray's own ``JobSubmissionClient`` (imported lazily); a job forgeflow started never
outlives the run that follows it (:func:`follow` stops it on Prefect's ``TerminationSignal``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors

TERMINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
"""Ray ``JobStatus`` values after which a job never changes."""
_LOG_TAIL_CHARS = 3000


class RayJobError(errors.InfraError):
    """A Ray job ended FAILED or STOPPED; the message has its status, Ray's message and its log's end."""


class RayJobOutcome(BaseModel):
    """How a followed job ended."""

    model_config = ConfigDict(frozen=True)

    submission_id: str
    status: str = Field(description="SUCCEEDED (anything else raises RayJobError)")
    message: str = Field(description="Ray's status message")
    log_lines: int = Field(description="lines of the job's log handed to the callback")
    wall_s: float = Field(description="seconds from the first poll to the end")


def client(dashboard_url: str) -> Any:
    """A :class:`ray.job_submission.JobSubmissionClient` for the cluster's dashboard (job server).

    Raises:
        InputError: ``dashboard_url`` is not http(s).
        ToolMissingError: Ray is not installed (``pip install 'ray[default]'``).
        TransientInfraError: the job server does not answer (the client checks its version on connect).
    """
    if not dashboard_url.startswith(("http://", "https://")):
        raise errors.InputError(f"dashboard_url must be an http(s) URL, got {dashboard_url!r}")
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:  # pragma: no cover - ray is a pinned dependency
        raise errors.ToolMissingError(f"Ray is not installed ({exc}); pip install 'ray[default]'") from exc
    try:
        return JobSubmissionClient(dashboard_url)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise errors.TransientInfraError(f"the Ray job server at {dashboard_url} does not answer: {exc}") from exc


def submit(dashboard_url: str, entrypoint: str, submission_id: str, runtime_env: dict[str, Any] | None = None,
           metadata: dict[str, str] | None = None, entrypoint_num_cpus: float | None = None) -> str:
    """Submit a job; returns its submission id (Ray refuses a reused id, so a retry cannot start it twice).

    Raises:
        InputError / ToolMissingError / TransientInfraError: see :func:`client`; InfraError: the job was refused.
    """
    jobs = client(dashboard_url)
    try:
        return jobs.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env or None,
                               metadata=metadata or None, entrypoint_num_cpus=entrypoint_num_cpus)
    except RuntimeError as exc:  # the job server's non-200 answers
        raise errors.InfraError(f"the Ray job server at {dashboard_url} refused job {submission_id}: {exc}") from exc


def status(dashboard_url: str, submission_id: str) -> tuple[str, str]:
    """``(status, message)`` of a job (status one of Ray's ``JobStatus`` names).

    Raises:
        InfraError: the job server does not know the job.
    """
    return _status(client(dashboard_url), submission_id)


def _status(jobs: Any, submission_id: str) -> tuple[str, str]:
    try:
        info = jobs.get_job_info(submission_id)
    except RuntimeError as exc:
        raise errors.InfraError(f"Ray job {submission_id}: {exc}") from exc
    return str(getattr(info.status, "value", info.status)), str(info.message or "")


def stop(dashboard_url: str, submission_id: str, wait_s: float = 60.0) -> str:
    """Stop a job and wait (at most ``wait_s`` seconds) until it is in a terminal state; returns that
    state (``STOPPED``, or how it ended if it already had). Never raises for a job that already ended."""
    jobs = client(dashboard_url)
    state, _ = _status(jobs, submission_id)
    if state in TERMINAL_STATES:
        return state
    jobs.stop_job(submission_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        state, _ = _status(jobs, submission_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.5)
    return state


def follow(dashboard_url: str, submission_id: str, on_log: Callable[[str], None], poll_s: float = 2.0,
           timeout_s: float | None = None) -> RayJobOutcome:
    """Poll a job until it ends, handing each new log line to ``on_log``; returns a SUCCEEDED job's outcome.

    Raises:
        RayJobError: the job ended FAILED or STOPPED, or ran past ``timeout_s`` (stopped then).
        BaseException: whatever interrupted the wait, after the job was stopped (:func:`stop`).
    """
    if poll_s <= 0:
        raise errors.InputError(f"poll_s must be > 0, got {poll_s}")
    jobs = client(dashboard_url)
    start = time.monotonic()
    seen = 0
    lines = 0
    try:
        while True:
            state, message = _status(jobs, submission_id)
            text = jobs.get_job_logs(submission_id) or ""
            chunk = text[seen:]
            if state not in TERMINAL_STATES:  # a line still being written waits for its newline
                chunk = chunk[:chunk.rfind("\n") + 1]
            for line in chunk.splitlines():
                on_log(line)
                lines += 1
            seen += len(chunk)
            if state in TERMINAL_STATES:
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                stop(dashboard_url, submission_id)
                raise RayJobError(f"Ray job {submission_id} ran past {timeout_s:g} s and was stopped")
            time.sleep(poll_s)
    except RayJobError:
        raise
    except BaseException:
        stop(dashboard_url, submission_id)
        raise
    if state != "SUCCEEDED":
        reason = message.split(", last available logs")[0].strip() or "no message"  # Ray appends the log
        raise RayJobError(f"Ray job {submission_id} ended {state}: {reason}; its log ends "
                          f"{text.strip()[-_LOG_TAIL_CHARS:]!r}")
    return RayJobOutcome(submission_id=submission_id, status=state, message=message, log_lines=lines,
                         wall_s=round(time.monotonic() - start, 3))
