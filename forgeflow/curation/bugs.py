"""Candidate bugs, SWE-smith style: procedural modifiers applied to a project's own source.

Uses the lower-level pieces of swesmith 0.0.9's procedural generator
(``swesmith.bug_gen.procedural.generate``) on a local checkout, offline: entities from
``get_entities_from_file`` (test files skipped by ``RepoProfile._is_test_path``), every Python modifier
of ``MAP_EXT_TO_MODIFIERS[".py"]``, patches by ``generate_patch_fast``, ids as
``swesmith.bug_gen.collect_patches`` names them. swesmith's ``main()`` is not used (it clones from
GitHub and deletes a folder in the working directory); its modifiers are singletons with their own
RNG, so fresh seeded instances are made per call: the result depends only on (checkout content,
source_dir, max_candidates, seed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors

__all__ = [
    "Candidate",
    "CandidateSet",
    "generate_candidates",
    "generate_candidate_set",
    "check_patch_applies",
    "rank_key",
]

_GIT_TIMEOUT_S = 60
_PY_EXT = ".py"


class Candidate(BaseModel):
    """One candidate bug: a patch that breaks a function or class of a project's source (FAIL_TO_PASS /
    PASS_TO_PASS exist only after validation).
    """

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(pattern=r"^[A-Za-z0-9._-]+\.[A-Za-z0-9_]+__[a-z0-9]{8}$",
        description="<repo>.<modifier>__<hash8> (swesmith's form), unique within a repo")
    repo: str = Field(min_length=1, description="the project's name (e.g. inflection)")
    patch: str = Field(min_length=1,
        description="a git-style unified diff (a/ and b/ prefixes) that introduces the bug")
    modifier: str = Field(min_length=1, description="swesmith's modifier name (e.g. func_pm_remove_assign)")
    file_path: str = Field(min_length=1,
        description="the changed file, relative to the checkout root (POSIX separators)")
    func_name: str = Field(min_length=1, description="the function or class the modifier rewrote")


class CandidateSet(BaseModel):
    """The outcome of one generation: the chosen candidates and what was dropped on the way."""

    model_config = ConfigDict(frozen=True)

    candidates: list[Candidate] = Field(description="at most max_candidates candidates, in rank order")
    generated: int = Field(ge=0, description="distinct patches the modifiers produced before the apply check")
    dropped_unapplicable: int = Field(ge=0, description="patches that failed git apply --check on the clean checkout")
    examined: int = Field(ge=0, description="patches put through the apply check (it stops once enough passed)")


def rank_key(seed: int, instance_id: str) -> str:
    """The stable order of candidates: hex sha256 of ``"<seed>:<instance_id>"``."""
    return hashlib.sha256(f"{seed}:{instance_id}".encode()).hexdigest()


def check_patch_applies(checkout_dir: Path, patch: str, instance_id: str) -> None:
    """Check that ``patch`` applies to the clean tree at ``checkout_dir`` (``git apply --check``, nothing changed).

    Raises:
        PatchApplyError: the patch does not apply; the message names ``instance_id`` and git's reason.
        InputError: ``checkout_dir`` is not a directory.
        ToolMissingError: git is not installed.
    """
    root = Path(checkout_dir)
    if not root.is_dir():
        raise errors.InputError(f"checkout_dir {str(root)!r} is not a directory")
    try:
        proc = subprocess.run(
            ["git", "apply", "--check", "-"], cwd=root, input=patch, capture_output=True,
            text=True, timeout=_GIT_TIMEOUT_S,
        )
    except FileNotFoundError as exc:
        raise errors.ToolMissingError("git is not installed (apt-get install git)") from exc
    if proc.returncode != 0:
        raise errors.PatchApplyError(
            f"patch of {instance_id} does not apply to {root}: {proc.stderr.strip()[:500]}"
        )


def _source_files(root: Path, source_dir: str) -> list[Path]:
    """Non-test ``.py`` files under ``root/source_dir`` (a folder or one file), sorted; hidden
    folders (``.git``, ``.tox``) skipped."""
    from swesmith.profiles.base import (
        RepoProfile,  # heavy import (profiles registry): lazily
    )

    # swesmith's own test-path rule; it reads only ``self.exts``
    rule = SimpleNamespace(exts=[_PY_EXT])
    base = (root / source_dir).resolve()
    if not base.is_relative_to(root.resolve()):
        raise errors.InputError(f"source_dir {source_dir!r} escapes the checkout {str(root)!r}")
    if base.is_file():
        files = [base] if base.suffix == _PY_EXT else []
    elif base.is_dir():
        files = sorted(p for p in base.rglob(f"*{_PY_EXT}") if p.is_file())
    else:
        raise errors.InputError(f"source_dir {source_dir!r} does not exist in {str(root)!r}")
    keep = []
    for path in files:
        rel_parent = path.parent.relative_to(root.resolve()).as_posix()
        if any(part.startswith(".") and part != "." for part in rel_parent.split("/")):
            continue  # .git, .tox, .venv, ...
        if RepoProfile._is_test_path(rule, rel_parent, path.name):
            continue
        keep.append(path)
    return keep


def _raw_candidates(repo: str, root: Path, source_dir: str, seed: int) -> dict[str, Candidate]:
    """Every (entity, modifier) rewrite as a candidate, keyed by instance id (first one wins)."""
    from swesmith.bug_gen.adapters import get_entities_from_file
    from swesmith.bug_gen.procedural import MAP_EXT_TO_MODIFIERS
    from swesmith.bug_gen.utils import generate_patch_fast

    entities = []
    for path in _source_files(root, source_dir):
        get_entities_from_file[_PY_EXT](entities, str(path))
    entities.sort(key=lambda e: (e.file_path, e.line_start, e.line_end))
    out: dict[str, Candidate] = {}
    for template in MAP_EXT_TO_MODIFIERS[_PY_EXT]:
        pm = type(template)(likelihood=template.likelihood, seed=seed)
        for entity in entities:
            if not pm.can_change(entity):
                continue
            bug = pm.modify(entity)
            if bug is None:
                continue
            patch = generate_patch_fast(entity, bug, str(root.resolve()))
            if not patch:
                continue
            instance_id = f"{repo}.{pm.name}__{bug.get_hash()}"
            if instance_id in out:
                continue
            out[instance_id] = Candidate(
                instance_id=instance_id, repo=repo, patch=patch, modifier=pm.name,
                file_path=os.path.relpath(entity.file_path, root.resolve()).replace(os.sep, "/"),
                func_name=entity.name,
            )
    return out


def generate_candidate_set(
    repo: str, checkout_dir: Path, source_dir: str, max_candidates: int, seed: int
) -> CandidateSet:
    """Generate candidate bugs and report how many were produced and dropped.

    Every modifier is tried on every function/class of the non-test ``.py`` files under ``source_dir``;
    distinct patches, ranked by :func:`rank_key`, go through :func:`check_patch_applies` until
    ``max_candidates`` pass.

    Args:
        source_dir: the package folder or module file relative to ``checkout_dir`` (``src/cachetools``, ``six.py``).
        seed: seeds the modifiers' RNG and the ranking; same inputs, same candidates.

    Raises:
        InputError: a bad argument (named in the message).
        ToolMissingError: git is not installed.
    """
    if not repo or not all(c.isalnum() or c in "._-" for c in repo):
        raise errors.InputError(f"repo {repo!r} must be non-empty and use only [A-Za-z0-9._-]")
    if max_candidates < 1:
        raise errors.InputError(f"max_candidates must be >= 1, got {max_candidates}")
    root = Path(checkout_dir)
    if not (root / ".git").exists():
        raise errors.InputError(f"checkout_dir {str(root)!r} is not a git checkout (no .git)")
    raw = _raw_candidates(repo, root, source_dir, seed)
    ranked = sorted(raw.values(), key=lambda c: rank_key(seed, c.instance_id))
    chosen: list[Candidate] = []
    dropped = examined = 0
    for cand in ranked:
        if len(chosen) >= max_candidates:
            break
        examined += 1
        try:
            check_patch_applies(root, cand.patch, cand.instance_id)
        except errors.PatchApplyError:
            dropped += 1
            continue
        chosen.append(cand)
    return CandidateSet(
        candidates=chosen, generated=len(raw), dropped_unapplicable=dropped, examined=examined
    )


def generate_candidates(
    repo: str, checkout_dir: Path, source_dir: str, max_candidates: int, seed: int
) -> list[Candidate]:
    """The candidates of :func:`generate_candidate_set`, in rank order.

    Raises:
        InputError: a bad argument.
        ToolMissingError: git is missing.
    """
    return generate_candidate_set(repo, checkout_dir, source_dir, max_candidates, seed).candidates
