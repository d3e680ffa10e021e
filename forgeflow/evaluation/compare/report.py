"""The markdown report of a paired comparison: pass rates with Wilson intervals, wins / ties /
losses, exact McNemar, the delta interval, excluded tasks with their reasons, cost ratios and the
promotion gate's verdict (:func:`render_markdown`). Statistics come from :mod:`.stats`."""

from __future__ import annotations

from collections.abc import Iterable

from forgeflow.evaluation.compare.gate import (
    Decision,
)
from forgeflow.evaluation.compare.stats import (
    CostComparison,
    JobReport,
    PairedComparison,
)


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _run_rows(report_a: JobReport, report_b: JobReport) -> list[tuple[str, str, str]]:
    """The per-run table's rows: (what, run A's value, run B's value)."""
    exception_types = sorted(set(report_a.exceptions_by_type) | set(report_b.exceptions_by_type))

    def interval(report: JobReport) -> str:
        return f"{_pct(report.wilson.low)} to {_pct(report.wilson.high)}"

    level = f"{100 * report_a.wilson.confidence:g}%"
    return [
        ("trials requested", str(report_a.requested), str(report_b.requested)),
        ("scored", str(report_a.scored), str(report_b.scored)),
        ("passed (reward 1)", str(report_a.reward_1), str(report_b.reward_1)),
        ("failed (reward 0)", str(report_a.reward_0), str(report_b.reward_0)),
        ("exceptions", str(report_a.exceptions), str(report_b.exceptions)),
        *(
            (("flagged: reward kept beside the exception (not scored)",
              f"{report_a.flagged} ({report_a.flagged_reward_1} passed)",
              f"{report_b.flagged} ({report_b.flagged_reward_1} passed)"),)
            if report_a.flagged or report_b.flagged
            else ()
        ),
        *(
            (
                f"exception: {name}",
                str(report_a.exceptions_by_type.get(name, 0)),
                str(report_b.exceptions_by_type.get(name, 0)),
            )
            for name in exception_types
        ),
        ("missing", str(report_a.missing), str(report_b.missing)),
        ("pass rate (scored)", _pct(report_a.pass_rate_scored), _pct(report_b.pass_rate_scored)),
        (f"Wilson {level} interval", interval(report_a), interval(report_b)),
        (
            "pass rate (all attempts)",
            _pct(report_a.pass_rate_attempts),
            _pct(report_b.pass_rate_attempts),
        ),
    ]


def _paired_lines(c: PairedComparison, label_a: str, label_b: str) -> list[str]:
    """The paired table, what wins and exclusions mean, and the delta interval's line."""
    lines = [
        "",
        f"### Paired on {c.n_pairs} instances scored in both runs",
        "",
        "| pairs | wins | ties | losses | "
        f"{label_a} pass rate | {label_b} pass rate | delta | McNemar exact p |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c.n_pairs} | {c.wins} | {c.ties} | {c.losses} | {_pct(c.pass_rate_a)} | "
        f"{_pct(c.pass_rate_b)} | {100 * c.delta:+.1f} pp | {c.mcnemar_p:.3g} |",
        "",
        f"Wins: {label_b} passed and {label_a} did not; losses: the reverse. "
        f"Excluded: {len(c.excluded_exception)} with an exception in either run, "
        f"{len(c.excluded_missing)} present in only one run.",
    ]
    if c.delta_interval is not None:
        ci = c.delta_interval
        nc, bs = ci.newcombe, ci.bootstrap
        lines += [
            "",
            f"Delta {100 * ci.confidence:g}% interval: {100 * ci.low:+.1f} pp to {100 * ci.high:+.1f} pp, the union "
            f"of Newcombe's hybrid score interval for paired proportions "
            f"{100 * nc.low:+.1f} to {100 * nc.high:+.1f} pp ({nc.source}) and a cluster bootstrap by "
            f"{bs.clustered_by} {100 * bs.low:+.1f} to {100 * bs.high:+.1f} pp "
            f"({ci.n_clusters} clusters, {bs.n_resamples} resamples, seed {bs.seed}; Field and Welsh 2007).",
        ]
        if bs.high - bs.low <= 0.0:
            lines[-1] += (" The bootstrap alone has zero width (too few clusters or no discordant pair); it is "
                          "never reported alone.")
    return lines


def render_markdown(
    report_a: JobReport,
    report_b: JobReport,
    comparison: PairedComparison,
    label_a: str = "A",
    label_b: str = "B",
    *,
    costs: CostComparison | None = None,
    decision: Decision | None = None,
    notes: Iterable[str] = (),
    plot_file: str | None = None,
) -> str:
    """A Markdown summary a person reads: per-run counts side by side, then the paired result.

    Args:
        notes: Lines printed under the title (e.g. what each run merges, the split checked).
    """
    lines = [f"## {label_b} vs {label_a}", ""]
    lines += [f"- {note}" for note in notes]
    lines += [""] if lines[-1] != "" else []
    lines += [f"| | {label_a} | {label_b} |", "|---|---:|---:|"]
    lines += [f"| {name} | {va} | {vb} |" for name, va, vb in _run_rows(report_a, report_b)]
    c = comparison
    lines += _paired_lines(c, label_a, label_b)
    if c.per_repo:
        lines += ["", "| repository | pairs | wins | ties | losses |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {repo} | {pc.n_pairs} | {pc.wins} | {pc.ties} | {pc.losses} |"
            for repo, pc in c.per_repo.items()
        ]
    if costs is not None:
        lines += ["", f"| cost (mean per paired trial) | {label_a} | {label_b} | ratio {label_b}/{label_a} |",
                  "|---|---:|---:|---:|"]
        for metric in (costs.input_tokens, costs.agent_steps, costs.wall_s):
            lines.append(
                f"| {metric.name} | {_num(metric.mean_a)} | {_num(metric.mean_b)} | {_num(metric.ratio)} |"
            )
    if decision is not None:
        lines += ["", f"**Promotion gate: {decision.verdict}** ({decision.reason})"]
        if decision.costs:
            lines += ["", "Cost limits (B / A): " + "; ".join(check.describe() for check in decision.costs) + "."]
    if plot_file is not None:
        lines += ["", f"![pass rates with Wilson intervals; wins and losses per repository]({plot_file})"]
    return "\n".join(lines) + "\n"
