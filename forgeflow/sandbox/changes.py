"""What a submission changed, as git itself sees it inside the sandbox (never a second parse of its text).

In a fresh container: a probe of the interpreter (what a new module could shadow), a snapshot of every file,
the submission put in place, a second snapshot and ``git diff-tree`` of the two. git runs with a configuration
the submission cannot change (no system/global config, hooks, fsmonitor, diff drivers; attributes pinned by
:data:`NEUTRAL_ATTRIBUTES`: a red-team run's UTF-7 ``working-tree-encoding`` once made an edited test hash as
the pristine one)."""

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
    "os_path_bytes",
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
tried, mark = set(), "forgeflow_probe_mark_" + os.urandom(6).hex()


class _Tried:  # every top-level name pytest's start-up looks for, up to where the report plugin is imported
    done = False

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top == mark:
            _Tried.done = True
        elif not _Tried.done:
            tried.add(top)


sys.meta_path.insert(0, _Tried())
try:  # pytest's start-up with the task's own configuration, as the test command's, to the plugin's import
    import pytest
    from _pytest.config import _prepareconfig
    _prepareconfig(["-p", mark, "-p", "no:cacheprovider"])
except BaseException:
    pass
print(json.dumps({"executable": sys.executable, "sys_path": entries, "repo_entries": inside,
                  "names": sorted(names), "startup_names": sorted(tried)}))
'''


class Change(BaseModel):
    """One path the submission changed, as ``git diff-tree --raw`` reports it."""

    model_config = ConfigDict(frozen=True)

    status: ChangeStatus = Field(description="A added, M modified (content or mode), D deleted, T type changed.")
    path: str = Field(min_length=1,
                      description="repository-relative POSIX path, for rules and people: bytes that are not UTF-8 "
                                  "written as \\\\xNN (two different paths can look alike here; raw_path tells them "
                                  "apart).")
    raw_path_hex: str = Field(default="", pattern=r"^([0-9a-f]{2})*$",
                              description="the path's bytes as git stores them, hex; empty: path encoded as UTF-8.")
    old_mode: str = Field(pattern=r"^[0-7]{6}$", description="git's octal mode before (000000 for an added path).")
    new_mode: str = Field(pattern=r"^[0-7]{6}$",
                          description="after (000000 for a deleted path; 120000 a symbolic link, 100755 "
                                      "executable).")

    @property
    def raw_path(self) -> bytes:
        """The path's exact bytes (what a restore removes and checks out, what a runner's file name is
        compared with: a directory named ``\\xff`` is not ``\\ufffd``, found by a red-team run)."""
        return bytes.fromhex(self.raw_path_hex) if self.raw_path_hex else self.path.encode("utf-8")

    @property
    def is_symlink(self) -> bool:
        """True when the path is a symbolic link after the change."""
        return self.new_mode == "120000"


def os_path_bytes(path: str) -> bytes:
    """A file name as Python's ``os`` functions give it (undecodable bytes as lone surrogates, PEP 383) as
    the bytes on disk, comparable with :attr:`Change.raw_path`."""
    return path.encode("utf-8", errors="surrogateescape")


class RunnerProbe(BaseModel):
    """What the task's interpreter imports from, measured in the pristine sandbox before the submission."""

    model_config = ConfigDict(frozen=True)

    executable: str = Field("",
                            description="the interpreter (python3 on the image's PATH, in the verifier's "
                                        "environment).")
    sys_path: list[str] = Field(default_factory=list,
                                description="its sys.path, absolute (the repository first when the tests run from "
                                            "it).")
    repo_entries: list[str] = Field(default_factory=list,
                                    description="the entries at or under the repository (where a new file becomes a "
                                                "module).")
    names: frozenset[str] = Field(default_factory=frozenset,
                                  description="top-level module names importable from outside the repository: the "
                                              "standard library, built-ins and every module or package in the other "
                                              "sys.path entries.")
    startup_names: frozenset[str] = Field(
        default_factory=frozenset,
        description="every top-level name the interpreter looked for while pytest started with the task's "
                    "configuration, up to where the verifier's report plugin is imported (a meta-path finder that "
                    "records and finds nothing): a new module of such a name in the repository would run before the "
                    "plugin (a red-team run: a new org package, which copy tries to import, patched pytest before "
                    "the plugin's integrity snapshot).")


class TreeChanges(BaseModel):
    """What git saw the submission change in the sandbox."""

    model_config = ConfigDict(frozen=True)

    applied: bool = Field(True,
                          description="False when git apply refused the diff (nothing changed; the submission's "
                                      "outcome).")
    apply_output: str = Field("", description="git's own words when it refused (the end of them).")
    base_tree: str = Field("", description="the tree object of the pristine snapshot (40 hex).")
    after_tree: str = Field("", description="the tree object after the submission was put in place.")
    changes: list[Change] = Field(default_factory=list, description="every changed path, in git's order.")
    patch: str = Field("",
                       description="git diff-tree -p --binary of the two snapshots (the submission as git wrote "
                                   "it).")
    probe: RunnerProbe = Field(default_factory=RunnerProbe,
                               description="the interpreter's measured import paths (RunnerProbe).")
    put_failure: str = Field("",
                             description="with applied=False, the submission's own limit hit while it was put in "
                                         "place (timeout, oom, pids_limit: its patch inflated past the memory "
                                         "limit, ...; output_limit: git's listing of its changes passed the output "
                                         "bound); empty when git refused it or it was put in place.")

    @property
    def paths(self) -> list[str]:
        """Every changed path, sorted."""
        return sorted(c.path for c in self.changes)


def changes_script(repo: str, nonce: str, *, patch_path: str | None = None, tree_path: str | None = None,
                   part: Literal["all", "base", "put"] = "all") -> str:
    """The bash script that probes the interpreter, snapshots ``repo``, puts the submission in place (a diff, or a
    tar of the agent's tree; at most one) and prints each part after ``@@FF-<nonce> <part>@@``.

    Raises:
        InputError: both a patch and a tree, a nonce that is not hex, or an unknown part.
    """
    if patch_path and tree_path:
        raise errors.InputError("changes_script takes a patch or a tree, not both")
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise errors.InputError(f"nonce must be 8-64 lowercase hex, got {nonce!r}")
    if part not in ("all", "base", "put"):
        raise errors.InputError(f"part must be all, base or put, got {part!r}")
    env = " ".join(f"{k}={v}" for k, v in GIT_ENV.items())
    folder = f"/tmp/forgeflow-changes-{nonce}"
    put = ":"
    if patch_path:
        put = (f'g apply --whitespace=nowarn "{patch_path}" >"$d/apply.log" 2>&1; rc=$?; rm -f "{patch_path}"\n'
               'if [ "$rc" -ne 0 ]; then mark applyfail; tail -c 4000 "$d/apply.log"; exit 0; fi')
    elif tree_path:  # the repository's .git is out of the work tree while the agent's tar is extracted: a
        # member behind a link to it (lnk -> .git, lnk/config) finds nothing there to write (a red-team run)
        put = ('mv .git "$d/dotgit" || exit 125\n'
               "find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + || exit 125\n"
               f'tar -x --no-same-owner --exclude=./.git --exclude=.git -f "{tree_path}" -C . >"$d/tar.log" 2>&1; '
               f'rc=$?; rm -f "{tree_path}"\n'
               'rm -rf .git && mv "$d/dotgit" .git || exit 125\n'
               'if [ "$rc" -ne 0 ]; then mark treefail; tail -c 4000 "$d/tar.log"; exit 0; fi\n'
               "chmod -R u+rwX . 2>/dev/null")
    head = f"""cd {repo} || exit 126
export {env}
unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE GIT_EXTERNAL_DIFF GIT_DIFF_OPTS GIT_CEILING_DIRECTORIES
d={folder}; mkdir -p "$d" || exit 125
g() {{ {_GIT} "$@"; }}
mark() {{ printf '\\n@@FF-{nonce} %s@@\\n' "$1"; }}
snap() {{ GIT_INDEX_FILE="$d/index" g add -A -f -- . >"$d/add.log" 2>&1 && GIT_INDEX_FILE="$d/index" g write-tree; }}
"""
    base = f"""gd=$(g rev-parse --absolute-git-dir) && mkdir -p "$gd/info" && printf '%s\\n' '{NEUTRAL_ATTRIBUTES}' \\
  > "$gd/info/attributes" || exit 125
mark probe
python3 - <<'FORGEFLOW_PROBE_{nonce}' 2>/dev/null
{_PROBE}
FORGEFLOW_PROBE_{nonce}
[ -f .git/index ] && cp .git/index "$d/index"
if ! base=$(snap); then mark basefail; tail -c 4000 "$d/add.log"; exit 125; fi
printf '%s' "$base" > "$d/base" || exit 125
"""
    after = f"""base=$(cat "$d/base") || exit 125
{put}
if ! after=$(snap); then mark afterfail; tail -c 4000 "$d/add.log"; exit 0; fi
mark trees; printf '%s %s\\n' "$base" "$after"
mark raw; (set -o pipefail; g diff-tree -r -z --no-renames --raw "$base" "$after" | od -An -v -tx1 | tr -dc 0-9a-f) \\
  || exit 125
mark patch; g diff-tree -r -p --binary --full-index --no-renames --no-ext-diff --no-textconv --no-color \\
  "$base" "$after" || exit 125
mark end
"""
    return head + {"all": base + after, "base": base, "put": after}[part]


def _parts(stdout: str, nonce: str) -> dict[str, str]:
    pieces = re.split(rf"\n@@FF-{nonce} ([a-z]+)@@\n", stdout)
    return {pieces[i]: pieces[i + 1] for i in range(1, len(pieces) - 1, 2)}


def parse_raw_diff(raw: bytes | str) -> list[Change]:
    """Parse ``git diff-tree -r -z --no-renames --raw`` output into changes.

    Raises:
        VerifierOutputError: a record that is not in git's raw format.
    """
    fields = (raw if isinstance(raw, bytes) else raw.encode("utf-8", errors="surrogateescape")).split(b"\0")
    out: list[Change] = []
    i = 0
    while i < len(fields):
        head = fields[i].lstrip(b"\n").decode("ascii", errors="replace")
        if not head:
            i += 1
            continue
        match = re.fullmatch(r":([0-7]{6}) ([0-7]{6}) [0-9a-f]+ [0-9a-f]+ ([AMDT])", head)
        if match is None or i + 1 >= len(fields):
            raise errors.VerifierOutputError(f"git diff-tree printed a record that is not git's raw format: {head!r}")
        path = fields[i + 1]
        out.append(Change(status=match.group(3), path=path.decode("utf-8", errors="backslashreplace"),
                          raw_path_hex=path.hex(), old_mode=match.group(1), new_mode=match.group(2)))
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
                               names=frozenset(str(n) for n in data.get("names", [])),
                               startup_names=frozenset(str(n) for n in data.get("startup_names", [])))
    return RunnerProbe()


def parse_changes(stdout: str, exit_code: int, nonce: str) -> TreeChanges:
    """Read what :func:`changes_script` printed; ``applied=False`` with git's words when the submission could not
    be put in place.

    Raises:
        SandboxError: the pristine snapshot or git failed (exit 125/126, or output cut short).
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
    try:
        raw = bytes.fromhex(parts["raw"].strip())
    except ValueError as exc:
        raise errors.SandboxError(f"git's list of changed paths came back garbled (evidence: "
                                  f"{parts['raw'][:200]!r})") from exc
    return TreeChanges(base_tree=trees[0], after_tree=trees[1], changes=parse_raw_diff(raw),
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
