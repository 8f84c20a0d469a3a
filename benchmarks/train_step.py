"""``python -m benchmarks.train_step recipe=NAME|[A,B] [steps=6] [threads=1] [profile=false] [out=FILE.json] [key=value ...]``

Where a training step's time goes, for any recipe: builds the recipe's LightningModule and DataModule exactly as
``spectrain.fit`` does, then times ``steps`` training steps split into the batch (collation, which for online
features includes the target's forward) and the step (forward, backward, AdamW), after one warm-up step. Prints
seconds per step, trained (answer) tokens/s and the process's CPU seconds per step (on a shared machine the
fairer figure to compare: other jobs' load inflates wall time, not it); ``profile=true`` adds torch.profiler's top
operators of one step.
Any other ``key=value`` is a recipe override (``data.batch_size=8``, ``model.ttt_steps=5``, ...), applied to
each recipe named; ``out=`` writes ``{kind: seconds per step}`` as JSON (``benchmarks/drafter_quality.py`` sizes
SpecBlock's run to EAGLE-3's training wall time from it).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.config import BenchConfig, Output, parse_bench, split_own
from core.overrides import OverrideError
from inference.algorithms.options import apply_threads
from spectrain.fit import build_module_and_data, compose_recipe, import_kind_modules

USAGE = "python -m benchmarks.train_step recipe=NAME steps=6 threads=1 profile=false out=FILE [recipe overrides]"


@dataclass
class TrainStepConfig(BenchConfig, Output):
    """``out``: FILE.json (optional)."""

    steps: int = 6
    profile: bool = False


def parse_args(argv: Sequence[str]) -> tuple[Any, list[str], list[str]]:
    """The benchmark's own config, the recipes named (``recipe=NAME`` or ``recipe=[A,B]``) and the recipe overrides
    (every other ``key=value``)."""
    own, rest = split_own(argv, TrainStepConfig)
    named = [arg.split("=", 1)[1] for arg in rest if arg.startswith("recipe=")]
    if not named:
        raise OverrideError(f"recipe=NAME is required; usage: {USAGE}")
    recipes = [name.strip() for name in named[-1].strip("[]").split(",")]
    return parse_bench(own, TrainStepConfig, USAGE), recipes, [a for a in rest if not a.startswith("recipe=")]


def main(argv: list[str]) -> None:
    own, recipes, overrides = parse_args(argv)
    apply_threads(own)
    import_kind_modules()
    seconds = {}
    for recipe in recipes:
        cfg = compose_recipe([f"recipe={recipe}", *overrides])
        seconds[cfg.kind] = time_steps(cfg, own)
    if own.out:
        Path(own.out).parent.mkdir(parents=True, exist_ok=True)
        Path(own.out).write_text(json.dumps(seconds) + "\n")


def time_steps(cfg, own: TrainStepConfig) -> float:
    """Seconds per training step (batch + step) of a composed recipe; prints the table."""
    module, data = build_module_and_data(cfg)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    optimizer = module.configure_optimizers()["optimizer"]
    module.train()

    def one_step() -> tuple[float, float, int]:
        start = time.perf_counter()
        batch = next(batches)
        fetched = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed"):
            loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trained = int((batch["loss_mask"].bool() & batch["attention_mask"].bool()).sum())
        return fetched - start, time.perf_counter() - fetched, trained

    module.log = lambda *a, **k: None  # no Trainer attached: logging is a no-op here
    one_step()  # warm-up: first calls pay for allocation and kernel selection
    fetch_s = step_s = 0.0
    tokens = 0
    cpu_start = time.process_time()  # this process's CPU time: what a shared machine's load does not inflate
    for _ in range(own.steps):
        f, s, n = one_step()
        fetch_s, step_s, tokens = fetch_s + f, step_s + s, tokens + n
    cpu_per_step = (time.process_time() - cpu_start) / own.steps
    per_step = (fetch_s + step_s) / own.steps
    print(
        f"recipe={cfg.run_name} kind={cfg.kind} batch_size={cfg.data.batch_size} max_len={cfg.data.max_len} "
        f"threads={own.threads} steps={own.steps}"
    )
    print(
        "| s/step | batch (incl. online target forward) | forward+backward+optimizer | answer tokens/step | "
        "trained tokens/s | CPU s/step (this process) |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {per_step:.2f} | {fetch_s / own.steps:.2f} | {step_s / own.steps:.2f} | {tokens / own.steps:.0f} | "
        f"{tokens / (fetch_s + step_s):.0f} | {cpu_per_step:.2f} |"
    )
    if own.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    return per_step


if __name__ == "__main__":
    main(sys.argv[1:])
