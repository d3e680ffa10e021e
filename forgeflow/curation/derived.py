"""Declarative derived task sets: named sets of instance ids defined by set algebra.

A definition is ``name = expression`` over source-set names (dotted allowed, ``frozen.test``) with
``&``, ``|``, ``-`` (or ``∩``, ``∪``, ``∖``) and parentheses::

    filter_pro = static & verified_any
    freeze_pro = filter_pro & frozen.test & images_available

Parsed with :mod:`ast`, never ``eval``; unknown names and cycles are reported before evaluation.
A derived set records each input's :func:`ids_sha256`, so :func:`verify_derived` can rebuild it and
detect a changed input.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import (
    sha256_file,
    sha256_json,
)
from forgeflow.curation.freeze import SPLITS, verify_freeze

SCHEMA_VERSION = 1
"""Version of the derived-set document written by :func:`forgeflow.curation.derived_store.save_derived`."""

SourceKind = Literal["store_status", "store_images", "frozen_split", "id_list", "explicit"]

_OPERATORS: dict[type[ast.operator], str] = {ast.BitAnd: "&", ast.BitOr: "|", ast.Sub: "-"}
_SPELLINGS = {"∩": "&", "∪": "|", "∖": "-"}


def ids_sha256(ids: Iterable[str]) -> str:
    """sha256 (hex) of the canonical JSON of the sorted, de-duplicated ids."""
    return sha256_json(sorted(set(ids)))


class SourceSet(BaseModel):
    """A named input set with the provenance needed to load it again."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1, description="the name definitions refer to (dotted allowed, e.g. frozen.test)")
    kind: SourceKind = Field(description="where the ids come from")
    ids: frozenset[str]
    provenance: dict[str, Any] = Field(default_factory=dict,
        description="JSON facts that identify the source (status, manifest and digest, list file, revision)")
    freeze_name: str | None = Field(None, description="for a frozen split: the freeze's name")
    freeze_splits: dict[str, frozenset[str]] | None = Field(None,
        description="for a frozen split: every split of that manifest, split -> ids")

    @property
    def sha256(self) -> str:
        """:func:`ids_sha256` of :attr:`ids`."""
        return ids_sha256(self.ids)


def _check_name(name: str) -> str:
    parts = name.split(".")
    if not name or not all(part.isidentifier() for part in parts):
        raise InputError(
            f"set name {name!r} is invalid: use identifiers joined by '.', e.g. 'frozen.test'"
        )
    return name


def validate_derived_name(name: str) -> str:
    """Return ``name`` if it is a plain identifier (it also names the file ``<name>.json``).

    Raises:
        InputError: the name is invalid; the message names it.
    """
    if not name.isidentifier():
        raise InputError(f"derived set name {name!r} is invalid: give a plain name (letters, digits and '_', "
                         "as on the left of a definition), no path separators or '..'")
    return name


def store_status_set(name: str, store: Any, status: str = "accepted") -> SourceSet:
    """The ids of the store's tasks with ``status`` (``accepted``, ``rejected``, ...)."""
    ids = frozenset(task.instance_id for task in store.tasks(status))
    return SourceSet(
        name=_check_name(name), kind="store_status", ids=ids, provenance={"status": status}
    )


def store_images_available_set(name: str, store: Any) -> SourceSet:
    """The ids of the store's tasks whose ``image_ref`` is recorded in the store's images."""
    refs = {image.ref for image in store.images()}
    ids = frozenset(t.instance_id for t in store.tasks() if t.image_ref and t.image_ref in refs)
    return SourceSet(name=_check_name(name), kind="store_images", ids=ids)


def frozen_split_sets(manifest_path: str | Path, prefix: str = "frozen") -> dict[str, SourceSet]:
    """One set per split of a frozen manifest (``<prefix>.train``, ...) plus ``<prefix>`` (all), after
    :func:`forgeflow.curation.freeze.verify_freeze`.

    Raises:
        InputError: the manifest is missing, altered or invalid.
    """
    manifest = verify_freeze(Path(manifest_path))
    split_ids = {split: frozenset(ids) for split, ids in manifest.splits.items()}
    provenance = {
        "manifest_path": str(Path(manifest_path).resolve()),
        "freeze": manifest.name,
        "semantic_sha256": manifest.semantic_sha256,
    }
    sets: dict[str, SourceSet] = {}
    for split in [*manifest.splits, None]:
        set_name = _check_name(prefix if split is None else f"{prefix}.{split}")
        ids = frozenset().union(*split_ids.values()) if split is None else split_ids[split]
        sets[set_name] = SourceSet(
            name=set_name,
            kind="frozen_split",
            ids=ids,
            provenance={**provenance, "split": split},
            freeze_name=manifest.name,
            freeze_splits=split_ids,
        )
    return sets


def _read_id_list(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InputError(f"id list {path} does not exist") from exc
    if path.suffix == ".json":
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"id list {path} is not valid JSON: {exc}") from exc
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise InputError(f"id list {path} must be a JSON list of instance-id strings")
        return ids
    return [line.strip() for line in text.splitlines() if line.strip()]


def id_list_set(name: str, source: str | Path | Iterable[str], source_revision: str) -> SourceSet:
    """An external list of instance ids pinned to the revision it was taken from.

    Args:
        source: a file (``.json``: a list of strings; otherwise one id per line) or the ids.
        source_revision: the list origin's revision (a commit, dataset revision, results-run id).

    Raises:
        InputError: empty ``source_revision``, or an unreadable/ill-formed file.
    """
    if not source_revision.strip():
        raise InputError(f"id list {name!r}: source_revision must be a non-empty revision")
    provenance: dict[str, Any] = {"source_revision": source_revision}
    if isinstance(source, str | Path):
        path = Path(source)
        ids = _read_id_list(path)
        provenance.update(path=str(path.resolve()), file_sha256=sha256_file(path))
    else:
        ids = list(source)
        provenance["ids"] = sorted(set(ids))
    return SourceSet(
        name=_check_name(name), kind="id_list", ids=frozenset(ids), provenance=provenance
    )


# --- definitions -------------------------------------------------------------------------------
def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _check_expression(name: str, node: ast.expr, text: str) -> None:
    if _dotted(node) is not None:
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        _check_expression(name, node.left, text)
        _check_expression(name, node.right, text)
        return
    raise InputError(
        f"derived set {name!r}: {ast.unparse(node)!r} in {text!r} is not allowed; use set names "
        "combined with & (intersection), | (union), - (difference) and parentheses"
    )


def _references(node: ast.expr) -> list[str]:
    dotted = _dotted(node)
    if dotted is not None:
        return [dotted]
    assert isinstance(node, ast.BinOp)
    return _references(node.left) + _references(node.right)


class Definitions(BaseModel):
    """Parsed definitions: derived-set name -> normalised expression text, in source order."""

    model_config = ConfigDict(frozen=True)

    expressions: dict[str, str]

    def references(self, name: str) -> list[str]:
        """The set names ``name``'s expression mentions, in order, without repeats."""
        node = ast.parse(self.expressions[name], mode="eval").body
        return list(dict.fromkeys(_references(node)))


def parse_definitions(source: str | Mapping[str, str]) -> Definitions:
    """Parse ``name = expression`` definitions (one per line, blank lines and ``#`` comments allowed, or a mapping).

    Raises:
        InputError: a line is not ``name = expression``, a name is defined twice, or an expression
            uses anything but set names, ``&``, ``|``, ``-`` and parentheses.
    """
    pairs: list[tuple[str, str]] = []
    if isinstance(source, Mapping):
        pairs = [(str(k), str(v)) for k, v in source.items()]
    else:
        for line_no, line in enumerate(source.splitlines(), start=1):
            stripped = line.split("#", 1)[0].strip()
            if not stripped:
                continue
            name, sep, expression = stripped.partition("=")
            if not sep or not name.strip().isidentifier():
                raise InputError(
                    f"definition line {line_no} {line.strip()!r}: expected 'name = expression' "
                    "with a plain identifier as name"
                )
            pairs.append((name.strip(), expression.strip()))
    expressions: dict[str, str] = {}
    for name, expression in pairs:
        if not name.isidentifier():
            raise InputError(f"derived set name {name!r} must be a plain identifier")
        if name in expressions:
            raise InputError(f"derived set {name!r} is defined twice")
        text = expression
        for spelling, operator in _SPELLINGS.items():
            text = text.replace(spelling, operator)
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError as exc:
            raise InputError(
                f"derived set {name!r}: expression {expression!r} does not parse: {exc.msg}"
            ) from exc
        _check_expression(name, node, expression)
        expressions[name] = ast.unparse(node)
    return Definitions(expressions=expressions)


# --- evaluation --------------------------------------------------------------------------------
class InputDigest(BaseModel):
    """One source set as recorded in a derived set: its kind, size, id digest and provenance."""

    model_config = ConfigDict(frozen=True)

    kind: SourceKind
    count: int = Field(ge=0)
    ids_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    provenance: dict[str, Any] = Field(default_factory=dict)


class DerivedSet(BaseModel):
    """A derived set and everything needed to rebuild and check it."""

    model_config = ConfigDict(frozen=True)

    name: str
    expression: str = Field(description="its normalised expression")
    ids: list[str] = Field(description="sorted instance ids")
    ids_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    definitions: dict[str, str] = Field(
        description="the derived definitions it depends on (itself included), name -> expression")
    inputs: dict[str, InputDigest] = Field(description="every source set it depends on, name -> digest and provenance")
    split_counts: dict[str, dict[str, int]] = Field(default_factory=dict,
        description="freeze name -> split -> number of ids in that split")

    @property
    def count(self) -> int:
        """Number of ids."""
        return len(self.ids)


def _evaluate(node: ast.expr, env: Mapping[str, frozenset[str]]) -> frozenset[str]:
    dotted = _dotted(node)
    if dotted is not None:
        return env[dotted]
    assert isinstance(node, ast.BinOp)
    left, right = _evaluate(node.left, env), _evaluate(node.right, env)
    if isinstance(node.op, ast.BitAnd):
        return left & right
    if isinstance(node.op, ast.BitOr):
        return left | right
    return left - right


def _topological_order(definitions: Definitions, sources: Mapping[str, SourceSet]) -> list[str]:
    for name in definitions.expressions:
        if name in sources:
            raise InputError(f"derived set {name!r} has the name of a source set; rename one")
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "active":
            cycle = path[path.index(name) :] + [name]
            raise InputError(f"derived sets form a cycle: {' -> '.join(cycle)}")
        state[name] = "active"
        for ref in definitions.references(name):
            if ref in sources:
                continue
            if ref not in definitions.expressions:
                known = sorted([*sources, *definitions.expressions])
                raise InputError(
                    f"derived set {name!r} = {definitions.expressions[name]!r} refers to unknown "
                    f"set {ref!r}; known sets: {', '.join(known)}"
                )
            visit(ref, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in definitions.expressions:
        visit(name, [])
    return order


def derive(
    definitions: str | Mapping[str, str] | Definitions,
    sources: Iterable[SourceSet] | Mapping[str, SourceSet],
) -> dict[str, DerivedSet]:
    """Evaluate every definition over the source sets; derived name -> set, in dependency order.

    Raises:
        InputError: bad definitions, a name used by two source sets, a derived name equal to a source
            name, an unknown name (the known ones listed) or a cycle (shown, e.g. ``a -> b -> a``).
    """
    parsed = definitions if isinstance(definitions, Definitions) else parse_definitions(definitions)
    by_name: dict[str, SourceSet] = {}
    for source in sources.values() if isinstance(sources, Mapping) else sources:
        if source.name in by_name:
            raise InputError(f"source set {source.name!r} is given twice")
        by_name[source.name] = source
    order = _topological_order(parsed, by_name)
    env: dict[str, frozenset[str]] = {name: source.ids for name, source in by_name.items()}
    leaves: dict[str, set[str]] = {}
    closure: dict[str, set[str]] = {}
    results: dict[str, DerivedSet] = {}
    for name in order:
        refs = parsed.references(name)
        env[name] = _evaluate(ast.parse(parsed.expressions[name], mode="eval").body, env)
        leaves[name] = set()
        closure[name] = {name}
        for ref in refs:
            if ref in by_name:
                leaves[name].add(ref)
            else:
                leaves[name] |= leaves[ref]
                closure[name] |= closure[ref]
        ids = sorted(env[name])
        split_counts: dict[str, dict[str, int]] = {}
        for leaf in sorted(leaves[name]):
            source = by_name[leaf]
            if source.freeze_name is not None and source.freeze_splits is not None:
                split_counts[source.freeze_name] = {
                    split: len(env[name] & source.freeze_splits[split])
                    for split in sorted(source.freeze_splits, key=_split_rank)
                }
        results[name] = DerivedSet(
            name=name,
            expression=parsed.expressions[name],
            ids=ids,
            ids_sha256=ids_sha256(ids),
            definitions={d: parsed.expressions[d] for d in order if d in closure[name]},
            inputs={
                leaf: InputDigest(
                    kind=by_name[leaf].kind,
                    count=len(by_name[leaf].ids),
                    ids_sha256=by_name[leaf].sha256,
                    provenance=by_name[leaf].provenance,
                )
                for leaf in sorted(leaves[name])
            },
            split_counts=split_counts,
        )
    return results


def _split_rank(split: str) -> tuple[int, str]:
    return (SPLITS.index(split) if split in SPLITS else len(SPLITS), split)


