"""One task: what a verifier needs to run and grade it, in one spelling (SWE-bench's ``FAIL_TO_PASS`` /
``PASS_TO_PASS``, ``image_ref`` + ``image_digest``, ``patch``).

The stages' task models build on :class:`Task` (subclasses add what only their stage needs). Older keys
(``fail_to_pass``, ``pass_to_pass``, ``bug_patch``, ``image``) still load; a dump writes the one name.
"""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

__all__ = ["DIGEST_PATTERN", "Task"]

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""An image digest: ``sha256:`` and 64 lowercase hex digits."""


class Task(BaseModel):
    """A task as the verifier runs and grades it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_id: str = Field(min_length=1, description="The task's id.")
    repo: str | None = Field(default=None, description="Its source repository (project name); None: not known.")
    image_ref: str = Field(min_length=1, validation_alias=AliasChoices("image_ref", "image"),
                           description="The task image: the bug applied at /testbed, a git repository whose HEAD "
                                       "holds the pristine test files.")
    image_digest: str | None = Field(default=None, pattern=DIGEST_PATTERN,
                                     description="The task image's digest (sha256:<64 hex>); None: not resolved.")
    patch: str | None = Field(default=None, validation_alias=AliasChoices("patch", "bug_patch"),
                              description="The unified diff that put the bug in (the Oracle reverts it); None: "
                                          "not given (never shown to an agent).")
    test_command: str = Field(min_length=1, description="The test command, run in /testbed (pytest -rA output).")
    log_parser: str | None = Field(default=None, description="A SWE-bench log parser by name (e.g. "
                                   "parse_log_django) the test output is read with; None: forgeflow's pytest report.")
    FAIL_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("FAIL_TO_PASS", "fail_to_pass"),
                                    description="Test ids the fix must make pass.")
    PASS_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("PASS_TO_PASS", "pass_to_pass"),
                                    description="Test ids that must keep passing.")
    problem_statement: str | None = Field(default=None, min_length=1, description="The issue text an agent is "
                                          "given; None: derived from the patch and tests where needed.")

    def graded_tests(self) -> list[str]:
        """FAIL_TO_PASS then PASS_TO_PASS."""
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]
