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


def _exactness(results: dict[str, Any]) -> str:
    """The target runner's path and probe, and a warning naming every greedy row whose output left AR's: such a
    row is not lossless, whatever its speed."""
    info = results.get("exactness") or {}
    reason = f" ({info['reason']})" if info.get("reason") else ""  # why the path is not exact, where it is not
    line = f"{info.get('path', 'unknown')} path, probe {info.get('probe', 'not run')}{reason}; greedy output is " + (
        "bitwise AR's by construction" if info.get("bitwise") else "AR's only up to rounding"
    )
    differing = [
        f"{r['algorithm']} ({r['bench']})" for r in results.get("runs", []) if r.get("greedy_equal_to_ar") is False
    ]
    if differing:
        line += f". **Not lossless: greedy output differs from AR's in {', '.join(differing)}**"
    return line


def markdown_table(results: dict[str, Any]) -> str:
    cfg = results.get("config", {})
    sps = cfg.get("sps", cfg)  # SpS's options (a results file from before scoped options holds them at the top)
    lines = [
        f"# Evaluation: target `{cfg.get('target')}`, drafters `{_drafters(cfg)}`",
        "",
        f"temperature {cfg.get('temperature')}, max_new_tokens {cfg.get('max_new_tokens')}, "
        f"verifier {sps.get('verifier')}, gamma {sps.get('gamma')}, device {results.get('device')}"
        + (f", {results['dtype']}" if results.get("dtype") else ""),
        "",
        f"exactness: {_exactness(results)}",
        "",
        "| algorithm | bench | sampling | prompts | new tokens | τ (tokens/target fwd) | tokens/s | speedup vs AR "
        "| rollback rate | drafter fwd / target fwd | greedy = AR | simulated-overlap tokens/s | own figures |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        per_forward = run.get("draft_forwards", 0) / max(run.get("target_forwards", 0), 1)
        # a sampled run's tokens differ from AR's by design: say so rather than leave the equality blank
        greedy = "sampled" if run.get("temperature") else _fmt(run.get("greedy_equal_to_ar"))
        lines.append(
            f"| {run['algorithm']} | {run['bench']} | {_sampling(run, cfg)} | {run['n_prompts']} | {run['new_tokens']} "
            f"| {_fmt(run['tau'])} | {_fmt(run['tokens_per_s'], 1)} | {_fmt(run.get('speedup_vs_ar'))}× "
            f"| {_fmt(run['rollback_rate'])} | {_fmt(per_forward, 1)} | {greedy} "
            f"| {_fmt(run.get('simulated_tokens_per_s'), 1)} | {_own_figures(run)} |"
        )
    for name, why in (results.get("skipped") or {}).items():
        lines.append(f"\nskipped `{name}`: it {why}")
    return "\n".join(lines) + "\n"


def _sampling(run: dict[str, Any], cfg: dict[str, Any]) -> str:
    """``greedy`` or ``T=1 top-k 50 top-p 0.9 seed 3``, plus the run's max_new_tokens when a variant changed it."""
    if run.get("temperature") is None:  # a results.json from before runs recorded their settings
        return "–"
    parts = ["greedy"] if run["temperature"] == 0 else [f"T={run['temperature']:g}"]
    if run["temperature"]:
        parts += [f"top-k {run['top_k']}"] if run.get("top_k") else []
        parts += [f"top-p {run['top_p']:g}"] if run.get("top_p", 1.0) < 1.0 else []
        parts.append(f"seed {run.get('seed')}")
    if run.get("max_new_tokens") not in (None, cfg.get("max_new_tokens")):
        parts.append(f"max {run['max_new_tokens']} new")
    return " ".join(parts)


OWN_FIGURES = {  # results.json key -> its label in the table (only the runs that report it)
    "cache_hit_rate": "cache hit rate",
    "rollback_rate_speculated": "rollback (speculated)",
    "executor": "executor",
}


def _own_figures(run: dict[str, Any]) -> str:
    shown = [f"{label} {_fmt(run[key])}" for key, label in OWN_FIGURES.items() if run.get(key) is not None]
    return "; ".join(shown) or "–"


def _drafters(cfg: dict[str, Any]) -> str:
    named = [f"{k}={cfg[k]}" for k in ("drafters", "drafter") if cfg.get(k) not in (None, "auto", "none")]
    named += [f"drafter.{kind}={path}" for kind, path in (cfg.get("drafter_by_kind") or {}).items()]
    hrad = (cfg.get("specbranch") or {}).get("hrad", cfg.get("hrad"))  # SpecBranch's option (a top-level key before)
    if hrad not in (None, "auto", "none"):
        named.append(f"specbranch.hrad={hrad}")
    return ", ".join(named) or "none"


def acceptance_plot(results: dict[str, Any], path: Path) -> None:
    """Per-position acceptance rate of every run that drafted anything."""
    plt, fig, ax = _axes()
    plotted = 0
    for run in results["runs"]:
        rates = run.get("acceptance_by_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{run['algorithm']} / {run['bench']}")
            plotted += 1
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier positions accepted)")
    ax.set_ylim(0, 1.05)
    _finish(plt, fig, ax, path, "Per-position acceptance", plotted)


def _finish(plt, fig, ax, path: Path, title: str, plotted: int) -> None:
    ax.set_title(title if plotted else f"{title} (no drafting algorithm ran)")
    if plotted:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _axes(figsize=(6, 4)):
    import matplotlib  # matplotlib: a heavy import, deferred to first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: a heavy import, deferred to first use

    return plt, *plt.subplots(figsize=figsize)


def speedup_plot(results: dict[str, Any], path: Path) -> None:
    """Speedup over AR (same run) per algorithm, one bar group per bench."""
    import numpy as np  # numpy: a heavy import, deferred to first use

    plt, fig, ax = _axes((7, 4))
    runs = [r for r in results["runs"] if r["algorithm"] != "ar"]
    benches = list(dict.fromkeys(r["bench"] for r in runs))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in runs))
    width = 0.8 / max(len(benches), 1)
    for j, bench in enumerate(benches):
        values = [
            next((r.get("speedup_vs_ar") or 0.0 for r in runs if r["algorithm"] == a and r["bench"] == bench), 0.0)
            for a in algorithms
        ]
        ax.bar(np.arange(len(algorithms)) + j * width, values, width, label=bench)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(np.arange(len(algorithms)) + width * (len(benches) - 1) / 2, algorithms, rotation=30, ha="right")
    ax.set_ylabel("tokens/s ÷ AR tokens/s (same run)")
    ax.set_title("Speedup over autoregressive decoding" if runs else "Speedup (only AR ran)")
    if benches:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tau_distribution_plot(results: dict[str, Any], path: Path) -> None:
    """Distribution of tokens emitted per verification round (accepted drafted tokens + 1) per algorithm."""
    plt, fig, ax = _axes((6, 4))
    merged: dict[str, list[int]] = {}
    for run in results["runs"]:
        hist = merged.setdefault(run["algorithm"], [])
        for n, rounds in enumerate(run.get("accepted_hist") or []):
            hist.extend([0] * (n + 1 - len(hist)))
            hist[n] += rounds
    plotted = 0
    for name, hist in merged.items():
        total = sum(hist)
        if total:
            ax.plot(range(1, len(hist) + 1), [h / total for h in hist], marker="o", label=name)
            plotted += 1
    ax.set_xlabel("tokens emitted in one verification round")
    ax.set_ylabel("fraction of rounds")
    _finish(plt, fig, ax, path, "Tokens per target forward", plotted)
