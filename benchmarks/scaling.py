"""``python -m benchmarks.scaling runs=[DIR,...] [out=FILE.png] [extrapolate=[10,100]]``

How acceptance scales with training: for each training run directory (``runs/<run_name>/``, written by
``spectrain.fit``), the validation ``val/tau_sim`` against the answer tokens trained on so far (step × batch
size × the mean answer tokens per training sample, counted over the run's own training data). Fits
τ_sim = a + b · log10(tokens) per run by least squares, prints the points, the fit and its extrapolation to
``extrapolate`` × the largest budget (marked as an extrapolation), and draws them on a log axis.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Output, parse_bench
from core.assets import load_tokenizer
from core.overrides import OverrideError
from data_prep.samples import SampleBuilder, load_source
from inference.algorithms.options import apply_threads

USAGE = "python -m benchmarks.scaling runs=[runs/x/eagle3_smollm2_gsm,runs/x/specblock_smollm2_gsm] out=scaling.png"


@dataclass
class ScalingConfig(BenchConfig, Output):
    """``out``: FILE.png (optional)."""

    runs: list[str] = field(default_factory=list)
    extrapolate: list[float] = field(default_factory=lambda: [10.0, 100.0])


def validation_points(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/tau_sim) from every CSV log of a run (a resumed run has several), by step."""
    points: dict[int, float] = {}
    for log in sorted(run_dir.glob("logs/*/metrics.csv")):
        with open(log) as handle:
            for row in csv.DictReader(handle):
                if row.get("val/tau_sim"):
                    points[int(row["step"]) + 1] = float(row["val/tau_sim"])  # Lightning logs the 0-based step
    if not points:
        raise OverrideError(f"{run_dir} has no val/tau_sim in logs/*/metrics.csv; is it a spectrain.fit run dir?")
    return sorted(points.items())


def answer_tokens_per_sample(recipe) -> float:
    """Mean answer (loss-mask) tokens per training sample of a recipe's online data."""
    data = recipe.data
    tokenizer = load_tokenizer(recipe.target)
    build = SampleBuilder(tokenizer, data.max_len, window=data.window)
    conversations = load_source(data.source, min(data.n_samples, 400), recipe.seed, "train")
    counts = [sum(s.loss_mask) for i, c in enumerate(conversations) if (s := build(i, c)) is not None]
    return sum(counts) / max(len(counts), 1)


def run_series(run_dir: Path) -> tuple[str, list[int], np.ndarray, np.ndarray]:
    """(run name, validation steps, answer tokens trained on at each, val/tau_sim there) of one
    ``spectrain.fit`` run."""
    recipe = OmegaConf.load(run_dir / "recipe.yaml")
    per_step = recipe.data.batch_size * answer_tokens_per_sample(recipe)
    points = validation_points(run_dir)
    steps = [step for step, _ in points]
    return (
        recipe.run_name,
        steps,
        np.array([step * per_step for step in steps], dtype=float),
        np.array([t for _, t in points], dtype=float),
    )


def tau_at_tokens(tokens: np.ndarray, tau: np.ndarray, at: float) -> float | None:
    """val/tau_sim at ``at`` answer tokens, linear in log10(tokens) between the two validations around it; None
    outside the measured span (no extrapolation)."""
    if at < tokens.min() or at > tokens.max():
        return None
    return float(np.interp(math.log10(at), np.log10(tokens), tau))


def fit_log_linear(tokens: np.ndarray, tau: np.ndarray) -> tuple[float, float]:
    """(a, b) of τ = a + b · log10(tokens), least squares."""
    b, a = np.polyfit(np.log10(tokens), tau, 1)
    return float(a), float(b)


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ScalingConfig, USAGE)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    if not cfg.runs:
        raise OverrideError(f"runs=[DIR,...] is required; usage: {USAGE}")
    apply_threads(cfg)  # the answers' tokenization
    series = {}
    for run in cfg.runs:
        name, steps, tokens, tau = run_series(Path(run))
        series[name] = (tokens, tau, fit_log_linear(tokens, tau))
        print("| run | step | answer tokens trained | val τ_sim |")
        print("|---|---|---|---|")
        for step, t, value in zip(steps, tokens, tau):
            print(f"| {name} | {step} | {t:,.0f} | {value:.3f} |")
        print()
    print(
        "| run | fit τ = a + b·log10(tokens) | span measured | EXTRAPOLATED τ at "
        + " | ".join(f"{x:g}× the largest budget" for x in cfg.extrapolate)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(cfg.extrapolate))
    for name, (tokens, _, (a, b)) in series.items():
        guesses = [a + b * math.log10(tokens.max() * x) for x in cfg.extrapolate]
        print(
            f"| {name} | a = {a:.3f}, b = {b:.3f} | {tokens.min():,.0f}–{tokens.max():,.0f} ({tokens.max() / tokens.min():.0f}×) | "
            + " | ".join(f"{g:.2f}" for g in guesses)
            + " |"
        )
    if cfg.out:
        import matplotlib  # optional and slow to import: only when a plot is asked for

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, (tokens, tau, (a, b)) in series.items():
            line = ax.plot(tokens, tau, "o", label=f"{name} (measured)")[0]
            grid = np.logspace(math.log10(tokens.min()), math.log10(tokens.max() * max(cfg.extrapolate)), 50)
            ax.plot(
                grid,
                a + b * np.log10(grid),
                "--",
                color=line.get_color(),
                alpha=0.7,
                label=f"{name}: fit, extrapolated past {tokens.max():,.0f}",
            )
        ax.set_xscale("log")
        ax.set_xlabel("answer tokens trained on")
        ax.set_ylabel("val τ_sim (greedy, γ = 4)")
        ax.axhline(5.0, color="grey", lw=0.8, ls=":")  # τ_sim with γ = 4 cannot exceed 1 + γ
        ax.set_title("val τ_sim against training tokens (dashed: fit; past the points: extrapolated)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(cfg.out, dpi=120)
        print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
