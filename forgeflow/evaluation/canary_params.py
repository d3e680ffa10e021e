"""The ``canary`` and ``canary-recover`` flows' parameter groups: the model endpoint and how a canary
job runs (frozen pydantic models, so a deployment, the UI and a test give them as one JSON object)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.sandbox.limits import DEFAULT_VERIFIER_TIMEOUT_S, VerifierTimeoutS


class CanaryEndpoint(BaseModel):
    """The model endpoint a canary (or its recovery) runs the agent against: the serving state file's
    active server, or an explicit ``base_url`` + ``model_sha256`` (checked by the flow,
    :func:`tasks.evaluation.resolve_endpoint`: when the state file records a live server at ``base_url``,
    ``model_sha256`` must be the GGUF it records; a URL it does not record as serving, such as a server
    staged on the idle port, is taken with the ``model_sha256`` given)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_path: Path | None = Field(
        default=None, description="Serving state file (default $FORGEFLOW_HOME/serving/state.json): the endpoint "
        "without base_url; with base_url, the record base_url is checked against.")
    base_url: str | None = Field(
        default=None, min_length=1,
        description="OpenAI-compatible base URL (http://127.0.0.1:PORT/v1) instead of the serving state's "
        "active server.")
    model_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="The served GGUF's sha256 (64 lower-case hex digits); required with base_url, checked "
        "against the serving state when it records a live server at base_url.")
    model_alias: str | None = Field(
        default=None, description="Model name sent to the endpoint (default: the serving state's alias, else "
        "'forgeflow'; empty: the default).")
    api_key_secret: str | None = Field(
        default=None, min_length=1, description="A Secret block holding the endpoint's API key (default: the "
        "serving state's, for an external endpoint; else none).")


class CanaryRunSettings(BaseModel):
    """How a canary job's agent trials run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str = Field(default="default", min_length=1, description="Concurrency profile: 'default' (up "
                         "to 4 at once) or 'verified' (up to 10).")
    concurrency: int = Field(default=1, ge=1, description="Agent trials at once; refused above the "
                             "profile's limit.")
    agent_config: AgentConfig = Field(default_factory=AgentConfig, description="mini-swe-agent's limits and "
                                      "sampling (steps, tokens, timeout, temperature...).")
    verifier_timeout_s: VerifierTimeoutS = DEFAULT_VERIFIER_TIMEOUT_S
    sample: int | None = Field(default=None, ge=1, description="Run only this many tasks of the split, "
                               "drawn with sample_seed; None: the whole split.")
    sample_seed: int = Field(default=0, ge=0, description="The sample's seed (same split, sample and seed: "
                             "the same tasks).")

    @field_validator("concurrency")
    @classmethod
    def _fits_the_profile(cls, value: int, info: ValidationInfo) -> int:
        from forgeflow.evaluation.canary import check_concurrency  # noqa: PLC0415 (canary's core imports the store)

        return check_concurrency(value, info.data.get("profile", "default"))  # InputError is a ValueError
