"""Human-readable outputs of an evaluation: a markdown table and plots (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(results: dict[str, Any]) -> str:
    cfg = results.get("config", {})
    lines = [
        f"# Evaluation: target `{cfg.get('target')}`, drafter `{cfg.get('drafter')}`",
        "",
        f"temperature {cfg.get('temperature')}, max_new_tokens {cfg.get('max_new_tokens')}, "
        f"verifier {cfg.get('verifier')}, gamma {cfg.get('gamma')}, device {results.get('device')}",
        "",
        "| algorithm | bench | prompts | new tokens | τ (tokens/target fwd) | tokens/s | speedup vs AR "
        "| rollback rate | greedy = AR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        lines.append(
            f"| {run['algorithm']} | {run['bench']} | {run['n_prompts']} | {run['new_tokens']} | {_fmt(run['tau'])} "
            f"| {_fmt(run['tokens_per_s'], 1)} | {_fmt(run.get('speedup_vs_ar'))}× | {_fmt(run['rollback_rate'])} "
            f"| {_fmt(run.get('greedy_equal_to_ar'))} |"
        )
    return "\n".join(lines) + "\n"


def acceptance_plot(results: dict[str, Any], path: Path) -> None:
    """Per-position acceptance rate of every run that drafted anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plotted = 0
    for run in results["runs"]:
        rates = run.get("acceptance_by_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{run['algorithm']} / {run['bench']}")
            plotted += 1
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given the earlier positions were accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance" if plotted else "Per-position acceptance (no drafting algorithm ran)")
    if plotted:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
