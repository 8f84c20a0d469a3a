"""The main job on the embedded default (``make demo``): extract → train → export → evaluate, on SmolLM2.

Every stage is one of the project's own commands (``inference.pipeline``), printed before it runs, so any stage
can be re-run by hand (or scaled up: the ``demo_*`` recipes are the ``*_smollm2`` recipes with fewer steps). A
stage whose output is complete is skipped, and re-running ``make demo`` after an interruption continues.

    python -m inference.demo [out=runs/demo] [n_prompts=3] [max_new_tokens=48] [stages=all|extract,...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference.algorithms import ALGORITHMS
from inference.pipeline import Stage, run_pipeline, select
from spectrain.atomic import check_output
from spectrain.overrides import parse_cli, run_cli

DEMO_RECIPE_STEPS = 40  # trainer.max_steps of the demo_draftlm / demo_eagle3 / demo_specblock recipes
# Self-Draft's small grid, the setting that beat AR in wall-clock on the 2-core CPU (BENCHMARKS.md, "Self-Draft")
SELF_DRAFT_CPU = ("self_draft@self_draft_L=3@self_draft_N=1@self_draft_candidates=2@self_draft_corpus_candidates=1"
                  "@self_draft_grid_vocab=8192")
USAGE = "python -m inference.demo out=runs/demo n_prompts=3 max_new_tokens=48 stages=all"


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    n_samples: int = 96  # ShareGPT conversations extracted for training
    n_val_samples: int = 12
    max_len: int = 192
    trace_prompts: int = 12  # prompts whose SpS rounds label the H-RAD classifier
    train_steps: int = 0  # optimizer steps of the draft LM, EAGLE-3 and SpecBlock runs; 0 = the demo_* recipes'
    bench: list[str] = field(default_factory=lambda: ["mt_bench"])
    n_prompts: int = 3
    max_new_tokens: int = 48
    stages: list[str] = field(default_factory=lambda: ["all"])


def build_stages(cfg: DemoConfig) -> list[Stage]:
    out = Path(cfg.out)
    feats, runs, exports = out / "features", out / "runs", out / "exports"
    extract = ("data_prep.extract", "target=smollm2", "source=sharegpt", "layers=eagle3", "dtype=bf16",
               f"max_len={cfg.max_len}", "batch_size=4")

    # Minutes per stage: measured on the 2-core CPU with one thread and another job running (a quiet machine is
    # faster); they scale with the settings that drive each stage's work.
    steps_n = cfg.train_steps or DEMO_RECIPE_STEPS
    algorithms = ["all", "sps@verifier=hsd", "sps@draft_vocab=8192", "specbranch@hrad=none", SELF_DRAFT_CPU]
    n_runs = (len(ALGORITHMS) + len(algorithms) - 1) * len(cfg.bench)  # "all" is every registered algorithm
    steps = () if not cfg.train_steps else (
        f"trainer.max_steps={cfg.train_steps}", f"trainer.val_check_interval={max(1, cfg.train_steps // 4)}",
        f"trainer.checkpoint_every_n_steps={max(1, cfg.train_steps // 4)}")

    def fit(recipe: str, *extra: str) -> tuple[str, ...]:
        return ("spectrain.fit", f"recipe={recipe}", f"runs_dir={runs}", "resume=auto",
                f"data.dataset_dir={feats / 'train'}", f"data.val_dataset_dir={feats / 'eval'}",
                f"data.max_len={cfg.max_len}", *steps, *extra)

    def last_ckpt(run_name: str) -> Path:
        return runs / run_name / "checkpoints" / "last.ckpt"

    def stage(name: str, minutes: float, what: str, argv: tuple[str, ...], output: Path) -> Stage:
        return Stage(name, minutes, what, argv, output, out / ".done" / name)

    stages = [
        stage("extract", 0.3 + 0.008 * cfg.n_samples, f"target hidden states of {cfg.n_samples} ShareGPT conversations (train split)",
              (*extract, "split=train", f"n_samples={cfg.n_samples}", f"out={feats / 'train'}"), feats / "train"),
        stage("extract-eval", 0.2 + 0.008 * cfg.n_val_samples, f"the same for {cfg.n_val_samples} held-out conversations (eval split)",
              (*extract, "split=eval", f"n_samples={cfg.n_val_samples}", f"out={feats / 'eval'}"), feats / "eval"),
        stage("ngram-corpus", 1.0, "Self-Draft's corpus n-gram cache from 4,000 ShareGPT conversations (train split)",
              ("data_prep.ngram_corpus", "target=smollm2", "source=sharegpt", "split=train", "n_samples=4000",
               f"out={out / 'ngram_corpus.pt'}"), out / "ngram_corpus.pt"),
        stage("train-draftlm", 0.7 + 0.05 * steps_n, "distil a 4-layer draft LM (layer-drop init, KL to the target)",
              fit("demo_draftlm"), last_ckpt("demo_draftlm")),
        stage("export-draftlm", 0.1, "export the draft LM as an HF directory the engine loads",
              ("spectrain.export", f"ckpt={last_ckpt('demo_draftlm')}", f"out={exports / 'draft_lm'}"),
              exports / "draft_lm"),
        stage("traces", 0.3 + 0.11 * cfg.trace_prompts, f"SpS acceptance traces of the draft LM on {cfg.trace_prompts} prompts (H-RAD labels)",
              ("data_prep.traces", "target=smollm2", f"drafter={exports / 'draft_lm'}", "source=sharegpt",
               "split=train", f"n_samples={cfg.trace_prompts}", "gamma=4", "max_new_tokens=48",
               f"out={out / 'traces'}"), out / "traces"),
        stage("train-hrad", 0.2, "train SpecBranch's H-RAD classifier on the traces (calibrated)",
              ("spectrain.fit", "recipe=demo_hrad", f"runs_dir={runs}", "resume=auto",
               f"data.dataset_dir={out / 'traces'}"), last_ckpt("demo_hrad")),
        stage("export-hrad", 0.1, "export H-RAD with its class boundaries, ε and temperature",
              ("spectrain.export", f"ckpt={last_ckpt('demo_hrad')}", f"out={exports / 'hrad'}"), exports / "hrad"),
        stage("train-eagle3", 0.7 + 0.035 * steps_n, "train the EAGLE-3 drafter (training-time test, reduced vocabulary)",
              fit("demo_eagle3"), last_ckpt("demo_eagle3")),
        stage("export-eagle3", 0.1, "export EAGLE-3 (native layout)",
              ("spectrain.export", f"ckpt={last_ckpt('demo_eagle3')}", "format=native", f"out={exports / 'eagle3'}"),
              exports / "eagle3"),
        stage("train-specblock", 0.7 + 0.11 * steps_n, "train the SpecBlock drafter on the same data and steps as EAGLE-3",
              fit("demo_specblock"), last_ckpt("demo_specblock")),
        stage("export-specblock", 0.1, "export SpecBlock (native layout)",
              ("spectrain.export", f"ckpt={last_ckpt('demo_specblock')}", "format=native",
               f"out={exports / 'specblock'}"), exports / "specblock"),
        stage("evaluate", 0.5 + 0.0036 * n_runs * cfg.n_prompts * cfg.max_new_tokens, f"every algorithm on {cfg.n_prompts} prompts of {', '.join(cfg.bench)} "
              "against AR in one run",
              ("inference.evaluate", "target=smollm2", f"drafters={exports}",
               f"algorithms=[{','.join(algorithms)}]", f"ngram_corpus={out / 'ngram_corpus.pt'}",
               f"bench=[{','.join(cfg.bench)}]", f"n_prompts={cfg.n_prompts}",
               f"max_new_tokens={cfg.max_new_tokens}", f"out={out / 'eval'}"), out / "eval"),
    ]
    return stages


def run_stages(cfg: DemoConfig) -> None:
    stages = select(build_stages(cfg), cfg.stages)
    print(f"[demo] output: {cfg.out}/", flush=True)
    ran = run_pipeline(stages, label="demo", rerun_hint="`make demo`")
    report = Path(cfg.out) / "eval" / "report.md"
    if report.is_file():
        if "evaluate" not in ran:  # a fresh evaluate stage has just printed the table itself
            print("\n" + report.read_text())
        print(f"[demo] results: {report.parent}/results.json, report.md and the PNGs next to them")


def _run(args: list[str]) -> None:
    cfg = parse_cli(args, DemoConfig, USAGE)
    check_output(cfg.out)
    run_stages(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, _run, doc=__doc__, schema=DemoConfig)


if __name__ == "__main__":
    sys.exit(main())
