"""Training samples from Oracle solutions, in mini-swe-agent's format (prompts read from the installed
config the canary runs, so they cannot drift apart).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from forgeflow.common.errors import PatchApplyError
from forgeflow.evaluation.agent import AgentConfig, problem_statement_for
from forgeflow.evaluation.mswea import mswea_templates

SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt"
"""The submit command of mini-swe-agent 2.x's ``swebench_backticks`` config (its instance template)."""


@lru_cache(maxsize=4)
def agent_templates(config_name: str = AgentConfig().config_name) -> dict[str, str]:
    """The system, instance and observation templates of the mini-swe-agent config the canary uses."""
    return mswea_templates(config_name)


def fix_patch(checkout_dir: Path, bug_patch: str, instance_id: str) -> str:
    """The patch that reverts ``bug_patch`` on the bugged tree (``git diff -R`` after applying it, on a copy).

    Raises:
        PatchApplyError: the bug patch does not apply to the checkout.
    """
    with tempfile.TemporaryDirectory(prefix="ff-fix-") as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(checkout_dir, work, symlinks=True)
        proc = subprocess.run(["git", "apply", "-"], input=bug_patch, text=True, cwd=work, capture_output=True)
        if proc.returncode != 0:
            raise PatchApplyError(f"bug patch of {instance_id} does not apply: {proc.stderr.strip()}")
        diff = subprocess.run(["git", "diff", "-R"], text=True, cwd=work, capture_output=True, check=True)
        return diff.stdout


def _observation(template: str, returncode: int, output: str) -> str:
    return jinja2.Template(template).render(output={"returncode": returncode, "output": output, "exception_info": ""})


def oracle_messages(problem_statement: str, fix: str) -> list[dict[str, str]]:
    """One Oracle conversation: system, instance, then fix, write patch and submit rounds."""
    templates = agent_templates()
    instance = jinja2.Template(templates["instance"]).render(task=problem_statement)
    fence = "```mswea_bash_command\n{}\n```"
    apply = f"cd /testbed && git apply <<'FORGEFLOW_EOF'\n{fix}FORGEFLOW_EOF"
    return [
        {"role": "system", "content": templates["system"]},
        {"role": "user", "content": instance},
        {"role": "assistant", "content": "THOUGHT: The failing tests point at this code; I restore the "
                                         "correct behaviour.\n\n" + fence.format(apply)},
        {"role": "user", "content": _observation(templates["observation"], 0, "")},
        {"role": "assistant", "content": "THOUGHT: I write the patch file.\n\n"
                                         + fence.format("cd /testbed && git diff -- . ':!patch.txt' > patch.txt")},
        {"role": "user", "content": _observation(templates["observation"], 0, "")},
        {"role": "assistant",
         "content": "THOUGHT: The fix is in patch.txt; I submit.\n\n" + fence.format(SUBMIT_COMMAND)},
    ]


def oracle_samples(tasks: list[tuple[Any, Path, list[str]]]) -> list[dict[str, Any]]:
    """SFT rows ``{"messages", "instance_id", "repo", "source": "oracle"}`` for accepted tasks, in input order.

    Args:
        tasks: (candidate with ``instance_id``/``repo``/``patch``, clean checkout dir, FAIL_TO_PASS).
    """
    rows = []
    for candidate, checkout, fail_to_pass in tasks:
        fix = fix_patch(checkout, candidate.patch, candidate.instance_id)
        problem = problem_statement_for(candidate.patch, fail_to_pass)
        rows.append({"messages": oracle_messages(problem, fix), "instance_id": candidate.instance_id,
                     "repo": candidate.repo, "source": "oracle"})
    return rows
