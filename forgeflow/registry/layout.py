"""Where each task image lives in the target registry: tags, shards and lanes (pure, no I/O).

The layout ``base-sharded-tags`` spreads task images over ``shards`` repositories named
``<prefix>-00`` .. ``<prefix>-NN``. A task's *primary shard* follows its base image, so tasks that
share a base land together and reuse its layers; a per-task *lane* spreads one base's tasks over
``lanes`` neighbouring shards so no single repository takes them all. Each repository that holds a
task built on a base also holds that base under a ``basecache-<12 hex>`` tag (pre-warm), so a pull
of any task image in it finds the base layers already present.

Registries may cap tags per repository (the embedded docker-registry does not; hosted ones such as
TCR do), so the cap lives here: :meth:`PrewarmPlan.check` rejects a plan before anything is copied.

Tag grammar: the OCI distribution spec, ``[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}``
(https://github.com/opencontainers/distribution-spec/blob/main/spec.md#pulling-manifests).
"""

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
    """Map a task id to a valid, unique OCI tag.

    An id that already fits the grammar is returned unchanged. Otherwise every character outside
    ``[A-Za-z0-9._-]`` becomes ``-``, a leading ``.`` or ``-`` becomes ``_``, the result is cut to
    117 characters and ``-`` plus the first 10 hex characters of sha256(task_id) is appended (at
    most 128 characters). Two different ids that would sanitize to the same text thus get
    different suffixes; an unchanged id never carries a suffix. Case is kept (tags are
    case-sensitive).

    Args:
        task_id: Any non-empty task identifier (e.g. ``owner__repo.abc123.func_pm__x/y``).

    Returns:
        A tag matching ``TAG_PATTERN``; the same id always gives the same tag.

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
    """Tag under which a base image is pre-warmed in a task repository.

    Args:
        base_digest: The base image's manifest digest, ``sha256:<64 hex>``.

    Returns:
        ``basecache-<first 12 hex characters of the digest>``.

    Raises:
        InputError: ``base_digest`` is not a sha256 digest.
    """
    return BASECACHE_PREFIX + _digest_hex(base_digest)[:BASECACHE_HEX_CHARS]


class Placement(BaseModel):
    """Where one task image goes.

    Attributes:
        task_id: The task's id as given.
        base_digest: Digest of the base image the task image is built on.
        repository: Repository name inside the target registry (``task-07``).
        tag: The sanitized tag (:func:`sanitize_tag`).
        shard: Index of ``repository`` (primary shard + lane, modulo shards).
        lane: The task's lane, 0 .. lanes-1.
    """

    model_config = ConfigDict(frozen=True)

    task_id: str = Field(min_length=1)
    base_digest: str
    repository: str
    tag: str
    shard: int = Field(ge=0)
    lane: int = Field(ge=0)


class PrewarmPlan(BaseModel):
    """A whole layout plan: placements, basecache tags and projected tag counts.

    Attributes:
        layout: The layout that produced the plan.
        placements: One per task, in input order.
        basecache: repository -> {basecache tag -> base digest}, every base used in it.
        projected_tag_counts: repository -> task tags + basecache tags after the pre-warm.
        rejected_repositories: Repositories whose projected count exceeds ``layout.tag_cap``,
            sorted by name.
    """

    model_config = ConfigDict(frozen=True)

    layout: ShardLayout
    placements: list[Placement]
    basecache: dict[str, dict[str, str]]
    projected_tag_counts: dict[str, int]
    rejected_repositories: list[str]

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
    """The ``base-sharded-tags`` layout.

    Placement rule: primary shard = int(base digest hex[:8], 16) % shards; lane =
    int(sha256(task_id)[:8], 16) % lanes; repository index = (primary + lane) % shards.

    Attributes:
        name: Layout name recorded with each plan.
        shards: Number of task repositories.
        lanes: Neighbouring shards one base's tasks spread over (at most ``shards``).
        prefix: Repository name prefix (``task`` gives ``task-00`` .. ``task-79``); a repository path, so a
            registry namespace may lead it (``team/agents/task`` gives ``team/agents/task-00`` ..).
        tag_cap: Most tags a repository may hold (task tags + basecache tags).
    """

    model_config = ConfigDict(frozen=True)

    name: Literal["base-sharded-tags"] = "base-sharded-tags"
    shards: int = Field(default=80, ge=1, le=MAX_SHARDS)
    lanes: int = Field(default=5, ge=1)
    prefix: str = Field(default="task", pattern=PREFIX_PATTERN)
    tag_cap: int = Field(default=100, ge=1)

    @model_validator(mode="after")
    def _lanes_within_shards(self) -> ShardLayout:
        if self.lanes > self.shards:
            raise ValueError(f"lanes ({self.lanes}) must not exceed shards ({self.shards})")
        return self

    def repository(self, index: int) -> str:
        """Repository name of shard ``index`` (``task-07``; at least two digits)."""
        return f"{self.prefix}-{index:02d}"

    def place(self, task_id: str, base_digest: str) -> Placement:
        """Place one task image.

        Args:
            task_id: The task's id.
            base_digest: ``sha256:<64 hex>`` of the base image the task image is built on.

        Returns:
            The :class:`Placement` (deterministic in its inputs and the layout).

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
        """Place every task and count the tags each repository would hold.

        Args:
            tasks: ``(task_id, base_digest)`` pairs; task ids must be unique.

        Returns:
            A :class:`PrewarmPlan`; call :meth:`PrewarmPlan.check` to enforce the tag cap.

        Raises:
            InputError: a task id is repeated, a digest is malformed, two task ids map to the same
                (repository, tag), or a task tag collides with a basecache tag in the same repository.
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

    Args:
        shards: Number of task repositories (1-10000).
        lanes: Neighbouring shards one base's tasks spread over (1..shards).
        prefix: Repository name prefix (``[a-z0-9]+`` parts joined by ``.``, ``_`` or ``-``; ``/``-separated
            path components for a namespace).
        tag_cap: Most tags a repository may hold (>= 1).

    Returns:
        The layout.

    Raises:
        InputError: naming each bad parameter with its value and the rule it breaks
            (``shards=0: Input should be greater than or equal to 1``; ``lanes (6) must not
            exceed shards (5)``).
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
