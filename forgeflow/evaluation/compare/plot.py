"""The comparison's figure (matplotlib, Agg backend): pass rates with Wilson intervals of both jobs
and wins / losses per repository, written as a PNG (:func:`render_plot`)."""

from __future__ import annotations

from typing import Any

from forgeflow.evaluation.compare.stats import JobReport, PairCounts, PairedComparison


# --- plot ------------------------------------------------------------------------------------------
def render_plot(report_a: JobReport, report_b: JobReport, paired: PairedComparison, path: Any,
                label_a: str = "A", label_b: str = "B") -> Any:
    """Save a PNG and return its path: pass rates with Wilson intervals (left), wins / losses per repository (right)."""
    import io
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from forgeflow.common.fsutil import atomic_write_bytes

    fig = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    rates = [report_a.pass_rate_scored, report_b.pass_rate_scored]
    lows = [r - rep.wilson.low for r, rep in zip(rates, (report_a, report_b), strict=True)]
    highs = [rep.wilson.high - r for r, rep in zip(rates, (report_a, report_b), strict=True)]
    left.bar([0, 1], rates, yerr=[lows, highs], capsize=6, color=["#8c8c8c", "#3b7dd8"])
    left.set_xticks([0, 1], [f"{label_a}\n(n={report_a.scored})", f"{label_b}\n(n={report_b.scored})"])
    left.set_ylim(0, 1)
    left.set_ylabel("pass rate (scored trials)")
    left.set_title(f"pass rate, Wilson {100 * report_a.wilson.confidence:g}%")
    groups = paired.per_repo or {"all pairs": PairCounts(n_pairs=paired.n_pairs, wins=paired.wins,
                                                          ties=paired.ties, losses=paired.losses)}
    names = list(groups)
    xs = range(len(names))
    right.bar(xs, [groups[n].wins for n in names], color="#2e9e4f", label=f"wins ({label_b} only passed)")
    right.bar(xs, [-groups[n].losses for n in names], color="#d24b3e", label=f"losses ({label_a} only passed)")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    right.set_ylabel("pairs")
    right.set_title("wins / losses per repository")
    right.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    out = Path(path)
    atomic_write_bytes(out, buffer.getvalue())
    return out
