"""What a submission changed, as git itself sees it inside the sandbox (never a second parse of its text).

A submission reaches the verifier as a diff (an RL completion's patch, a stored submission) or as the
agent's working tree copied out of its container (:mod:`forgeflow.sandbox.tree`). Either is put in
place in a fresh container of the pristine task image, and what it changed is then read from git's
machine-readable output there:

1. **probe** (before anything of the submission is in place): the task's interpreter prints its
   ``sys.path`` and the top-level module names it can import from outside the repository (the
   standard library, built-ins, site-packages): what a new module in the repository could shadow;
2. **base snapshot**: every file under the repository (tracked, untracked and ignored alike:
   ``git add -A -f`` into a private index, ``git write-tree``), so files the image holds outside git's
   history (build outputs, ``*.egg-info``) are part of the baseline;
3. the submission is put in place: ``git apply`` of the diff (git decides what it accepts; a diff it
   refuses is the submission's outcome, reward 0), or the agent's tree replaces every path but ``.git``;
4. **after snapshot**, then ``git diff-tree -r -z --no-renames --raw BASE AFTER``: every path whose
   content, mode or type changed (additions, deletions, mode changes, symlinks), NUL-separated, and
   ``git diff-tree -p --binary`` of the same trees: the submission as git wrote it (what a re-score
   re-applies, and what the static screen reads the added lines of).

git runs with a configuration the submission cannot change: no system or global configuration
(``GIT_CONFIG_NOSYSTEM``, ``GIT_CONFIG_GLOBAL=/dev/null``), no hooks, no fsmonitor, no external diff
drivers or text conversion, literal pathspecs, and attributes pinned by :data:`NEUTRAL_ATTRIBUTES` in
``.git/info/attributes`` (a ``.gitattributes`` of the submission's cannot re-encode, filter or hide a
file from the snapshots: found by a red-team run, a UTF-7 ``working-tree-encoding`` made an edited test
file hash as the pristine one); the repository's own ``.git`` is the pristine image's
(``git apply`` refuses paths under ``.git`` and outside the work tree, and an agent's ``.git`` is never
copied in).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors

__all__ = [
    "GIT_ENV",
    "Change",
    "RunnerProbe",
    "TreeChanges",
    "changes_script",
    "parse_changes",
    "restore_script",
    "parse_raw_diff",
]

GIT_ENV: dict[str, str] = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_ATTR_NOSYSTEM": "1",
}
"""Environment of every git the verifier runs: no system or global configuration, no prompts."""

_GIT = ("git --literal-pathspecs -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotePath=false "
        "-c core.symlinks=true -c core.autocrlf=false -c core.safecrlf=false -c core.attributesFile=/dev/null "
        "-c core.excludesFile=/dev/null -c diff.external= -c diff.noprefix=false -c diff.mnemonicprefix=false")
"""git with the verifier's fixed options (the repository's own config is the pristine image's)."""

NEUTRAL_ATTRIBUTES = ("* !working-tree-encoding !ident !text !eol !crlf !filter !diff !merge !export-subst "
                      "!whitespace")
"""Written to the sandbox's ``.git/info/attributes`` (which outranks every ``.gitattributes`` of the work
tree) before any snapshot: a submission's ``.gitattributes`` cannot make git hash a file other than as
its bytes (``working-tree-encoding``, ``ident``, ``eol`` conversions, a ``filter``) nor turn a text file
into a binary diff (``-diff``) that the static screen cannot read. ``!attr`` leaves each unspecified."""

ChangeStatus = Literal["A", "M", "D", "T"]
"""git's status letters without renames or copies (``--no-renames``): added, modified, deleted,
type changed (a file became a symlink or the reverse)."""

_PROBE = r'''
import json, os, pkgutil, sys
repo = os.path.abspath(os.curdir)
entries = [os.path.abspath(p or os.curdir) for p in sys.path]
inside = [p for p in entries if p == repo or p.startswith(repo + os.sep)]
outside = [p for p in entries if p not in inside]
names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
names.update(m.name for m in pkgutil.iter_modules([p for p in outside if os.path.isdir(p)]))
print(json.dumps({"executable": sys.executable, "sys_path": entries, "repo_entries": inside,
                  "names": sorted(names)}))
'''


class Change(BaseModel):
    """One path the submission changed, as ``git diff-tree --raw`` reports it.

    Attributes:
        status: ``A`` added, ``M`` modified (content or mode), ``D`` deleted, ``T`` type changed.
        path: repository-relative POSIX path (as git stores it: bytes that are not UTF-8 replaced).
        old_mode: git's octal mode before (``000000`` for an added path).
        new_mode: after (``000000`` for a deleted path; ``120000`` a symbolic link, ``100755`` executable).
    """

    model_config = ConfigDict(frozen=True)

    status: ChangeStatus
    path: str = Field(min_length=1)
    old_mode: str = Field(pattern=r"^[0-7]{6}$")
    new_mode: str = Field(pattern=r"^[0-7]{6}$")

    @property
    def is_symlink(self) -> bool:
        """True when the path is a symbolic link after the change."""
        return self.new_mode == "120000"


class RunnerProbe(BaseModel):
    """What the task's interpreter imports from, measured in the pristine sandbox before the submission.

    Attributes:
        executable: the interpreter (``python3`` on the image's PATH, in the verifier's environment).
        sys_path: its ``sys.path``, absolute (the repository first when the tests run from it).
        repo_entries: the entries at or under the repository (where a new file becomes a module).
        names: top-level module names importable from outside the repository: the standard
            library, built-ins and every module or package in the other ``sys.path`` entries.
    """

    model_config = ConfigDict(frozen=True)

    executable: str = ""
    sys_path: list[str] = Field(default_factory=list)
    repo_entries: list[str] = Field(default_factory=list)
    names: frozenset[str] = Field(default_factory=frozenset)


class TreeChanges(BaseModel):
    """What git saw the submission change in the sandbox.

    Attributes:
        applied: False when ``git apply`` refused the diff (nothing changed; the submission's outcome).
        apply_output: git's own words when it refused (the end of them).
        base_tree: the tree object of the pristine snapshot (40 hex).
        after_tree: the tree object after the submission was put in place.
        changes: every changed path, in git's order.
        patch: ``git diff-tree -p --binary`` of the two snapshots (the submission as git wrote it).
        probe: the interpreter's measured import paths (:class:`RunnerProbe`).
    """

    model_config = ConfigDict(frozen=True)

    applied: bool = True
    apply_output: str = ""
    base_tree: str = ""
    after_tree: str = ""
    changes: list[Change] = Field(default_factory=list)
    patch: str = ""
    probe: RunnerProbe = Field(default_factory=RunnerProbe)

    @property
    def paths(self) -> list[str]:
        """Every changed path, sorted."""
        return sorted(c.path for c in self.changes)


def changes_script(repo: str, nonce: str, *, patch_path: str | None = None, tree_path: str | None = None) -> str:
    """The bash script that probes the interpreter, snapshots ``repo``, puts the submission in place and
    prints what git saw change, each part after a line ``@@FF-<nonce> <part>@@`` (:func:`parse_changes`).

    Args:
        repo: the repository (``/testbed``; any git work tree in tests).
        nonce: hex that frames the parts (fresh per run).
        patch_path: a diff to ``git apply`` (removed after); None: no diff.
        tree_path: a tar of the agent's work tree to put in place of every path but ``.git`` (removed
            after); None: no tree. At most one of ``patch_path`` and ``tree_path``.

    Raises:
        InputError: both a patch and a tree, or a nonce that is not hex.
    """
    if patch_path and tree_path:
        raise errors.InputError("changes_script takes a patch or a tree, not both")
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise errors.InputError(f"nonce must be 8-64 lowercase hex, got {nonce!r}")
    env = " ".join(f"{k}={v}" for k, v in GIT_ENV.items())
    folder = f"/tmp/forgeflow-changes-{nonce}"
    put = ":"
    if patch_path:
        put = (f'g apply --whitespace=nowarn "{patch_path}" >"$d/apply.log" 2>&1; rc=$?; rm -f "{patch_path}"\n'
               'if [ "$rc" -ne 0 ]; then mark applyfail; tail -c 4000 "$d/apply.log"; exit 0; fi')
    elif tree_path:
        put = ("find . -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {} + || exit 125\n"
               f'tar -x --no-same-owner --exclude=./.git --exclude=.git -f "{tree_path}" -C . >"$d/tar.log" 2>&1; '
               f'rc=$?; rm -f "{tree_path}"\n'
               'if [ "$rc" -ne 0 ]; then mark treefail; tail -c 4000 "$d/tar.log"; exit 0; fi\n'
               "chmod -R u+rwX . 2>/dev/null")
    return f"""cd {repo} || exit 126
export {env}
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_EXTERNAL_DIFF GIT_DIFF_OPTS GIT_CEILING_DIRECTORIES
d={folder}; mkdir -p "$d" || exit 125
g() {{ {_GIT} "$@"; }}
mark() {{ printf '\\n@@FF-{nonce} %s@@\\n' "$1"; }}
snap() {{ GIT_INDEX_FILE="$d/index" g add -A -f -- . >"$d/add.log" 2>&1 && GIT_INDEX_FILE="$d/index" g write-tree; }}
gd=$(g rev-parse --absolute-git-dir) && mkdir -p "$gd/info" && printf '%s\\n' '{NEUTRAL_ATTRIBUTES}' \\
  > "$gd/info/attributes" || exit 125
mark probe
python3 - <<'FORGEFLOW_PROBE_{nonce}' 2>/dev/null
{_PROBE}
FORGEFLOW_PROBE_{nonce}
[ -f .git/index ] && cp .git/index "$d/index"
if ! base=$(snap); then mark basefail; tail -c 4000 "$d/add.log"; exit 125; fi
{put}
if ! after=$(snap); then mark afterfail; tail -c 4000 "$d/add.log"; exit 0; fi
mark trees; printf '%s %s\\n' "$base" "$after"
mark raw; g diff-tree -r -z --no-renames --raw "$base" "$after" || exit 125
mark patch; g diff-tree -r -p --binary --full-index --no-renames --no-ext-diff --no-textconv --no-color \\
  "$base" "$after" || exit 125
mark end
"""


def _parts(stdout: str, nonce: str) -> dict[str, str]:
    pieces = re.split(rf"\n@@FF-{nonce} ([a-z]+)@@\n", stdout)
    return {pieces[i]: pieces[i + 1] for i in range(1, len(pieces) - 1, 2)}


def parse_raw_diff(raw: str) -> list[Change]:
    """Parse ``git diff-tree -r -z --no-renames --raw`` output into changes.

    Each record is ``:<old mode> <new mode> <old sha> <new sha> <status>`` NUL ``<path>`` NUL.

    Raises:
        VerifierOutputError: a record that is not in git's raw format.
    """
    fields = raw.split("\0")
    out: list[Change] = []
    i = 0
    while i < len(fields):
        head = fields[i].lstrip("\n")
        if not head:
            i += 1
            continue
        match = re.fullmatch(r":([0-7]{6}) ([0-7]{6}) [0-9a-f]+ [0-9a-f]+ ([AMDT])", head)
        if match is None or i + 1 >= len(fields):
            raise errors.VerifierOutputError(f"git diff-tree printed a record that is not git's raw format: {head!r}")
        out.append(Change(status=match.group(3), path=fields[i + 1], old_mode=match.group(1),
                          new_mode=match.group(2)))
        i += 2
    return out


def _probe(text: str) -> RunnerProbe:
    for line in reversed(text.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return RunnerProbe(executable=str(data.get("executable", "")),
                               sys_path=[str(p) for p in data.get("sys_path", [])],
                               repo_entries=[str(p) for p in data.get("repo_entries", [])],
                               names=frozenset(str(n) for n in data.get("names", [])))
    return RunnerProbe()


def parse_changes(stdout: str, exit_code: int, nonce: str) -> TreeChanges:
    """Read what :func:`changes_script` printed.

    Args:
        stdout: the script's standard output.
        exit_code: its exit status.
        nonce: the nonce the script was made with.

    Returns:
        :class:`TreeChanges`; ``applied=False`` with git's words when ``git apply`` refused the diff,
        or the agent's tree could not be put in place or snapshotted (the submission's outcome).

    Raises:
        SandboxError: the pristine snapshot or git itself failed (exit 125/126, or output cut short):
            the sandbox broke, whatever the submission.
    """
    parts = _parts(stdout, nonce)
    probe = _probe(parts.get("probe", ""))
    for failed in ("applyfail", "treefail", "afterfail"):
        if failed in parts:
            return TreeChanges(applied=False, apply_output=parts[failed].strip()[-4000:], probe=probe)
    if "basefail" in parts or exit_code != 0 or "end" not in parts:
        detail = (parts.get("basefail") or stdout[-1000:]).strip()
        raise errors.SandboxError(f"listing what the submission changed failed in the sandbox (exit {exit_code}; "
                                  f"evidence: {detail[-600:]!r})")
    trees = parts["trees"].split()
    return TreeChanges(base_tree=trees[0], after_tree=trees[1], changes=parse_raw_diff(parts["raw"]),
                       patch=parts["patch"], probe=probe)


def restore_script(repo: str, base_tree: str, paths_file: str) -> str:
    """The bash script that puts the NUL-separated paths listed in ``paths_file`` back as the pristine
    snapshot ``base_tree`` has them (content, mode, type) and removes those it does not have.

    Raises:
        InputError: ``base_tree`` is not a tree id.
    """
    if not re.fullmatch(r"[0-9a-f]{40,64}", base_tree):
        raise errors.InputError(f"base_tree must be a git object id, got {base_tree!r}")
    env = " ".join(f"{k}={v}" for k, v in GIT_ENV.items())
    nonce = uuid.uuid4().hex[:12]
    return f"""cd {repo} || exit 126
export {env}
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE
g() {{ {_GIT} "$@"; }}
idx=/tmp/forgeflow-restore-{nonce}.index
GIT_INDEX_FILE=$idx g read-tree "{base_tree}" || exit 125
while IFS= read -r -d '' p; do
  rm -rf -- "$p" || exit 125
  if g cat-file -e "{base_tree}:$p" 2>/dev/null; then
    GIT_INDEX_FILE=$idx g checkout-index -f -- "$p" || exit 125
  fi
done < "{paths_file}"
rm -f "{paths_file}" "$idx"
"""
