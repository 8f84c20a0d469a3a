"""Decision logging: one CSV row per query (every decision and reward), optional wandb, and the τ-over-queries PNG."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

FIELDS = [
    "query",
    "request",  # the engine's request key (online; empty in replay)
    "rows",
    "signal",
    "context",
    "tau",
    "tau_ema",
    "iter_ratio",
    "arm",
    "forced",
    "ucb_head",
    "ucb_full",
    "ucb_lora",
    "value_head",
    "value_full",
    "value_lora",
    "cost_head",
    "cost_full",
    "cost_lora",
    "prev_arm",
    "realised_dtau",
    "realised_reward",
    "update_s",
    "loss_before",
    "loss_after",
    "val_loss_before",
    "val_loss_after",
    "val_tau_before",
    "val_tau_after",
    "kept",
    "rolled_back",
    "check_loss_adapted",
    "check_loss_origin",
    "check_tau_adapted",
    "check_tau_origin",
    "check_s",
    "reset",
    "tau_none",
]


class DecisionLog:
    """Rows in memory; streamed to ``directory/decisions.csv`` (and wandb when ``wandb_project`` is set)."""

    def __init__(self, directory: str | Path | None = None, *, wandb_project: str | None = None):
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}  # columns a caller adds to the next rows (replay: the baseline τ)
        self.path = None if directory is None else Path(directory) / "decisions.csv"
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as f:
                csv.DictWriter(f, FIELDS).writeheader()
        self.run = None
        if wandb_project:
            import wandb  # wandb: a heavy import, deferred to first use

            self.run = wandb.init(project=wandb_project, job_type="adapt", reinit="finish_previous")

    def add(self, row: dict[str, Any]) -> None:
        row.update(self.extra)
        row = {key: row.get(key, "") for key in FIELDS}
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, FIELDS).writerow(_rounded(row))
        if self.run is not None:
            self.run.log({f"adapt/{k}": v for k, v in row.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}


ARM_STYLE = {"skip": ("o", "tab:gray"), "head": ("^", "tab:blue"), "full": ("s", "tab:red"), "lora": ("D", "tab:green")}


def plot_tau(rows: list[dict[str, Any]], path: str | Path, title: str = "τ over queries") -> Path:
    """PNG of τ per query with the chosen arm as marker (rolled-back updates crossed out)."""
    import matplotlib  # matplotlib: a heavy import, deferred to first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: a heavy import, deferred to first use

    fig, ax = plt.subplots(figsize=(8, 3.5))
    queries = [int(r["query"]) for r in rows]
    ax.plot(queries, [float(r["tau"]) for r in rows], color="black", lw=1, label="τ")
    ax.plot(queries, [float(r["tau_ema"]) for r in rows], color="tab:green", lw=1, ls="--", label="EMA τ")
    if all(r.get("tau_none") not in (None, "") for r in rows):
        ax.plot(
            queries,
            [float(r["tau_none"]) for r in rows],
            color="tab:orange",
            lw=1,
            ls=":",
            label="τ without adaptation",
        )
    for arm, (marker, color) in ARM_STYLE.items():
        picked = [r for r in rows if r["arm"] == arm]
        if picked:
            ax.scatter(
                [int(r["query"]) for r in picked],
                [float(r["tau"]) for r in picked],
                marker=marker,
                color=color,
                label=arm,
                zorder=3,
            )
    rejected = [r for r in rows if r.get("kept") in (False, "False")]
    if rejected:
        ax.scatter(
            [int(r["query"]) for r in rejected],
            [float(r["tau"]) for r in rejected],
            marker="+",
            color="tab:purple",
            s=80,
            label="update undone (validation)",
            zorder=4,
        )
    rolled = [r for r in rows if r["rolled_back"] in (True, "True", 1)]
    if rolled:
        ax.scatter(
            [int(r["query"]) for r in rolled],
            [float(r["tau"]) for r in rolled],
            marker="x",
            color="k",
            s=80,
            label="rollback",
            zorder=4,
        )
    reset = [r for r in rows if r.get("reset") in (True, "True", 1)]
    if reset:
        ax.scatter(
            [int(r["query"]) for r in reset],
            [float(r["tau"]) for r in reset],
            marker="*",
            color="tab:orange",
            s=90,
            label="back to the original (origin check)",
            zorder=4,
        )
    from matplotlib.ticker import MaxNLocator  # matplotlib: a heavy import, deferred to first use

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("query")
    ax.set_ylabel("τ (accept length per round)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
