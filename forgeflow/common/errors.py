"""The one exception hierarchy of forgeflow: two families under one root.

:class:`InfraError`: the infrastructure broke (a trial records an *exception*, never a reward of 0);
``transient = True`` marks what a retry may cure (:func:`is_transient`). :class:`InputError`: the user's
input is wrong, never retried. Task and model *outcomes* (tests failed, reward 0) are data, not exceptions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class ForgeflowError(Exception):
    """Root of every error forgeflow raises on purpose."""


# --- bad input -------------------------------------------------------------------------------
def validation_problems(exc: ValidationError) -> str:
    """pydantic's errors as one line, each ``"<dotted field>: <reason>"`` (the reason alone for a check of the
    whole model), ``"; "``-joined, without pydantic's ``Value error, `` prefix: the text an InputError carries."""
    return "; ".join(": ".join([*filter(None, [".".join(map(str, e["loc"]))]), e["msg"].removeprefix("Value error, ")])
                     for e in exc.errors())


class InputError(ForgeflowError, ValueError):
    """The input named in the message is invalid; nothing already recorded was changed."""


class PatchApplyError(InputError):
    """A patch does not apply to the tree it was meant for."""


class FreezeConflictError(InputError):
    """A freeze name is reused with different inputs (a frozen manifest is never overwritten)."""


class StoreNotFoundError(InputError):
    """A read-only command was pointed at a store that does not exist; nothing was created."""


class StoreInvalidError(InputError):
    """A read-only command was pointed at something that is not a forgeflow store at this revision."""


class DerivedSetConflictError(InputError):
    """A derived set would be rebuilt with different content and replacing it was not asked for."""


class PreflightError(ForgeflowError):
    """A stage's preflight found a missing prerequisite before any compute was spent."""


class GGUFError(InputError):
    """A GGUF file does not load or its metadata disagrees with the HF config."""


class PlanRejectedError(InputError):
    """A shard layout plan would exceed the tag cap of at least one repository."""


# --- infrastructure --------------------------------------------------------------------------
class InfraError(ForgeflowError):
    """The infrastructure failed. ``transient`` says whether a retry may help."""

    transient: bool = False


class TransientInfraError(InfraError):
    """An infrastructure failure that a retry with backoff may cure (5xx, 429, timeouts)."""

    transient = True


class StoreUnavailableError(TransientInfraError):
    """The store's database server could not be reached (the masked URL and its setting named)."""


class ToolMissingError(InfraError):
    """An external tool (podman, skopeo, docker-registry, debootstrap) is not installed."""


class RegistryError(InfraError):
    """A registry answered with a non-retryable error (auth failure, bad request)."""


class RegistryUnavailableError(TransientInfraError):
    """A registry is unreachable or answered 429/5xx."""


class ImageNotFoundError(InfraError):
    """An image reference does not exist in the registry or local storage."""


class MigrationIncompleteError(InfraError):
    """A migration ended with failed images (states recorded first); ``summary`` holds the summary."""

    def __init__(self, message: str, summary: object = None) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.summary))


class ImageBuildError(InfraError):
    """Building an image failed."""


class DigestMismatchError(InfraError):
    """A copied image's digest differs from its source (or a basecache tag from its base)."""


class DiskFullError(InfraError, OSError):
    """Out of space or quota (``ENOSPC``/``EDQUOT``), partial file removed; an ``OSError`` too. Not transient."""


class SandboxError(InfraError):
    """The sandbox could not start or run the environment."""


class SandboxOOMError(SandboxError):
    """The sandbox was killed for memory (exit 137 / OOM-killed)."""


class SandboxPidsLimitError(SandboxError):
    """The sandbox hit its process limit (``--pids-limit``: a fork was refused, e.g. a fork bomb)."""


class VerifierTimeoutError(SandboxError):
    """The verifier (test run) exceeded its timeout."""


class AgentTimeoutError(InfraError):
    """The agent exceeded its wall-clock budget."""


class VerifierOutputError(InfraError):
    """The verifier's output could not be parsed into test results."""


class ModelEndpointError(TransientInfraError):
    """The model endpoint refused, reset, answered 5xx or truncated a stream."""


class ServerStartError(InfraError):
    """A server (registry, model server) did not become ready in time."""


class AgentLoopError(AgentTimeoutError):
    """The supervisor stopped a dead loop (verifier still runs); ``evidence``: the LoopDetection as a dict."""

    def __init__(self, message: str, evidence: dict | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class AgentHangError(AgentTimeoutError):
    """The watchdog stopped an idle agent (verifier still runs); ``evidence``: the HangCheck as a dict."""

    def __init__(self, message: str, evidence: dict | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class PrefixMismatchError(InfraError):
    """An RL episode's policy saw a context that is not its stored token sequence: refused, no reward."""


class StepWallError(InfraError):
    """An RL step's wall bound stopped an episode: an exception of the step (no reward, never 0)."""


SCORED_DESPITE_EXCEPTION = frozenset({"AgentTimeoutError", "AgentLoopError", "AgentHangError"})
"""Exception types after which the verifier still runs and its reward is kept beside the exception
(Harbor's convention for agent timeouts, extended to the supervisor's loop and hang stops); every
other exception means "no reward"."""


def is_transient(exc: BaseException) -> bool:
    """Return True if ``exc`` is an infrastructure failure that a retry may cure."""
    return isinstance(exc, InfraError) and exc.transient


# --- serving (added by the serving engineer) -----------------------------------------------------
class SwapRolledBackError(ServerStartError):
    """A blue/green swap failed its start or gate; the previous generation keeps serving (``result``)."""

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


# --- model client ------------------------------------
class CircuitOpenError(ModelEndpointError):
    """The model endpoint's circuit breaker is open: the call was not sent. Transient."""


class ModelRequestError(InfraError):
    """The model endpoint rejected the request with a 4xx other than 429. Not transient."""


# --- model store ----------------------------------------
class ModelStoreError(InfraError):
    """The model store refused an operation for good (authentication, permission, bad request)."""


class ModelStoreUnavailableError(TransientInfraError):
    """The model store is unreachable or answered 429/5xx; a retry with backoff may cure it."""


class StaleParentCommitError(InputError):
    """A commit pinned to a parent commit was refused (HF Hub 412: the branch moved on)."""


class PublishDigestMismatchError(DigestMismatchError):
    """A published file's sha256 or size, read back from the store, differs from the local file."""
