"""The lineage of a model artifact from the store: base model -> adapter(s) -> merged checkpoint ->
GGUF(s) -> the serving generations that served it.

An artifact (a content digest) may have several producers (the same GGUF bytes from two adapters,
or several runs), so the lineage is a set of chains, one per distinct path of parent digests,
newest first; every run that recorded a step is listed on it. Each step's path is checked against
its digest (``path_status``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.ledger.records import ModelArtifactRecord, ServingGenerationRecord
from forgeflow.ledger.store import Store
from forgeflow.training.adapters import adapter_matches

PathStatus = Literal["ok", "changed", "missing", "unchecked"]
MIN_PREFIX_CHARS = 8
"""Shortest digest prefix accepted; shorter ones match too much to name one artifact."""


class LineageStep(BaseModel):
    """One artifact on a chain, as made from ``parent_sha256``."""

    model_config = ConfigDict(frozen=True)

    sha256: str
    kind: str
    quantization: str | None
    parent_sha256: str | None = Field(description="the parent on this chain (None for a root such as a base model)")
    path: str = Field(description="where the latest production from this parent was written")
    path_status: PathStatus = Field(description="ok (the path holds these bytes), changed, missing, or unchecked")
    run_ids: list[str | None] = Field(
        description="every run that recorded this artifact from this parent, first recorded first")
    lineage: dict[str, Any] = Field(default_factory=dict,
        description="the latest production's lineage record (e.g. an adapter's dataset and hyperparameters)")
    recorded_at: datetime | None = Field(None, description="when that latest production was first recorded (UTC)")


class LineageReport(BaseModel):
    """The lineage of ``artifact_sha256``: every chain, the serving generations that served it, warnings."""

    model_config = ConfigDict(frozen=True)

    artifact_sha256: str
    chains: list[list[LineageStep]] = Field(description="every chain, newest first, each base model first")
    serving_generations: list[ServingGenerationRecord]
    warnings: list[str] = Field(default_factory=list,
        description="several producers, a parent missing from the store, a path no longer holding its digest")

    @property
    def chain(self) -> list[LineageStep]:
        """The newest chain (the parents recorded most recently at every step)."""
        return self.chains[0]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: ``artifact_sha256``, ``chain`` (newest), ``chains``,
        ``serving_generations``, ``warnings``."""
        chains = [[step.model_dump(mode="json") for step in chain] for chain in self.chains]
        return {"artifact_sha256": self.artifact_sha256, "chain": chains[0], "chains": chains,
                "serving_generations": [g.model_dump(mode="json") for g in self.serving_generations],
                "warnings": list(self.warnings)}


def resolve_sha256(store: Store, prefix: str, known: Iterable[str] | None = None) -> str:
    """The one recorded artifact digest starting with ``prefix`` (>= 8 hex characters); ``known``: the
    recorded digests if already read.

    Raises:
        InputError: the prefix is empty, not hex, too short, matches no artifact, or is ambiguous.
    """
    prefix = prefix.strip().lower()
    if not prefix:
        raise InputError(f"artifact sha256 is empty: give at least {MIN_PREFIX_CHARS} hex characters of a "
                         "recorded sha256")
    if prefix.strip("0123456789abcdef"):
        raise InputError(f"artifact {prefix!r} is not a sha256 prefix: a sha256 is hex characters (0-9, a-f) only")
    if len(prefix) < MIN_PREFIX_CHARS:
        raise InputError(f"artifact {prefix!r} is too short: give at least {MIN_PREFIX_CHARS} hex characters "
                         "of a recorded sha256")
    digests = set(known) if known is not None else {a.sha256 for a in store.model_artifacts()}
    matches = sorted(sha for sha in digests if sha.startswith(prefix))
    if len(matches) == 1:
        return matches[0]
    what = "is ambiguous" if len(matches) > 1 else "is not in the store"
    raise InputError(f"artifact {prefix!r} {what} ({store.display_url}); give at least {MIN_PREFIX_CHARS} hex "
                     f"characters of a recorded sha256")


def _digest_of(kind: str) -> Callable[[Path, str], bool]:
    if kind == "adapter":
        return adapter_matches
    if kind == "gguf":
        return lambda path, sha: path.is_file() and sha256_file(path) == sha
    return lambda path, sha: path.is_dir() and sha256_tree(path) == sha


def lineage_of(store: Store, sha256_prefix: str, *, verify_paths: bool = True) -> LineageReport:
    """Walk from an artifact up to its roots through every recorded producer.

    Args:
        sha256_prefix: the artifact's sha256 or a prefix of at least 8 hex characters.
        verify_paths: digest each step's recorded path; False leaves every step ``unchecked``.

    Raises:
        InputError: as :func:`resolve_sha256`.
    """
    by_sha: dict[str, list[ModelArtifactRecord]] = {}
    for production in store.model_artifacts():  # first recorded first
        by_sha.setdefault(production.sha256, []).append(production)
    target = resolve_sha256(store, sha256_prefix, by_sha)
    warnings: list[str] = []
    checked: dict[tuple[str, str], PathStatus] = {}

    def status(step: ModelArtifactRecord) -> PathStatus:
        if not verify_paths:
            return "unchecked"
        key = (step.sha256, step.path)
        if key not in checked:
            path = Path(step.path)
            checked[key] = ("ok" if _digest_of(step.kind)(path, step.sha256) else "changed") if path.exists() \
                else "missing"
            if checked[key] != "ok":
                warnings.append(f"{step.kind} {step.sha256} was recorded at {step.path}, which is now "
                                f"{'gone' if checked[key] == 'missing' else 'holding other content'}")
        return checked[key]

    def steps_of(sha: str) -> list[LineageStep]:
        """One step per distinct parent of ``sha``, the most recently recorded parent first."""
        groups: dict[str | None, list[ModelArtifactRecord]] = {}
        for production in by_sha[sha]:
            groups.setdefault(production.parent_sha256, []).append(production)
        out = []
        for parent, group in groups.items():
            latest = group[-1]
            out.append(LineageStep(sha256=sha, kind=latest.kind, quantization=latest.quantization,
                                   parent_sha256=parent, path=latest.path, path_status=status(latest),
                                   run_ids=list(dict.fromkeys(p.run_id for p in group)),
                                   lineage=latest.lineage, recorded_at=latest.created_at))
        out.sort(key=lambda s: s.recorded_at or datetime.min, reverse=True)
        if len(out) > 1:
            warnings.append(f"{out[0].kind} {sha} has {len(out)} producers (parents "
                            f"{', '.join(str(s.parent_sha256) for s in out)}): one chain each")
        return out

    memo: dict[str, list[list[LineageStep]]] = {}

    def chains_to(sha: str, seen: frozenset[str]) -> list[list[LineageStep]]:
        """Every chain ending at ``sha``, root first."""
        if sha in memo:
            return memo[sha]
        chains = []
        for step in steps_of(sha):
            parent = step.parent_sha256
            if parent is None:
                chains.append([step])
            elif parent in seen:
                warnings.append(f"{sha} lists {parent} as a parent, which is also its descendant: cycle cut")
                chains.append([step])
            elif parent not in by_sha:
                warnings.append(f"{step.kind} {sha} names parent {parent}, which is not in the store")
                chains.append([step])
            else:
                chains.extend(chain + [step] for chain in chains_to(parent, seen | {sha}))
        memo[sha] = chains
        return chains

    chains = chains_to(target, frozenset({target}))
    served = [g for g in store.serving_generations() if g.gguf_sha256 == target]
    return LineageReport(artifact_sha256=target, chains=chains, serving_generations=served,
                         warnings=list(dict.fromkeys(warnings)))


class RecordedSource(BaseModel):
    """What the store records a GGUF was converted from, on one of its chains."""

    model_config = ConfigDict(frozen=True)

    checkpoint_sha256: str = Field(
        description="parent of the chain's first GGUF: a base or merged checkpoint, or an adapter")
    checkpoint_kind: str = Field(description="base, merged or adapter")
    adapter_sha256: str | None = Field(description="the adapter merged into it, or None")


def recorded_sources(store: Store, gguf_sha256: str) -> list[RecordedSource]:
    """Every distinct source the store records for the GGUF ``gguf_sha256`` (full digest), newest chain
    first; [] when the store does not know it (no production of that digest)."""
    if not store.producers(gguf_sha256):
        return []
    out: list[RecordedSource] = []
    for chain in lineage_of(store, gguf_sha256, verify_paths=False).chains:
        first_gguf = next(i for i, step in enumerate(chain) if step.kind == "gguf")
        above = chain[:first_gguf]
        if above:
            checkpoint = above[-1]
            ckpt_sha, ckpt_kind = checkpoint.sha256, checkpoint.kind
        else:  # the chain starts at the GGUF: its parent is not in the store
            ckpt_sha, ckpt_kind = chain[first_gguf].parent_sha256 or "", "unknown"
        adapter = next((step.sha256 for step in reversed(above) if step.kind == "adapter"), None)
        if adapter is None and ckpt_kind == "merged":  # the adapter itself is not in the store
            adapter = above[-1].parent_sha256
        source = RecordedSource(checkpoint_sha256=ckpt_sha, checkpoint_kind=ckpt_kind, adapter_sha256=adapter)
        if source not in out:
            out.append(source)
    return out


def check_release_sources(store: Store, gguf_sha256: str, hf_sha256: str, hf_dir: Path,
                          adapter_dir: Path | None) -> RecordedSource | None:
    """Check the sources a release names against what the store records for the GGUF.

    The checkpoint (``hf_sha256``) and, where the chain has one, the adapter must be the chain's; with
    several producers any one chain is enough.

    Returns:
        The matching :class:`RecordedSource`, or None when the store does not know the GGUF.

    Raises:
        InputError: no recorded chain matches (what was given and what the store recorded named).
    """
    sources = recorded_sources(store, gguf_sha256)
    if not sources:
        return None
    for source in sources:
        if source.checkpoint_kind in ("base", "merged") and source.checkpoint_sha256 != hf_sha256:
            continue
        if source.adapter_sha256 is None:
            if adapter_dir is None:
                return source
        elif adapter_dir is not None and adapter_matches(Path(adapter_dir), source.adapter_sha256):
            return source
    recorded = "; ".join(f"{s.checkpoint_kind} checkpoint {s.checkpoint_sha256}, adapter {s.adapter_sha256 or 'none'}"
                         for s in sources)
    raise InputError(f"GGUF {gguf_sha256} was not converted from what was given: hf_dir {hf_dir} (sha256 "
                     f"{hf_sha256}), adapter_dir {adapter_dir if adapter_dir is not None else 'none'}; the store "
                     f"({store.display_url}) records it as converted from: {recorded}. Give the checkpoint "
                     "(and adapter) the store names")
