"""Training samples from Oracle solutions, in mini-swe-agent's own conversation format.

An Oracle trajectory for a validated task is the conversation the agent *should* have had: the
system and instance prompts of mini-swe-agent's text-based config (read from the installed
package, so training and canary prompts cannot drift apart), then one assistant turn that applies
the fix (the reverse of the bug patch) in a ``mswea_bash_command`` fence, then the submit turn.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import lru_cache
import importlib.util
from pathlib import Path
from typing import Any

import jinja2
import yaml

from forgeflow.errors import PatchApplyError, ToolMissingError

SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent 2.x's submit command (config/mini_textbased.yaml)."""


@lru_cache(maxsize=1)
def agent_templates() -> dict[str, str]:
    """The ``system_template`` and ``instance_template`` of mini-swe-agent's text-based config."""
    spec = importlib.util.find_spec("minisweagent")  # locate without importing (its import prints a banner)
    if spec is None or spec.origin is None:
        raise ToolMissingError("mini-swe-agent is not installed (pip install mini-swe-agent==2.4.6)")
    text = (Path(spec.origin).parent / "config" / "mini_textbased.yaml").read_text()
    agent_cfg = yaml.safe_load(text)["agent"]
    return {"system": agent_cfg["system_template"], "instance": agent_cfg["instance_template"]}


def fix_patch(checkout_dir: Path, bug_patch: str, instance_id: str) -> str:
    """The patch that reverts ``bug_patch`` on the bugged tree (``git diff -R`` after applying it).

    Args:
        checkout_dir: a clean git checkout of the project (left untouched: work is on a copy).
        bug_patch: unified diff of the bug.
        instance_id: named in errors.

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


def oracle_messages(problem_statement: str, fix: str) -> list[dict[str, str]]:
    """One Oracle conversation: system, instance, the fix action, its observation, the submit."""
    templates = agent_templates()
    instance = jinja2.Template(templates["instance"]).render(task=problem_statement)
    action = (
        "THOUGHT: The failing tests point at this code; I restore the correct behaviour.\n\n"
        f"```mswea_bash_command\ncd /testbed && git apply <<'FORGEFLOW_EOF'\n{fix}FORGEFLOW_EOF\n```"
    )
    return [
        {"role": "system", "content": templates["system"]},
        {"role": "user", "content": instance},
        {"role": "assistant", "content": action},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\n</output>"},
        {"role": "assistant", "content": f"THOUGHT: The fix is applied.\n\n```mswea_bash_command\n{SUBMIT_COMMAND}\n```"},
    ]


def oracle_samples(tasks: list[tuple[Any, Path, list[str]]]) -> list[dict[str, Any]]:
    """SFT rows for accepted tasks.

    Args:
        tasks: (candidate with ``instance_id``/``repo``/``patch``, clean checkout dir, FAIL_TO_PASS).

    Returns:
        rows ``{"messages": [...], "instance_id": str, "repo": str, "source": "oracle"}``, in input order.
    """
    from forgeflow.agent import problem_statement_for

    rows = []
    for candidate, checkout, fail_to_pass in tasks:
        fix = fix_patch(checkout, candidate.patch, candidate.instance_id)
        problem = problem_statement_for(candidate.patch, fail_to_pass)
        rows.append({"messages": oracle_messages(problem, fix), "instance_id": candidate.instance_id,
                     "repo": candidate.repo, "source": "oracle"})
    return rows
