"""``python -m benchmarks.specblock_experiments [out=runs/specblock_experiments] [arms=all] [steps=60] ...``

What limits SpecBlock against EAGLE-3 at a small budget: short runs of the GSM drafter-quality recipes on the
same data, seed and steps, one arm per hypothesis, each ending in one validation (``val/acc_1`` .. ``acc_4``,
``val/tau_sim``; γ = 4 for both kinds):

* ``eagle3``: ``eagle3_smollm2_gsm`` (the reference);
* ``specblock``: ``specblock_smollm2_gsm`` as the reference trains it (K = 4, 2 layers, 3 blocks, slot and rank
  losses, ``model.valid_prefix=chain``);
* ``slot0``: one block, slot 0's draft loss only (``model.train_blocks=1 model.slot_weight=0
  model.rank_weight=0``): loss dilution removed, the depth kept;
* ``slot0_1layer``: that with one decoder layer (``model.num_layers=1``, so no layer-wise shift);
* ``identity``: ``model.init=identity`` (shift ``[I | 0]``, the fusion projection's condition block ``I``), chain;
* ``slot0_norm``: ``model.valid_prefix=slot0_norm`` (every slot's loss over slot 0's row count);
* ``valid``: ``model.valid_prefix=valid`` (no valid-prefix chain: every valid row counts at every slot).

Every arm is one ``python -m spectrain.fit`` stage (``spectrain.pipeline``: printed before it runs, skipped once
done, resumed after a kill), run one after the other on ``threads`` threads (one by default). The table is printed
at the end and written to ``OUT/results.md``; each arm's wall minutes are in its marker under ``OUT/.done/``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig, Output, Seeded, parse_bench, run_dir
from core.overrides import OverrideError, run_cli
from spectrain.pipeline import Stage, run_pipeline, select

USAGE = "python -m benchmarks.specblock_experiments out=runs/specblock_experiments arms=all steps=60"
SOURCE = "runs/drafter_quality/gsm/regenerated.jsonl"
METRICS = ("val/acc_1", "val/acc_2", "val/acc_3", "val/acc_4", "val/tau_sim")


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    overrides: tuple[str, ...]
    what: str
    minutes_per_step: float  # on the reference machine, one thread, bf16 autocast


ARMS = (
    Arm("eagle3", "eagle3_smollm2_gsm", (), "EAGLE-3 (6 TTT steps)", 0.05),
    Arm(
        "specblock",
        "specblock_smollm2_gsm",
        ("model.valid_prefix=chain",),
        "SpecBlock as the reference trains it (3 blocks, slot + rank losses)",
        0.22,
    ),
    Arm(
        "slot0",
        "specblock_smollm2_gsm",
        ("model.train_blocks=1", "model.slot_weight=0", "model.rank_weight=0"),
        "SpecBlock, one block, slot 0's loss only",
        0.1,
    ),
    Arm(
        "slot0_1layer",
        "specblock_smollm2_gsm",
        ("model.train_blocks=1", "model.slot_weight=0", "model.rank_weight=0", "model.num_layers=1"),
        "that with one layer (no shift)",
        0.07,
    ),
    Arm(
        "identity",
        "specblock_smollm2_gsm",
        ("model.init=identity", "model.valid_prefix=chain"),
        "SpecBlock, identity-style init (shift [I, 0], fusion condition block I)",
        0.22,
    ),
    Arm(
        "slot0_norm",
        "specblock_smollm2_gsm",
        ("model.valid_prefix=slot0_norm",),
        "SpecBlock, each slot's loss over slot 0's row count",
        0.22,
    ),
    Arm(
        "valid",
        "specblock_smollm2_gsm",
        ("model.valid_prefix=valid",),
        "SpecBlock, no valid-prefix chain (w = valid)",
        0.22,
    ),
)


@dataclass
class ExperimentsConfig(BenchConfig, Output, Seeded):
    """``out``: a directory (default runs/specblock_experiments); ``threads``: each arm's (one at a time)."""

    source: str = SOURCE  # a JSONL file of conversations (the GSM pipeline's regenerated answers)
    arms: list[str] = field(default_factory=lambda: ["all"])
    steps: int = 60
    n_val_samples: int = 16
    precision: str = "bf16-mixed"  # the GSM pipeline trains in bf16 autocast


def stages(cfg: ExperimentsConfig) -> list[Stage]:
    out = run_dir(cfg, "specblock_experiments")
    runs = out / "runs"
    common = (
        f"data.source=jsonl:{cfg.source}",
        f"trainer.precision={cfg.precision}",
        f"data.n_val_samples={cfg.n_val_samples}",
        f"seed={cfg.seed}",
        f"trainer.max_steps={cfg.steps}",
        f"trainer.val_check_interval={cfg.steps}",  # one validation, at the end
        f"trainer.checkpoint_every_n_steps={max(1, cfg.steps // 4)}",
    )
    return [
        Stage(
            arm.name,
            arm.minutes_per_step * cfg.steps,
            arm.what,
            (
                "spectrain.fit",
                f"recipe={arm.recipe}",
                f"run_name={arm.name}",
                f"runs_dir={runs}",
                "resume=auto",
                *common,
                *arm.overrides,
            ),
            runs / arm.name / "checkpoints" / "last.ckpt",
            out / ".done" / arm.name,
        )
        for arm in ARMS
    ]


def final_validation(run_dir: Path) -> dict[str, float]:
    """The metrics of the last validation in a run's CSV logs (a resumed run has several logs)."""
    best: tuple[int, dict[str, float]] | None = None
    for log in sorted(run_dir.glob("logs/*/metrics.csv")):
        with open(log) as handle:
            for row in csv.DictReader(handle):
                if not row.get("val/tau_sim"):
                    continue
                step = int(row["step"]) + 1  # Lightning logs the 0-based step
                values = {key: float(value) for key, value in row.items() if key.startswith("val/") and value}
                if best is None or step >= best[0]:
                    best = (step, {"step": float(step), **values})
    if best is None:
        raise OverrideError(f"{run_dir} has no validation in logs/*/metrics.csv; has its run finished?")
    return best[1]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def table(cfg: ExperimentsConfig) -> str:
    """Markdown table of every finished arm's final validation."""
    out = run_dir(cfg, "specblock_experiments")
    lines = [
        f"data: {cfg.source} (sha256 {sha256(Path(cfg.source))[:16]}), {cfg.steps} steps, seed {cfg.seed}, "
        f"{cfg.precision}, {cfg.n_val_samples} validation conversations",
        "",
        "| arm | what | acc_1 | acc_2 | acc_3 | acc_4 | τ_sim | τ_sim 2 blocks | step | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, stage in zip(ARMS, stages(cfg)):
        if not stage.done():
            lines.append(f"| {arm.name} | {arm.what} | not run | | | | | | | |")
            continue
        val = final_validation(out / "runs" / arm.name)
        cells = [f"{val[key]:.3f}" if key in val else "–" for key in (*METRICS, "val/tau_sim_2blocks")]
        minutes = stage.measured_minutes()
        lines.append(
            f"| {arm.name} | {arm.what} | {' | '.join(cells)} | {int(val['step'])} | "
            f"{'–' if minutes is None else f'{minutes:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def run(cfg: ExperimentsConfig) -> str:
    if cfg.steps < 1:
        raise OverrideError(f"steps={cfg.steps} must be >= 1")
    if not Path(cfg.source).is_file():
        raise OverrideError(
            f"source={cfg.source} is not a file; make it with python -m benchmarks.drafter_quality "
            "setting=gsm stages=[regenerate]"
        )
    todo = select(stages(cfg), cfg.arms)
    out = run_dir(cfg, "specblock_experiments")
    # one arm at a time, on cfg.threads threads: arms never share the machine with each other
    env = {"OMP_NUM_THREADS": str(cfg.threads)} if cfg.threads else {}
    run_pipeline(todo, label="specblock_experiments", rerun_hint="the same command", env=env)
    result = table(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(result)
    (out / "results.json").write_text(
        json.dumps(
            {
                arm.name: final_validation(out / "runs" / arm.name)
                for arm, stage in zip(ARMS, stages(cfg))
                if stage.done()
            },
            indent=2,
        )
        + "\n"
    )
    return result


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ExperimentsConfig, USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda args: run(parse_args(args)),
        doc=__doc__,
        schema=ExperimentsConfig,
        report=print,
    )


if __name__ == "__main__":
    sys.exit(main())
