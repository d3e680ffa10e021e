"""Where each task image lives in the target registry: tags, shards and lanes (pure, no I/O).

Tag grammar: the OCI distribution spec, ``[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}``
(https://github.com/opencontainers/distribution-spec/blob/main/spec.md#pulling-manifests)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError, PlanRejectedError

TAG_MAX_CHARS = 128
"""Longest tag the OCI distribution spec allows."""

TAG_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""The OCI distribution spec's tag grammar (match with ``fullmatch``)."""

TAG_HASH_CHARS = 10
"""Hex characters of sha256(task_id) appended to a tag that had to be changed or truncated."""

BASECACHE_PREFIX = "basecache-"
BASECACHE_HEX_CHARS = 12

_DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")
_INVALID_TAG_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_INVALID_FIRST_CHAR = re.compile(r"^[.-]")


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sanitize_tag(task_id: str) -> str:
    """Map a task id (e.g. ``owner__repo.abc123.func_pm__x/y``) to a valid, unique OCI tag (same id, same tag).

    Raises:
        InputError: ``task_id`` is empty.
    """
    if not task_id:
        raise InputError("task_id is empty: cannot derive an image tag from it")
    if TAG_PATTERN.fullmatch(task_id):
        return task_id
    cleaned = _INVALID_TAG_CHARS.sub("-", task_id)
    cleaned = _INVALID_FIRST_CHAR.sub("_", cleaned)
    suffix = "-" + _sha256_hex(task_id)[:TAG_HASH_CHARS]
    return cleaned[: TAG_MAX_CHARS - len(suffix)] + suffix


def _digest_hex(base_digest: str) -> str:
    if not _DIGEST_PATTERN.fullmatch(base_digest):
        raise InputError(
            f"base digest {base_digest!r} is not of the form 'sha256:<64 lowercase hex>'"
        )
    return base_digest.removeprefix("sha256:")


def basecache_tag(base_digest: str) -> str:
    """``basecache-<first 12 hex of base_digest>``: the tag a base image is pre-warmed under in a task repository.

    Raises:
        InputError: ``base_digest`` is not a sha256 digest.
    """
    return BASECACHE_PREFIX + _digest_hex(base_digest)[:BASECACHE_HEX_CHARS]


class Placement(BaseModel):
    """Where one task image goes."""

    model_config = ConfigDict(frozen=True)

    task_id: str = Field(min_length=1, description="The task's id as given.")
    base_digest: str = Field(description="Digest of the base image the task image is built on.")
    repository: str = Field(description="Repository name inside the target registry (task-07).")
    tag: str = Field(description="The sanitized tag (sanitize_tag).")
    shard: int = Field(ge=0, description="Index of repository (primary shard + lane, modulo shards).")
    lane: int = Field(ge=0, description="The task's lane, 0 .. lanes-1.")


class PrewarmPlan(BaseModel):
    """A whole layout plan: placements, basecache tags and projected tag counts."""

    model_config = ConfigDict(frozen=True)

    layout: ShardLayout = Field(description="The layout that produced the plan.")
    placements: list[Placement] = Field(description="One per task, in input order.")
    basecache: dict[str, dict[str, str]] = Field(
        description="repository -> {basecache tag -> base digest}, every base used in it.")
    projected_tag_counts: dict[str, int] = Field(
        description="repository -> task tags + basecache tags after the pre-warm.")
    rejected_repositories: list[str] = Field(
        description="Repositories whose projected count exceeds layout.tag_cap, sorted by name.")

    @property
    def basecache_tag_count(self) -> int:
        """Number of basecache tags to copy in total (over all repositories)."""
        return sum(len(tags) for tags in self.basecache.values())

    def check(self) -> PrewarmPlan:
        """Raise if any repository would exceed the tag cap; return the plan otherwise.

        Raises:
            PlanRejectedError: naming each repository over ``layout.tag_cap`` with its count.
        """
        if self.rejected_repositories:
            over = ", ".join(
                f"{repo} ({self.projected_tag_counts[repo]} tags)"
                for repo in self.rejected_repositories
            )
            raise PlanRejectedError(
                f"layout {self.layout.name!r} would exceed the tag cap of "
                f"{self.layout.tag_cap} per repository in: {over}; "
                "raise shards/lanes or the cap"
            )
        return self


MAX_SHARDS = 10_000
"""Most task repositories a layout spreads over."""

PREFIX_PATTERN = r"^(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*$"
"""A layout's repository name prefix: ``[a-z0-9]+`` parts joined by ``.``, ``_`` or ``-``, ``/``-separated
path components for a namespace (the OCI repository grammar, lower case)."""


class ShardLayout(BaseModel):
    """The ``base-sharded-tags`` layout."""

    model_config = ConfigDict(frozen=True)

    name: Literal["base-sharded-tags"] = Field("base-sharded-tags", description="Layout name recorded with each plan.")
    shards: int = Field(default=80, ge=1, le=MAX_SHARDS, description="Number of task repositories.")
    lanes: int = Field(default=5, ge=1,
                       description="Neighbouring shards one base's tasks spread over (at most shards).")
    prefix: str = Field(default="task", pattern=PREFIX_PATTERN,
                        description="Repository name prefix (task gives task-00 .. task-79)")
    tag_cap: int = Field(default=100, ge=1, description="Most tags a repository may hold (task tags + basecache tags).")

    @model_validator(mode="after")
    def _lanes_within_shards(self) -> ShardLayout:
        if self.lanes > self.shards:
            raise ValueError(f"lanes ({self.lanes}) must not exceed shards ({self.shards})")
        return self

    def repository(self, index: int) -> str:
        """Repository name of shard ``index`` (``task-07``; at least two digits)."""
        return f"{self.prefix}-{index:02d}"

    def place(self, task_id: str, base_digest: str) -> Placement:
        """Place one task image (deterministic in its inputs and the layout).

        Raises:
            InputError: empty ``task_id`` or malformed ``base_digest``.
        """
        primary = int(_digest_hex(base_digest)[:8], 16) % self.shards
        lane = int(_sha256_hex(task_id)[:8], 16) % self.lanes
        index = (primary + lane) % self.shards
        return Placement(
            task_id=task_id,
            base_digest=base_digest,
            repository=self.repository(index),
            tag=sanitize_tag(task_id),
            shard=index,
            lane=lane,
        )

    def plan(self, tasks: list[tuple[str, str]]) -> PrewarmPlan:
        """Place every task and count the tags each repository would hold (:meth:`PrewarmPlan.check` enforces the cap).

        Raises:
            InputError: a repeated task id, a malformed digest, two task ids on the same (repository, tag), or a
                task tag colliding with a basecache tag.
        """
        repeated = sorted(tid for tid, n in Counter(tid for tid, _ in tasks).items() if n > 1)
        if repeated:
            raise InputError(f"task ids repeated in the plan input: {repeated[:10]}")
        placements = [self.place(task_id, digest) for task_id, digest in tasks]
        basecache: dict[str, dict[str, str]] = {}
        task_tags: dict[str, set[str]] = {}
        bases_per_repo: dict[str, set[str]] = {}
        for placement in placements:
            basecache.setdefault(placement.repository, {})[
                basecache_tag(placement.base_digest)
            ] = placement.base_digest
            task_tags.setdefault(placement.repository, set()).add(placement.tag)
            bases_per_repo.setdefault(placement.repository, set()).add(placement.base_digest)
        # A sanitized id can equal another id that is already a valid tag ("a/b1" -> "a-b1-<hash>"):
        # two tasks on one (repository, tag) would overwrite each other's image.
        by_slot: dict[tuple[str, str], list[str]] = {}
        for (task_id, _), placement in zip(tasks, placements):
            by_slot.setdefault((placement.repository, placement.tag), []).append(task_id)
        shared = {f"{repo}:{tag}": ids for (repo, tag), ids in by_slot.items() if len(ids) > 1}
        if shared:
            first = sorted(shared.items())[:5]
            raise InputError(
                "task ids map to the same image tag, so one push would overwrite the other: "
                + "; ".join(f"{slot} <- {ids}" for slot, ids in first) + "; rename those tasks"
            )
        for repo, tags in task_tags.items():
            clash = sorted(tags & basecache[repo].keys())
            if clash:
                raise InputError(
                    f"task tags {clash} in {repo} collide with basecache tags; rename those tasks"
                )
        # Two different bases whose digests share 12 hex chars would share one basecache tag.
        for repo, tags in basecache.items():
            bases = bases_per_repo[repo]
            if len(bases) != len(tags):
                raise InputError(
                    f"two base digests in {repo} share a basecache tag prefix: {sorted(bases)}"
                )
        counts = {
            repo: len(task_tags[repo]) + len(basecache[repo]) for repo in sorted(task_tags)
        }
        rejected = sorted(repo for repo, count in counts.items() if count > self.tag_cap)
        return PrewarmPlan(
            layout=self,
            placements=placements,
            basecache={repo: dict(sorted(basecache[repo].items())) for repo in sorted(basecache)},
            projected_tag_counts=counts,
            rejected_repositories=rejected,
        )


PrewarmPlan.model_rebuild()


def shard_layout(shards: int, lanes: int, prefix: str, tag_cap: int) -> ShardLayout:
    """A :class:`ShardLayout` from flow parameters of the same names, bad values as InputError.

    Raises:
        InputError: naming each bad parameter, its value and the rule it breaks.
    """
    from pydantic import ValidationError

    try:
        return ShardLayout(shards=shards, lanes=lanes, prefix=prefix, tag_cap=tag_cap)
    except ValidationError as err:
        problems = []
        for error in err.errors():
            message = error["msg"].removeprefix("Value error, ")
            if error["loc"]:
                field = ".".join(str(part) for part in error["loc"])
                problems.append(f"{field}={error['input']!r}: {message}")
            else:
                problems.append(message)
        raise InputError("bad layout parameters: " + "; ".join(problems)) from None
