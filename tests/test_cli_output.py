"""What a newcomer reads from the ``forgeflow`` CLI: ``--help`` and the demo's closing summary.

``--help`` lists one short line per command and shows each docstring paragraph as prose that wraps at
the terminal's width (not at the source's line breaks); the summary's paths and sha256 digests stay
whole on a narrow pipe (a log, CI), so a copied path opens.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.common.settings import REPO_ROOT


def _commands(group, prefix=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


def test_help_lists_one_line_per_command_and_keeps_docstring_sentences_whole() -> None:
    runner = CliRunner()
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "110"})
    assert top.exit_code == 0, top.output
    panel = [line for line in top.output.split("Commands")[1].splitlines() if line.startswith("│")]
    rows = [line.strip("│ ") for line in panel]
    # each command's row is one line: no continuation row (a row that does not start with a command name)
    names = {path[0] for path, _ in _commands(typer.main.get_group(app))}
    assert all(row.split(" ")[0] in names for row in rows), "\n".join(panel)
    assert len(rows) == len(names)

    for path, command in _commands(typer.main.get_group(app)):
        doc = inspect.getdoc(command.callback)
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "1000"})
        assert out.exit_code == 0, out.output
        lines = [line.strip() for line in out.output.splitlines()]
        # every prose paragraph of the docstring is one line at a width that holds it
        for para in inspect.cleandoc(doc).split("\n\n"):
            if any(line.lstrip().startswith(("-", "*")) for line in para.splitlines()):
                continue
            prose = " ".join(line.strip() for line in para.splitlines())
            assert prose in lines, f"forgeflow {' '.join(path)} --help breaks the paragraph:\n{prose}\n{out.output}"


def test_demo_summary_keeps_paths_and_digests_whole_on_a_narrow_pipe(tmp_path: Path) -> None:
    deep = tmp_path / "a-results-folder-with-a-long-name" / "and-another-level" / "models"
    digest = "0123456789abcdef" * 4
    summary = {
        "stages": {"curate": {"status": "ok", "wall_s": 12.5, "counts": {"accepted": 9, "rejected": 3}}},
        "freeze": {"name": "demo-v1", "semantic_sha256": digest},
        "artifacts": {"gguf_q8_0": {"path": str(deep / "model-q8_0.gguf"), "sha256": digest},
                      "adapter": {"path": str(deep / "adapter" / "adapter_model.safetensors"), "sha256": digest}},
        "total_wall_s": 99.0,
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    # the CLI's own console (deployments.cli.app.console) in a process whose stdout is a pipe 60 columns wide
    env = {**os.environ, "COLUMNS": "60", "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    out = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                          "from deployments.cli.run import _print_summary; _print_summary(Path(sys.argv[1]))", str(path)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    for art in summary["artifacts"].values():
        line = next((line for line in lines if art["path"] in line), None)
        assert line is not None and line.split()[-1] == digest, f"{art['path']} not whole on one line:\n{out}"
        assert Path(line.split()[1]) == Path(art["path"])
    assert f"freeze demo-v1: semantic sha256 {digest}" in lines
    assert f"summary: {path}" in lines
