"""The one exception hierarchy of forgeflow.

Two families under one root:

* :class:`InfraError` — the infrastructure broke (sandbox OOM, timeout, registry 5xx, image pull,
  model endpoint down). A trial that hits one records an *exception* with the class name as its
  type, never a reward of 0. ``transient = True`` marks the kinds a retry may cure; the retry
  conditions in ``tasks/`` read exactly that flag (:func:`is_transient`).
* :class:`InputError` and friends — the user's input is wrong (unknown image, a patch that does not
  apply, a GGUF that does not load, a freeze name reused). Never retried.

Task and model *outcomes* (tests failed, reward 0) are data, not exceptions.
"""

from __future__ import annotations


class ForgeflowError(Exception):
    """Root of every error forgeflow raises on purpose."""


# --- bad input -------------------------------------------------------------------------------
class InputError(ForgeflowError, ValueError):
    """The input named in the message is invalid; nothing already recorded was changed."""


class PatchApplyError(InputError):
    """A patch does not apply to the tree it was meant for."""


class FreezeConflictError(InputError):
    """A freeze name is reused with different inputs (a frozen manifest is never overwritten)."""


class StoreNotFoundError(InputError):
    """A command that only reads the store was pointed at a store that does not exist (a
    mistyped ``FORGEFLOW_HOME`` or store URL); nothing was created."""


class StoreInvalidError(InputError):
    """A command that only reads the store was pointed at a file or database that is not a
    forgeflow store (not SQLite at all, or no forgeflow schema) or whose schema is at another
    revision than this forgeflow reads; the message names the store and what to do. Nothing was
    written."""


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
    """The store's database server (PostgreSQL) could not be reached; the message names the
    masked store URL and the setting it came from."""


class ToolMissingError(InfraError):
    """An external tool (podman, skopeo, docker-registry, debootstrap) is not installed."""


class RegistryError(InfraError):
    """A registry answered with a non-retryable error (auth failure, bad request)."""


class RegistryUnavailableError(TransientInfraError):
    """A registry is unreachable or answered 429/5xx."""


class ImageNotFoundError(InfraError):
    """An image reference does not exist in the registry or local storage."""


class MigrationIncompleteError(InfraError):
    """A migration ended with failed images (each image's state and the table were recorded
    first). ``summary`` holds the flow's summary (records, coverage, failed lines)."""

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
    """A write ran out of space or quota (``ENOSPC`` / ``EDQUOT``); the message names the file, the
    filesystem and its free bytes, and the partial file was removed. Also an ``OSError`` (errno set)
    so callers that caught the raw error still do. Not transient: a retry fails the same way until
    space is freed."""


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
    """The supervisor stopped the agent in a dead loop (the same tool call, or two calls alternating,
    repeated up to the threshold; :func:`forgeflow.evaluation.supervision.detect_loop`). Like a timeout, the
    run was cut short by the harness: the verifier still runs and both are recorded, flagged.
    ``evidence`` holds the :class:`~forgeflow.evaluation.supervision.LoopDetection` as a dict."""

    def __init__(self, message: str, evidence: dict | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class AgentHangError(AgentTimeoutError):
    """The supervisor's watchdog stopped the agent after no new message or model call for the idle
    limit (:func:`forgeflow.evaluation.supervision.detect_hang`). Treated like a timeout (the verifier still
    runs). ``evidence`` holds the :class:`~forgeflow.evaluation.supervision.HangCheck` as a dict."""

    def __init__(self, message: str, evidence: dict | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class PrefixMismatchError(InfraError):
    """An agentic RL episode's policy conditioned on a context that is not the episode's stored token
    sequence (a re-tokenized history; :func:`forgeflow.training.episodes.prefix_mismatch`): the episode is
    refused (no reward, no loss) and counted in its step's stats."""


class StepWallError(InfraError):
    """An RL step's aggregate wall bound stopped an episode mid-run or before it started: an exception of
    the step (no reward, never 0), not the policy's outcome."""


SCORED_DESPITE_EXCEPTION = frozenset({"AgentTimeoutError", "AgentLoopError", "AgentHangError"})
"""Exception types after which the verifier still runs and its reward is kept beside the exception
(Harbor's convention for agent timeouts, extended to the supervisor's loop and hang stops); every
other exception means "no reward"."""


def is_transient(exc: BaseException) -> bool:
    """Return True if ``exc`` is an infrastructure failure that a retry may cure."""
    return isinstance(exc, InfraError) and exc.transient


# --- serving (added by the serving engineer) -----------------------------------------------------
class SwapRolledBackError(ServerStartError):
    """A blue/green swap failed its start or gate; the previous generation keeps serving.

    ``result`` holds the :class:`forgeflow.serving.bluegreen.SwapResult` with the gate evidence.
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


# --- model client ------------------------------------
class CircuitOpenError(ModelEndpointError):
    """The model endpoint's circuit breaker is open (or half-open with its one probe in flight):
    the call was refused without being sent. Transient: the breaker closes after a good probe."""


class ModelRequestError(InfraError):
    """The model endpoint rejected the request with a 4xx other than 429 (bad key, unknown model,
    malformed request). Not transient: the same request fails the same way."""


# --- model store ----------------------------------------
class ModelStoreError(InfraError):
    """The model store (local folder or HF Hub) refused an operation for good: authentication,
    permission, a bad request. Not transient."""


class ModelStoreUnavailableError(TransientInfraError):
    """The model store is unreachable or answered 429/5xx; a retry with backoff may cure it."""


class StaleParentCommitError(InputError):
    """A commit pinned to a parent commit was refused because the branch moved on (HF Hub answers
    412): nothing was committed; read the new head and decide again."""


class PublishDigestMismatchError(DigestMismatchError):
    """A published file's sha256 or size, read back from the store at the new revision, differs
    from the local file (the message names the path, the expected and the found values)."""
