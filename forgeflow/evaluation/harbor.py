"""Harbor interop: export a frozen split as Harbor tasks (import: :mod:`forgeflow.evaluation.harbor_import`).

`Harbor <https://github.com/laude-institute/harbor>`_ (PyPI ``harbor``, pinned 0.25.0) is touched only through
its *file formats*; it is never imported (it needs Python >= 3.12: ``scripts/harbor_venv.sh``).
:func:`export_split` writes one task folder per instance id (the layout of
``harbor.models.task.paths.TaskPaths``)::

    <out_dir>/forgeflow-export.json     schema version, freeze, split, per-task tree digests
    <out_dir>/<instance_id>/task.toml   Harbor's TaskConfig (schema_version "1.4")
    <out_dir>/<instance_id>/instruction.md, environment/Dockerfile (FROM the task image)
    <out_dir>/<instance_id>/tests/test.sh, grade.py, config.json (FAIL_TO_PASS / PASS_TO_PASS)
    <out_dir>/<instance_id>/solution/solve.sh, bug.patch (the Oracle: ``git apply -R``)

The verifier is weaker than forgeflow's: Harbor runs ``test.sh`` in the agent's own container, so it can only
reset the named test files to ``HEAD`` before grading; trusted numbers come from forgeflow's verifier.
``grade.py`` embeds SWE-bench's ``parse_log_pytest`` from the pinned swebench; a log that is not pytest output
writes **no** reward file (Harbor's ``RewardFileNotFoundError``: an exception, never a reward of 0)."""


from __future__ import annotations

import inspect
import json
import os
import shlex
import shutil
import tomllib
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import forgeflow
from forgeflow.common import errors
from forgeflow.common.fsutil import (
    atomic_write_bytes,
    read_digested_json,
    sha256_tree,
    with_semantic_digest,
)
from forgeflow.common.settings import INFRA_DIR
from forgeflow.common.task import Task
from forgeflow.curation.candidates import INSTANCE_ID_PATTERN
from forgeflow.curation.freeze import verify_freeze
from forgeflow.sandbox.limits import SandboxLimits, VerifierTimeoutS

__all__ = [
    "HARBOR_VERSION",
    "HARBOR_TASK_SCHEMA_VERSION",
    "HARBOR_ENV_DIR",
    "HARBOR_ENV_IMPORT_PATH",
    "HARBOR_EXCEPTION_TYPES",
    "export_problem",
    "HarborTaskLimits",
    "HarborExport",
    "export_split",
    "render_task_toml",
    "render_test_sh",
    "render_grader",
    "map_harbor_exception",
]

HARBOR_VERSION = "0.25.0"
"""The Harbor release the formats here were read from (``scripts/harbor_venv.sh`` pins it)."""

HARBOR_TASK_SCHEMA_VERSION = "1.4"
"""``schema_version`` written to task.toml (``harbor.models.task.config.TaskConfig`` in 0.25.0)."""

EXPORT_SCHEMA_VERSION = 1
"""Version of ``forgeflow-export.json``."""

EXPORT_MANIFEST = "forgeflow-export.json"

HARBOR_ENV_DIR = INFRA_DIR / "harbor"
"""Folder to put on Harbor's ``PYTHONPATH`` for the environment class below."""

HARBOR_ENV_IMPORT_PATH = "forgeflow_harbor_env:ForgeflowPodmanEnvironment"
"""``harbor run -e`` value of forgeflow's podman environment (no-network tasks offline, with an
init and a short stop grace period): ``infra/harbor/forgeflow_harbor_env.py``."""

TESTBED = "/testbed"
VERIFIER_LOG = "/logs/verifier/test_output.log"
REWARD_FILE = "/logs/verifier/reward.txt"
"""Harbor reads the reward from ``/logs/verifier/reward.txt`` (or ``reward.json``)."""

_SOURCE_TAG = "forgeflow"

# --- exception taxonomy -----------------------------------------------------------------------
_MODEL_RETRYABLE = (
    "ApiError", "ApiRateLimitError", "ApiInternalServerError", "ApiOverloadedError",
    "ApiConnectionClosedError", "ApiResponseStalledError", "UnknownApiError",
    "NetworkConnectionError", "ApiConnectionError", "ApiUsageLimitError", "RateLimitError",
    "InternalServerError", "ServiceUnavailableError", "APIConnectionError", "APIError", "Timeout",
)
_MODEL_REJECTED = (
    "BadRequestError", "UnprocessableEntityError", "UnsupportedParamsError",
    "APIResponseValidationError", "BudgetExceededError", "AgentAuthenticationError",
    "ModelNotFoundError", "ApiProviderResourceNotFoundError", "AuthenticationError",
    "PermissionDeniedError", "NotFoundError",
)
_SANDBOX = (
    "EnvironmentStartTimeoutError", "AgentSetupTimeoutError", "HealthcheckError", "SSHAccessError",
    "GKEExecStreamClosedError", "GKEPodNotFoundError", "RuntimeRequestError", "AddTestsDirError",
    "DownloadVerifierDirError",
)

HARBOR_EXCEPTION_TYPES: Mapping[str, str] = {
    **{name: errors.ModelEndpointError.__name__ for name in _MODEL_RETRYABLE},
    **{name: errors.ModelRequestError.__name__ for name in _MODEL_REJECTED},
    **{name: errors.SandboxError.__name__ for name in _SANDBOX},
    "SandboxBuildFailedError": errors.ImageBuildError.__name__,
    "SandboxLikelyOutOfMemoryError": errors.SandboxOOMError.__name__,
    "MemoryLimitExceededError": errors.SandboxOOMError.__name__,
    "AgentTimeoutError": errors.AgentTimeoutError.__name__,
    "VerifierTimeoutError": errors.VerifierTimeoutError.__name__,
    "RewardFileNotFoundError": errors.VerifierOutputError.__name__,
    "RewardFileEmptyError": errors.VerifierOutputError.__name__,
    "VerifierOutputParseError": errors.VerifierOutputError.__name__,
}
"""Harbor exception type name -> forgeflow exception class name.

Built from Harbor 0.25.0's failure table (``harbor.models.trial.error_policy._POLICY_GROUPS``):
sandbox failures -> SandboxError (build -> ImageBuildError, memory -> SandboxOOMError), model
provider failures Harbor retries -> ModelEndpointError (transient), the others ->
ModelRequestError, timeouts and reward-file failures to forgeflow's verifier/agent errors. Any
other type (``NonZeroAgentExitCodeError``, ``CancelledError``, Harbor's own failures, an unknown
name) -> :class:`~forgeflow.common.errors.InfraError`. Not in the table on purpose: Harbor's "agent
outcome" types (:data:`HARBOR_AGENT_OUTCOMES`)."""

HARBOR_AGENT_OUTCOMES = frozenset({
    "ContextWindowExceededError", "OutputTokenExceededError", "ContextLengthExceededError",
    "OutputLengthExceededError", "AgentSafetyRefusalError", "ContentPolicyViolationError",
})
"""Harbor types whose reward Harbor treats as a valid measurement (``AGENT_EXHAUSTED_BUDGET`` /
``AGENT_REFUSED_TASK``, except the agent timeout): the model's outcome, as forgeflow's agent
treats a context-window overflow. With a verifier reward the trial is that reward and no
exception; without one it is an InfraError (nothing was measured)."""


def map_harbor_exception(harbor_type: str) -> str:
    """The forgeflow exception class name for a Harbor ``exception_type`` (see
    :data:`HARBOR_EXCEPTION_TYPES`; anything unlisted -> ``"InfraError"``)."""
    return HARBOR_EXCEPTION_TYPES.get(harbor_type, errors.InfraError.__name__)


# --- export ------------------------------------------------------------------------------------
def export_problem(task: Task) -> str | None:
    """Why ``task`` cannot be exported (``"<id>: ..."``), or None: its id must be a Harbor task folder name
    (``[A-Za-z0-9._-]``, <= 128 characters; Harbor's ``task_name``), it needs its ``patch`` (the Oracle reverts
    it), a FAIL_TO_PASS test, and a non-blank image (the Dockerfile is ``FROM`` it) and test command."""
    if len(task.instance_id) > 128 or not INSTANCE_ID_PATTERN.fullmatch(task.instance_id):
        return (f"{task.instance_id!r}: the instance id must use only letters, digits, '.', '_' and '-', start with a "
                "letter or digit and be at most 128 characters")
    missing = [name for name, value in (("patch", task.patch), ("FAIL_TO_PASS", task.FAIL_TO_PASS),
                                        ("image_ref", task.image_ref.strip()),
                                        ("test_command", task.test_command.strip())) if not value]
    return f"{task.instance_id}: no {', no '.join(missing)}" if missing else None


class HarborTaskLimits(SandboxLimits):
    """Timeouts and resources written to every exported task.toml (``memory_mb`` and ``cpus``: forgeflow's
    sandbox limits, :class:`~forgeflow.sandbox.limits.SandboxLimits`, as ``[environment] memory_mb`` / ``cpus``).

    Attributes:
        agent_timeout_s: ``[agent] timeout_sec``.
        verifier_timeout_s: ``[verifier] timeout_sec`` (one run of the tests).
        build_timeout_s: ``[environment] build_timeout_sec``.
    """

    model_config = ConfigDict(frozen=True)

    agent_timeout_s: float = Field(default=600.0, gt=0)
    verifier_timeout_s: VerifierTimeoutS = 600.0  # Harbor runs its own verifier: its task.toml default
    build_timeout_s: float = Field(default=600.0, gt=0)


class HarborExport(BaseModel):
    """A written export.

    Attributes:
        path: the dataset folder (``harbor run -p <path>``).
        freeze: the freeze name; freeze_semantic_sha256: its manifest digest.
        split: the exported split.
        instance_ids: the task folders, sorted.
        semantic_sha256: digest of ``forgeflow-export.json`` (without itself).
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    freeze: str
    freeze_semantic_sha256: str
    split: str
    instance_ids: list[str]
    semantic_sha256: str


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise errors.InputError(f"task.toml: cannot write a value of type {type(value).__name__}")


def render_task_toml(document: Mapping[str, Any]) -> str:
    """Render ``{key: scalar or list, section: {key: value}}`` as TOML and check it parses back.

    Raises:
        InputError: a value is not a str/int/float/bool/list of those, or the text does not
            parse back to ``document`` with :mod:`tomllib`.
    """
    lines = [f"{key} = {_toml_value(value)}" for key, value in document.items() if not isinstance(value, Mapping)]
    for section, body in document.items():
        if isinstance(body, Mapping):
            lines += ["", f"[{section}]", *(f"{key} = {_toml_value(value)}" for key, value in body.items())]
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != json.loads(json.dumps(document)):
        raise errors.InputError("task.toml: the rendered TOML does not parse back to its content")
    return text


def _task_toml(task: Task, limits: HarborTaskLimits, freeze: str, freeze_sha: str, split: str) -> str:
    metadata: dict[str, Any] = {
        "instance_id": task.instance_id, "source": _SOURCE_TAG, "freeze": freeze,
        "freeze_semantic_sha256": freeze_sha, "split": split, "image": task.image_ref,
        "forgeflow_version": forgeflow.__version__,
    }
    if task.repo:
        metadata["repo"] = task.repo
    cpus: int | float = int(limits.cpus) if float(limits.cpus).is_integer() else limits.cpus
    return render_task_toml({
        "schema_version": HARBOR_TASK_SCHEMA_VERSION,
        "metadata": metadata,
        "verifier": {"timeout_sec": float(limits.verifier_timeout_s)},
        "agent": {"timeout_sec": float(limits.agent_timeout_s)},
        "environment": {
            "build_timeout_sec": float(limits.build_timeout_s), "cpus": cpus, "memory_mb": limits.memory_mb,
            "network_mode": "no-network", "workdir": TESTBED,
        },
    })


def _test_files(test_ids: Iterable[str]) -> list[str]:
    """Test file paths of pytest node ids (``tests/test_x.py::test_a`` -> ``tests/test_x.py``),
    the same rule as :func:`forgeflow.sandbox.submission.test_files`."""
    return sorted({t.split("::", 1)[0] for t in test_ids if "::" in t and t.split("::", 1)[0].endswith(".py")})


def render_test_sh(task: Task) -> str:
    """The task's ``tests/test.sh``: reset the named test files to HEAD, run the test command in
    ``/testbed`` with its output in ``/logs/verifier/test_output.log``, then grade it with
    ``/tests/grade.py`` (which writes ``/logs/verifier/reward.txt``, or nothing for a log that is
    not pytest output). Exits with the grader's status."""
    files = " ".join(shlex.quote(path) for path in _test_files(task.graded_tests()))
    reset = (
        f'tracked=$(git ls-files -- {files})\n'
        'if [ -n "$tracked" ]; then git checkout HEAD -- $tracked; fi\n'
        if files else ""
    )
    return (
        "#!/bin/bash\n"
        f"# forgeflow verifier for {task.instance_id} (written by forgeflow.evaluation.harbor;\n"
        "# Harbor runs it as /tests/test.sh)\n"
        "set -u\n"
        "mkdir -p /logs/verifier\n"
        f"cd {TESTBED} || exit 1\n"
        "# pristine test files: the agent's edits to the tests do not count\n"
        f"{reset}"
        f"bash -c {shlex.quote(task.test_command)} > {VERIFIER_LOG} 2>&1\n"
        f'echo "test command exited $?" >&2\n'
        f"python3 /tests/grade.py {VERIFIER_LOG} /tests/config.json {REWARD_FILE}\n"
    )


_GRADER_TEMPLATE = '''\
#!/usr/bin/env python3
"""Grade a pytest -rA log for Harbor: write 1 or 0 to the reward file, or nothing if it is not pytest output.

Written by forgeflow.evaluation.harbor (forgeflow {forgeflow_version}). The parser below is the source of
swebench.harness.log_parsers.python.parse_log_pytest from swebench {swebench_version}; the rule
is SWE-bench's resolution with forgeflow's strict pass (forgeflow.sandbox.grading.grade_resolved): reward 1
iff every FAIL_TO_PASS and PASS_TO_PASS test is PASSED (a missing test counts as failed).

Usage: grade.py LOG CONFIG_JSON REWARD_FILE   (exit 0: graded; 2: not pytest output, no reward)
"""
from __future__ import annotations

import enum
import json
import re
import sys


class TestStatus(enum.Enum):
{statuses}


PASSING = {passing!r}
PYTEST_MARKERS = re.compile({markers!r})


{parser}

def main(log_path: str, config_path: str, reward_path: str) -> int:
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        log = handle.read()
    status = parse_log_pytest(log, None)
    if not status and (not log.strip() or PYTEST_MARKERS.search(log) is None):
        print("forgeflow grader: the test log is not pytest -rA output; no reward written", file=sys.stderr)
        print(log.strip()[-2000:], file=sys.stderr)
        return 2
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    tests = list(config["FAIL_TO_PASS"]) + list(config["PASS_TO_PASS"])
    not_passing = [test for test in tests if status.get(test) not in PASSING]
    reward = 0 if not_passing else 1
    for test in not_passing[:20]:
        print(f"not passing: {{test}} ({{status.get(test, 'missing')}})")
    print(f"reward {{reward}}: {{len(tests) - len(not_passing)}}/{{len(tests)}} FAIL_TO_PASS+PASS_TO_PASS tests pass")
    with open(reward_path, "w", encoding="utf-8") as handle:
        handle.write(f"{{reward}}\\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
'''


def render_grader() -> str:
    """The task's ``tests/grade.py`` (standalone, stdlib only, Python >= 3.7).

    It embeds, from the installed packages: SWE-bench's ``TestStatus`` values and the source of
    ``parse_log_pytest`` (swebench 4.1), forgeflow's passing statuses
    (:data:`forgeflow.sandbox.grading.PASSING`) and its "is this pytest output" markers.
    """
    import swebench
    from swebench.harness.constants import TestStatus
    from swebench.harness.log_parsers.python import parse_log_pytest

    from forgeflow.sandbox.grading import _PYTEST_MARKERS, PASSING

    return _GRADER_TEMPLATE.format(
        forgeflow_version=forgeflow.__version__,
        swebench_version=swebench.__version__,
        statuses="\n".join(f"    {member.name} = {member.value!r}" for member in TestStatus),
        passing=sorted(PASSING),
        markers=_PYTEST_MARKERS.pattern,
        parser=inspect.getsource(parse_log_pytest),
    )


def _solve_sh(task: Task) -> str:
    return (
        "#!/bin/bash\n"
        f"# Oracle of {task.instance_id} (written by forgeflow.evaluation.harbor):\n"
        "# revert the bug patch the task image holds\n"
        "set -euo pipefail\n"
        f"cd {TESTBED}\n"
        "git apply -R --whitespace=nowarn /solution/bug.patch\n"
    )


def _instruction(task: Task) -> str:
    if task.problem_statement is not None and task.problem_statement.strip():
        text = task.problem_statement
    else:
        from forgeflow.evaluation.agent import problem_statement_for

        text = problem_statement_for(task.patch or "", task.FAIL_TO_PASS)
    return text if text.endswith("\n") else text + "\n"


def _write_task(root: Path, task: Task, limits: HarborTaskLimits, freeze: str, freeze_sha: str,
                split: str, grader: str) -> None:
    folder = root / task.instance_id
    patch = task.patch or ""
    patch = patch if patch.endswith("\n") else patch + "\n"
    files: dict[str, tuple[str, int]] = {
        "task.toml": (_task_toml(task, limits, freeze, freeze_sha, split), 0o644),
        "instruction.md": (_instruction(task), 0o644),
        "environment/Dockerfile": (f"FROM {task.image_ref}\nWORKDIR {TESTBED}\n", 0o644),
        "tests/test.sh": (render_test_sh(task), 0o755),
        "tests/grade.py": (grader, 0o755),
        "tests/config.json": (
            json.dumps({"instance_id": task.instance_id, "FAIL_TO_PASS": list(task.FAIL_TO_PASS),
                        "PASS_TO_PASS": list(task.PASS_TO_PASS)}, indent=2) + "\n", 0o644),
        "solution/solve.sh": (_solve_sh(task), 0o755),
        "solution/bug.patch": (patch, 0o644),
    }
    for relative, (text, mode) in files.items():
        path = atomic_write_bytes(folder / relative, text.encode("utf-8"))
        os.chmod(path, mode)


def export_split(
    manifest_path: Path,
    split: str,
    tasks: Iterable[Task],
    out_dir: Path,
    limits: HarborTaskLimits | None = None,
) -> HarborExport:
    """Export one split of a freeze as a Harbor dataset folder (``harbor run -p out_dir``).

    The folder is built beside ``out_dir`` and renamed into place; the same content again is a no-op, an
    existing ``out_dir`` with other content is never overwritten.

    Raises:
        InputError: the manifest is missing/altered, the split is unknown or empty, a task of the split is
            missing from ``tasks`` (listed), given twice or not exportable (:func:`export_problem`), or ``out_dir``
            exists and is not this export.
    """
    manifest = verify_freeze(Path(manifest_path))
    if split not in manifest.splits:
        raise errors.InputError(f"freeze {manifest.name!r} has no split {split!r}; it has {sorted(manifest.splits)}")
    wanted = list(manifest.splits[split])
    if not wanted:
        raise errors.InputError(f"split {split!r} of freeze {manifest.name!r} is empty: nothing to export")
    by_id: dict[str, Task] = {}
    for task in tasks:
        if task.instance_id in by_id:
            raise errors.InputError(f"tasks: instance id {task.instance_id!r} is given twice")
        if (problem := export_problem(task)) is not None:
            raise errors.InputError(f"tasks: {problem}")
        by_id[task.instance_id] = task
    missing = [iid for iid in wanted if iid not in by_id]
    if missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise errors.InputError(
            f"tasks: {len(missing)} of the {len(wanted)} tasks of split {split!r} of freeze "
            f"{manifest.name!r} are missing: {shown}"
        )
    limits = limits or HarborTaskLimits()
    out_dir = Path(out_dir)
    grader = render_grader()
    staging = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex}.staging"
    try:
        for iid in wanted:
            _write_task(staging, by_id[iid], limits, manifest.name, manifest.semantic_sha256, split, grader)
        document = with_semantic_digest({
            "schema_version": EXPORT_SCHEMA_VERSION,
            "freeze": manifest.name,
            "freeze_semantic_sha256": manifest.semantic_sha256,
            "split": split,
            "harbor_version": HARBOR_VERSION,
            "harbor_task_schema_version": HARBOR_TASK_SCHEMA_VERSION,
            "limits": limits.model_dump(),
            "tasks": {iid: {"image": by_id[iid].image_ref, "tree_sha256": sha256_tree(staging / iid)}
                      for iid in wanted},
            "forgeflow_version": forgeflow.__version__,
        })
        atomic_write_bytes(staging / EXPORT_MANIFEST, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
        if out_dir.exists():
            return _existing_export(out_dir, document["semantic_sha256"])
        try:
            os.rename(staging, out_dir)
        except OSError:  # another writer got there first
            return _existing_export(out_dir, document["semantic_sha256"])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _export_record(out_dir, document)


def _export_record(path: Path, document: Mapping[str, Any]) -> HarborExport:
    return HarborExport(
        path=path, freeze=document["freeze"], freeze_semantic_sha256=document["freeze_semantic_sha256"],
        split=document["split"], instance_ids=sorted(document["tasks"]), semantic_sha256=document["semantic_sha256"],
    )


def _existing_export(out_dir: Path, new_digest: str) -> HarborExport:
    manifest = out_dir / EXPORT_MANIFEST
    if not manifest.is_file():
        raise errors.InputError(
            f"out_dir {out_dir} exists and is not a forgeflow Harbor export (no {EXPORT_MANIFEST}): "
            "choose a new folder"
        )
    document = read_digested_json(manifest, "Harbor export manifest", EXPORT_SCHEMA_VERSION)
    if document["semantic_sha256"] != new_digest:
        raise errors.InputError(
            f"out_dir {out_dir} holds another export (semantic_sha256 {document['semantic_sha256']}; "
            f"this one is {new_digest}); an export is never overwritten: choose a new folder"
        )
    return _export_record(out_dir, document)


