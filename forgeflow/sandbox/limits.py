"""The one limits model of a sandbox: memory and CPUs of each container, one default and one bound each.

Every model that sizes a sandbox reuses it: :class:`~forgeflow.sandbox.base.SandboxSpec` (what a backend
turns into ``--memory`` / ``--cpus``), the validation and agent configs, the ``forgeflow-sandbox`` block
(:class:`blocks.core.SandboxBackend` extends :class:`SandboxLimits`). A stage's parameters hold
:class:`LimitOverrides`: what the stage sets itself, the rest left to the block (:meth:`LimitOverrides.over`;
docs/verifier.md, "Sandbox limits").
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEFAULT_MEMORY_MB", "DEFAULT_CPUS", "DEFAULT_VERIFIER_TIMEOUT_S", "MemoryMb", "Cpus", "VerifierTimeoutS",
           "SandboxLimits", "LimitOverrides"]

DEFAULT_MEMORY_MB = 2048
"""Memory of a sandbox container when neither its stage nor its sandbox block sets one, MiB."""

DEFAULT_CPUS = 1.0
"""CPU quota of a sandbox container when neither its stage nor its sandbox block sets one, cores."""

MemoryMb = Annotated[int, Field(ge=16, description="Memory limit of each sandbox container, MiB (podman "
                                                   "--memory and --memory-swap; a pod's request and limit).")]
"""A container's memory limit, MiB (>= 16: podman refuses less than 6 MiB, a shell needs a few)."""

Cpus = Annotated[float, Field(gt=0, description="CPU quota of each sandbox container, cores (--cpus).")]
"""A container's CPU quota, cores (> 0)."""

DEFAULT_VERIFIER_TIMEOUT_S = 180.0
"""Absolute limit of one test run when the stage sets none, seconds (validation, canary, re-score)."""

VerifierTimeoutS = Annotated[float, Field(gt=0, description="Absolute limit of one test run (the verifier's), "
                                                            "seconds.")]
"""One verifier test run's wall-clock limit, seconds (> 0); every stage that runs a verifier declares it so."""


class SandboxLimits(BaseModel):
    """Memory and CPUs of each container of a sandbox run (frozen; extended, never redeclared).

    Attributes:
        memory_mb: memory limit, MiB (>= 16; default :data:`DEFAULT_MEMORY_MB`).
        cpus: CPU quota, cores (> 0; default :data:`DEFAULT_CPUS`).
    """

    model_config = ConfigDict(frozen=True)

    memory_mb: MemoryMb = DEFAULT_MEMORY_MB
    cpus: Cpus = DEFAULT_CPUS

    def limits(self) -> SandboxLimits:
        """These limits alone (a model that extends this one loses its other fields)."""
        return SandboxLimits(memory_mb=self.memory_mb, cpus=self.cpus)


class LimitOverrides(BaseModel):
    """The limits a stage sets itself; each None is left to the sandbox block, else the default.

    The rule, one for every stage: a value the stage sets wins; a value it leaves None is the
    ``forgeflow-sandbox`` block's when the run names one, else :class:`SandboxLimits`' default.
    None rather than "not given": Prefect's run form sends every default, so only None can say
    "the block's".

    Attributes:
        memory_mb: memory limit of each container, MiB (>= 16); None: the block's, else the
            stage's default (:data:`DEFAULT_MEMORY_MB`; the rl-burst verifier's 1024).
        cpus: CPU quota of each container, cores (> 0); None: the block's, else 1.
    """

    model_config = ConfigDict(frozen=True)

    memory_mb: MemoryMb | None = Field(default=None, description="Memory limit of each sandbox container, "
                                       "MiB; none: the sandbox block's, else the stage's default.")
    cpus: Cpus | None = Field(default=None, description="CPU quota of each sandbox container, cores; none: "
                              "the sandbox block's, else the stage's default (1).")

    def over(self, block: SandboxLimits | None = None) -> SandboxLimits:
        """The limits a run gets: this stage's where set, else ``block``'s, else the defaults.

        Args:
            block: the sandbox block's limits, or None when the run names no block.

        Returns:
            The resolved :class:`SandboxLimits`.
        """
        base = block.limits() if block is not None else SandboxLimits()
        return SandboxLimits(memory_mb=base.memory_mb if self.memory_mb is None else self.memory_mb,
                             cpus=base.cpus if self.cpus is None else self.cpus)
