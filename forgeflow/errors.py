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


class ToolMissingError(InfraError):
    """An external tool (podman, skopeo, docker-registry, debootstrap) is not installed."""


class RegistryError(InfraError):
    """A registry answered with a non-retryable error (auth failure, bad request)."""


class RegistryUnavailableError(TransientInfraError):
    """A registry is unreachable or answered 429/5xx."""


class ImageNotFoundError(InfraError):
    """An image reference does not exist in the registry or local storage."""


class ImageBuildError(InfraError):
    """Building an image failed."""


class DigestMismatchError(InfraError):
    """A copied image's digest differs from its source (or a basecache tag from its base)."""


class SandboxError(InfraError):
    """The sandbox could not start or run the environment."""


class SandboxOOMError(SandboxError):
    """The sandbox was killed for memory (exit 137 / OOM-killed)."""


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


SCORED_DESPITE_EXCEPTION = frozenset({"AgentTimeoutError"})
"""Exception types after which the verifier still runs and its reward is kept beside the exception
(Harbor's convention for agent timeouts); every other exception means "no reward"."""


def is_transient(exc: BaseException) -> bool:
    """Return True if ``exc`` is an infrastructure failure that a retry may cure."""
    return isinstance(exc, InfraError) and exc.transient


# --- serving (added by the serving engineer) -----------------------------------------------------
class SwapRolledBackError(ServerStartError):
    """A blue/green swap failed its start or gate; the previous generation keeps serving.

    ``result`` holds the :class:`forgeflow.serving.SwapResult` with the gate evidence.
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


# --- model client (added by the evaluation engineer, issue 5) ------------------------------------
class CircuitOpenError(ModelEndpointError):
    """The model endpoint's circuit breaker is open (or half-open with its one probe in flight):
    the call was refused without being sent. Transient: the breaker closes after a good probe."""


class ModelRequestError(InfraError):
    """The model endpoint rejected the request with a 4xx other than 429 (bad key, unknown model,
    malformed request). Not transient: the same request fails the same way."""
