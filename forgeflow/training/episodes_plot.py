"""The agentic RL burst's figure: reward and turns per optimizer step (matplotlib, Agg canvas), as a PNG and as
markdown with the PNG inline (a ``data:`` URI, so the Prefect UI shows it with no file server).

The flow publishes it beside the ``rl-burst-episodes`` table (:func:`flows.training.rl_burst`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_write_bytes
from forgeflow.training.episodes_grpo import EpisodeStepStats


def episode_plot_png(stats: Sequence[EpisodeStepStats]) -> bytes:
    """Draw reward and turns per optimizer step as PNG bytes (about 30 KB, 8 x 3 inches at 80 dpi).

    Left: the mean reward of the scored episodes (0-1; a step with none scored is left out) and the fraction
    resolved of all episodes (exceptions count against it). Right: turns per episode, the mean and the longest.

    Args:
        stats: one :class:`~forgeflow.training.episodes_grpo.EpisodeStepStats` per step, in order.

    Returns:
        The PNG file's bytes.

    Raises:
        InputError: ``stats`` is empty.
    """
    if not stats:
        raise errors.InputError("no episode steps to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [s.step for s in stats]
    fig = Figure(figsize=(8, 3), dpi=80)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    scored = [(s.step, s.reward_mean) for s in stats if s.reward_mean is not None]
    if scored:
        left.plot([x for x, _ in scored], [y for _, y in scored], "o-", color="#3b7dd8", label="reward mean (scored)")
    left.plot(steps, [s.resolved / s.episodes if s.episodes else 0.0 for s in stats], "s--", color="#2e9e4f",
              label="resolved / episodes")
    left.set_ylim(-0.05, 1.05)
    left.set_xlabel("optimizer step")
    left.set_title("reward per step")
    left.legend(fontsize=7, loc="best")
    right.plot(steps, [s.turns / s.episodes if s.episodes else 0.0 for s in stats], "o-", color="#8c5bd8",
               label="turns / episode")
    right.plot(steps, [s.turns_max for s in stats], "^:", color="#d24b3e", label="longest episode")
    right.set_ylim(bottom=0)
    right.set_xlabel("optimizer step")
    right.set_title("turns per step")
    right.legend(fontsize=7, loc="best")
    for ax in (left, right):
        ax.set_xticks(steps)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def episode_plot_markdown(stats: Sequence[EpisodeStepStats], png_path: Path) -> str:
    """Write the figure (:func:`episode_plot_png`) to ``png_path`` atomically and return markdown showing it
    inline (a base64 ``data:image/png`` URI) with a line of totals and the file's path.

    Args:
        stats: one step's stats per optimizer step, in order.
        png_path: where the PNG goes (its folder is created).

    Returns:
        The markdown text.

    Raises:
        InputError: ``stats`` is empty.
    """
    png = episode_plot_png(stats)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(png_path, png)
    episodes = sum(s.episodes for s in stats)
    resolved = sum(s.resolved for s in stats)
    exceptions = sum(s.exceptions for s in stats)
    turns = sum(s.turns for s in stats)
    return (f"### Agentic RL: reward and turns per step\n\n"
            f"![reward and turns per step](data:image/png;base64,{base64.b64encode(png).decode('ascii')})\n\n"
            f"{len(stats)} step(s), {episodes} episode(s): {resolved} resolved, {exceptions} exception(s), "
            f"{turns} turn(s). Plot: `{png_path}`\n")
