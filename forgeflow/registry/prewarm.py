"""Pre-warm basecache tags and check that task images reuse their base's layers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import (
    DigestMismatchError,
    ImageNotFoundError,
    InputError,
)
from forgeflow.registry.layout import PrewarmPlan
from forgeflow.registry.skopeo import Skopeo, digest_or_none


class LayerReuse(BaseModel):
    """Evidence that a task image reuses its base image's layers."""

    model_config = ConfigDict(frozen=True)

    task_ref: str = Field(description="The task image reference checked.")
    base_ref: str = Field(description="The base image reference checked.")
    base_layers: list[str] = Field(description="Layer digests of the base image, bottom first.")
    task_layers: list[str] = Field(description="Layer digests of the task image, bottom first.")
    reused: bool = Field(description="True: task_layers starts with base_layers.")


class BasecacheRecord(BaseModel):
    """One basecache tag written into one task repository."""

    model_config = ConfigDict(frozen=True)

    repository: str = Field(description="Task repository name (task-07).")
    tag: str = Field(description="basecache-<12 hex>.")
    base_digest: str = Field(description="The base image's digest (the tag must serve exactly this).")
    source_ref: str = Field(description="Where the base was copied from.")
    target_ref: str = Field(description="docker://<target>/<repository>:<tag>.")
    target_digest: str = Field(description="Digest the target reported after the copy.")
    copied: bool = Field(description="False if the tag already served base_digest and nothing was copied.")



def verify_layer_reuse(skopeo: Skopeo, task_ref: str, base_ref: str) -> LayerReuse:
    """Check that the task image's layers start with the base image's layers.

    Raises:
        DigestMismatchError: they do not (both references and the first differing position named).
        ImageNotFoundError, RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    base_layers = skopeo.layers(base_ref)
    task_layers = skopeo.layers(task_ref)
    reused = bool(base_layers) and task_layers[: len(base_layers)] == base_layers
    if not reused:
        position = next(
            (i for i, (a, b) in enumerate(zip(base_layers, task_layers)) if a != b),
            min(len(base_layers), len(task_layers)),
        )
        raise DigestMismatchError(
            f"task image {task_ref} does not reuse the layers of base {base_ref}: "
            f"{len(base_layers)} base layers, {len(task_layers)} task layers, first difference "
            f"at layer {position}"
        )
    return LayerReuse(
        task_ref=task_ref,
        base_ref=base_ref,
        base_layers=base_layers,
        task_layers=task_layers,
        reused=True,
    )


def prewarm_basecache(
    skopeo: Skopeo,
    plan: PrewarmPlan,
    target_address: str,
    base_refs: dict[str, str],
    max_workers: int = 5,
) -> list[BasecacheRecord]:
    """Copy every planned basecache tag into its task repository (digests preserved); one record per
    (repository, tag), sorted.

    Args:
        base_refs: base digest -> that base's transport reference in the target registry; covers the plan.

    Raises:
        PlanRejectedError: a repository would exceed the tag cap.
        InputError: a base digest without an entry in ``base_refs``, or bad arguments.
        ImageNotFoundError: a base reference does not exist.
        DigestMismatchError: a base reference does not serve its digest, or a copy changed it.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    plan.check()
    if not target_address or "/" in target_address:
        raise InputError(f"target_address must be host:port, got {target_address!r}")
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")
    needed = {digest for tags in plan.basecache.values() for digest in tags.values()}
    missing = sorted(needed - base_refs.keys())
    if missing:
        raise InputError(f"base_refs has no source reference for base digests: {missing}")

    def _check_base(digest: str) -> None:
        served = skopeo.inspect_digest(base_refs[digest])
        if served != digest:
            raise DigestMismatchError(
                f"base reference {base_refs[digest]} serves {served}, not the planned {digest}"
            )

    def _tags_of(repo: str) -> set[str]:
        try:
            return set(skopeo.list_tags(f"docker://{target_address}/{repo}"))
        except ImageNotFoundError:  # the repository does not exist yet
            return set()

    def _one(job: tuple[str, str, str, bool]) -> BasecacheRecord:
        repo, tag, digest, listed = job
        target_ref = f"docker://{target_address}/{repo}:{tag}"
        present = listed and digest_or_none(skopeo, target_ref) == digest
        written = digest if present else skopeo.copy(
            base_refs[digest], target_ref, all_images=True, preserve_digests=True
        )
        return BasecacheRecord(
            repository=repo,
            tag=tag,
            base_digest=digest,
            source_ref=base_refs[digest],
            target_ref=target_ref,
            target_digest=written,
            copied=not present,
        )

    repos = sorted(plan.basecache)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(_check_base, sorted(needed)))
        existing = dict(zip(repos, pool.map(_tags_of, repos), strict=True))
        jobs = [
            (repo, tag, digest, tag in existing[repo])
            for repo in repos
            for tag, digest in sorted(plan.basecache[repo].items())
        ]
        return list(pool.map(_one, jobs))


def verify_prewarm(skopeo: Skopeo, records: list[BasecacheRecord], max_workers: int = 5) -> None:
    """Check that every basecache tag serves exactly its base digest (``max_workers`` 1-16 at a time).

    Raises:
        DigestMismatchError: naming each tag that serves another digest.
        ImageNotFoundError: a basecache tag is missing.
        RegistryError, RegistryUnavailableError, ToolMissingError: from skopeo.
    """
    if not 1 <= max_workers <= 16:
        raise InputError(f"max_workers {max_workers} is outside 1-16")
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        served_digests = list(pool.map(lambda record: skopeo.inspect_digest(record.target_ref), records))
    wrong = []
    for record, served in zip(records, served_digests, strict=True):
        if served != record.base_digest:
            wrong.append(f"{record.target_ref} serves {served}, expected {record.base_digest}")
    if wrong:
        raise DigestMismatchError("basecache tags with the wrong digest: " + "; ".join(wrong))
