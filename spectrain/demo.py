"""The main job on the embedded default (``make demo``): the target's own answers → train → export → evaluate.

SmolLM2 answers GSM-symbolic training prompts (``data_prep.regenerate``); the draft LM, EAGLE-3, SpecBlock,
DFlash and P-EAGLE learn to predict those answers (training on what the target says, not on ChatGPT's text, is what
makes drafters accepted), SpecBranch's H-RAD learns from the draft LM's acceptance traces, and one ``inference.evaluate`` run
compares all ten algorithms with AR on held-out GSM-symbolic prompts (seeds disjoint from the training prompts').
DFlash and P-EAGLE get a few minutes of training only: enough to serve them losslessly end to end, not to pay.
Every stage is one of the project's own commands (``spectrain.pipeline``), printed before it runs, so any stage
can be re-run by hand or scaled up (the ``demo_*`` recipes are the ``*_smollm2_gsm`` recipes with fewer steps;
``benchmarks/drafter_quality.py`` runs the full-size pipeline). A stage whose output is complete is skipped,
and re-running ``make demo`` after an interruption continues.

Each stage's announced minutes are its minutes on the reference machine scaled by this host's pace: a probe (the
target's forward over a training-sized batch and a few decode steps, one thread) timed before the first stage,
against the same probe on the reference machine; once stages have finished, the pace they ran at replaces it.

On a CPU with native bf16 the target runs in bf16, in exact mode (greedy output equals AR's token for
token) and verifying a few drafted tokens costs about one decode step, as on a GPU; elsewhere in fp32.

    python -m spectrain.demo [out=runs/demo] [n_samples=256] [n_prompts=4] [max_new_tokens=96] [stages=all|...]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.assets import load_model
from core.atomic import check_output
from core.overrides import parse_cli, run_cli
from inference.algorithms import ALGORITHMS
from inference.drafters import serving_dtype
from spectrain.pipeline import Stage, run_pipeline, select, stage_minutes
from inference.device import cpu_has_native_bf16

# trainer.max_steps of the demo_* training recipes
DEMO_RECIPE_STEPS = {"demo_draftlm": 240, "demo_eagle3": 60, "demo_specblock": 16, "demo_dflash": 16, "demo_peagle": 16}
# The reference machine, whose minutes the stages state: a 2-core AMD EPYC (Zen 3, family 25 model 1, no native
# bf16: fp32 throughout), shared with other jobs, 2026-11-28. Wall seconds per training step there (one thread,
# benchmarks.train_step; two trainings run side by side):
STEP_SECONDS = {
    "demo_draftlm": 12.3,
    "demo_eagle3": 23.0,
    "demo_specblock": 67.3,
    "demo_dflash": 20.4,
    "demo_peagle": 13.0,
}
REFERENCE_PROBE_SECONDS = 9.4  # probe_seconds("fp32") there
PROBE_BATCH = (2, 64)  # the forward of a small training batch: the regeneration's and trainings' throughput
PROBE_DECODE_STEPS = 16  # one-token decode steps: what evaluation and the traces mostly do
DRAFT_VOCAB = 8192  # the draft LM is trained on (and drafts from) the 8,192 lowest ids (draftlm_smollm2_gsm)
# Self-Draft's small grid, the setting that beat AR in wall-clock on the 2-core CPU (BENCHMARKS.md, "Self-Draft")
SELF_DRAFT_CPU = "self_draft@branch_len=3@branch_num=1@ctx_candidates=2@corpus_candidates=1@grid_vocab=8192"
# Beside every algorithm at its defaults: PEARL and SpecBranch drafting in a second process (the second core),
# Self-Draft's CPU grid, and EAGLE-3 / SpecBlock trees of 16 tokens (one cheap verification on a CPU).
VARIANTS = [
    "pearl@executor=multiprocess",
    "specbranch@executor=multiprocess",
    SELF_DRAFT_CPU,
    "eagle3_tree@tree_depth=5@tree_topk=4@tree_total=16",
    "specblock_tree@budget=16@width=4",
]
USAGE = "python -m spectrain.demo out=runs/demo n_samples=256 n_prompts=4 max_new_tokens=96 stages=all"


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    n_samples: int = 256  # GSM-symbolic training prompts the target answers (the drafters' training data)
    trace_prompts: int = 12  # prompts whose SpS rounds label the H-RAD classifier
    train_steps: int = 0  # optimizer steps of the draft LM, EAGLE-3 and SpecBlock runs; 0 = the demo_* recipes'
    bench: list[str] = field(default_factory=lambda: ["gsm_symbolic"])
    n_prompts: int = 4
    max_new_tokens: int = 96
    dtype: str = "auto"  # the target's dtype when serving; auto = bf16 on a CPU with native bf16, else fp32
    stages: list[str] = field(default_factory=lambda: ["all"])


def build_stages(cfg: DemoConfig) -> list[Stage]:
    out = Path(cfg.out)
    runs, exports, data = out / "runs", out / "exports", out / "regenerated.jsonl"
    dtype = serving_dtype(cfg.dtype)
    precision = "bf16-mixed" if cpu_has_native_bf16() else "32-true"
    n_runs = (len(ALGORITHMS) + len(VARIANTS)) * len(cfg.bench)  # "all" is every registered algorithm

    def steps(recipe: str) -> int:
        return cfg.train_steps or DEMO_RECIPE_STEPS[recipe]

    def fit(recipe: str) -> tuple[str, ...]:
        n = cfg.train_steps
        override = (
            ()
            if not n
            else (
                f"trainer.max_steps={n}",
                f"trainer.val_check_interval={max(1, n // 2)}",
                f"trainer.checkpoint_every_n_steps={max(1, n // 4)}",
            )
        )
        return (
            "spectrain.fit",
            f"recipe={recipe}",
            f"runs_dir={runs}",
            "resume=auto",
            f"data.source=jsonl:{data}",
            f"trainer.precision={precision}",
            *override,
        )

    def train_minutes(recipe: str) -> float:  # + loading, the vocabulary count and validations
        return 1.5 + steps(recipe) * STEP_SECONDS[recipe] / 60

    def last_ckpt(run_name: str) -> Path:
        return runs / run_name / "checkpoints" / "last.ckpt"

    def stage(name: str, minutes: float, what: str, argv: tuple[str, ...], output: Path, group: str = "") -> Stage:
        return Stage(name, minutes, what, argv, output, out / ".done" / name, group)

    # Minutes per stage on the reference machine, one thread per stage; they scale with the settings that drive
    # each stage's work.
    return [
        stage(
            "regenerate",
            0.5 + 0.1 * cfg.n_samples,
            f"the target's own ({dtype}) answers to {cfg.n_samples} GSM-symbolic training prompts, 24 side by side",
            (
                "data_prep.regenerate",
                "target=smollm2",
                "source=gsm_symbolic_train",
                f"n_samples={cfg.n_samples}",
                "max_len=512",
                "max_new_tokens=384",
                "batch_size=24",
                f"dtype={dtype}",
                f"out={data}",
            ),
            data,
            group="data",
        ),
        stage(
            "ngram-corpus",
            2.5,
            "Self-Draft's corpus n-gram cache from 4,000 ShareGPT conversations (train split)",
            (
                "data_prep.ngram_corpus",
                "target=smollm2",
                "source=sharegpt",
                "split=train",
                "n_samples=4000",
                f"out={out / 'ngram_corpus.pt'}",
            ),
            out / "ngram_corpus.pt",
            group="data",
        ),
        stage(
            "train-draftlm",
            train_minutes("demo_draftlm"),
            "a 4-layer draft LM (layer-drop init) learns the target's next tokens (cross-entropy, no target forward)",
            fit("demo_draftlm"),
            last_ckpt("demo_draftlm"),
            group="train",
        ),
        stage(
            "train-eagle3",
            train_minutes("demo_eagle3"),
            "EAGLE-3 (training-time test, 8,192-token draft vocabulary) on target features computed online",
            fit("demo_eagle3"),
            last_ckpt("demo_eagle3"),
            group="train",
        ),
        stage(
            "export-draftlm",
            0.4,
            "export the draft LM as an HF directory the engine loads",
            ("spectrain.export", f"ckpt={last_ckpt('demo_draftlm')}", f"out={exports / 'draft_lm'}"),
            exports / "draft_lm",
        ),
        stage(
            "traces",
            0.5 + 0.3 * cfg.trace_prompts,
            f"SpS acceptance traces of the draft LM on {cfg.trace_prompts} training prompts (H-RAD labels)",
            (
                "data_prep.traces",
                "target=smollm2",
                f"drafter={exports / 'draft_lm'}",
                f"source=jsonl:{data}",
                "split=train",
                f"n_samples={cfg.trace_prompts}",
                "gamma=4",
                "max_new_tokens=64",
                f"draft_vocab={DRAFT_VOCAB}",
                f"out={out / 'traces'}",
            ),
            out / "traces",
            group="last",
        ),
        stage(
            "train-specblock",
            train_minutes("demo_specblock"),
            "the SpecBlock block drafter (valid-prefix masking, rank head) on EAGLE-3's data",
            fit("demo_specblock"),
            last_ckpt("demo_specblock"),
            group="last",
        ),
        stage(
            "train-dflash",
            train_minutes("demo_dflash"),
            "DFlash (3 layers over 5 target layers, blocks of 8) on EAGLE-3's data, a few minutes",
            fit("demo_dflash"),
            last_ckpt("demo_dflash"),
            group="parallel",
        ),
        stage(
            "train-peagle",
            train_minutes("demo_peagle"),
            "P-EAGLE (EAGLE-3's drafter plus a mask token, 6 tokens per forward) on EAGLE-3's data, a few minutes",
            fit("demo_peagle"),
            last_ckpt("demo_peagle"),
            group="parallel",
        ),
        stage(
            "train-hrad",
            0.5,
            "train SpecBranch's H-RAD classifier on the traces (calibrated)",
            (
                "spectrain.fit",
                "recipe=demo_hrad",
                f"runs_dir={runs}",
                "resume=auto",
                f"data.dataset_dir={out / 'traces'}",
            ),
            last_ckpt("demo_hrad"),
        ),
        stage(
            "export-hrad",
            0.4,
            "export H-RAD with its class boundaries, ε and temperature",
            ("spectrain.export", f"ckpt={last_ckpt('demo_hrad')}", f"out={exports / 'hrad'}"),
            exports / "hrad",
        ),
        stage(
            "export-eagle3",
            0.4,
            "export EAGLE-3 (native layout)",
            ("spectrain.export", f"ckpt={last_ckpt('demo_eagle3')}", "format=native", f"out={exports / 'eagle3'}"),
            exports / "eagle3",
        ),
        stage(
            "export-eagle3-vllm",
            0.4,
            "export EAGLE-3 for vLLM (speculators layout; speculators.models."
            "Eagle3DraftModel.from_pretrained loads it as is)",
            (
                "spectrain.export",
                f"ckpt={exports / 'eagle3'}",
                "format=speculators",
                f"out={out / 'interop' / 'eagle3_speculators'}",
            ),
            out / "interop" / "eagle3_speculators",
        ),
        stage(
            "export-specblock",
            0.4,
            "export SpecBlock (native layout)",
            (
                "spectrain.export",
                f"ckpt={last_ckpt('demo_specblock')}",
                "format=native",
                f"out={exports / 'specblock'}",
            ),
            exports / "specblock",
        ),
        stage(
            "export-dflash",
            0.4,
            "export DFlash (native layout)",
            ("spectrain.export", f"ckpt={last_ckpt('demo_dflash')}", "format=native", f"out={exports / 'dflash'}"),
            exports / "dflash",
        ),
        stage(
            "export-peagle",
            0.4,
            "export P-EAGLE (native layout)",
            ("spectrain.export", f"ckpt={last_ckpt('demo_peagle')}", "format=native", f"out={exports / 'peagle'}"),
            exports / "peagle",
        ),
        stage(
            "evaluate",
            2.0 + 0.003 * n_runs * cfg.n_prompts * cfg.max_new_tokens,
            f"every algorithm on {cfg.n_prompts} held-out prompts of {', '.join(cfg.bench)} against AR in one run "
            f"({dtype}, one thread; the multiprocess variants draft on the second core)",
            (
                "inference.evaluate",
                "target=smollm2",
                f"drafters={exports}",
                f"algorithms=[all,{','.join(VARIANTS)}]",
                *(f"{name}.draft_vocab={DRAFT_VOCAB}" for name in ("sps", "pearl", "specbranch", "ssd")),
                f"self_draft.corpus={out / 'ngram_corpus.pt'}",
                f"bench=[{','.join(cfg.bench)}]",
                f"n_prompts={cfg.n_prompts}",
                f"max_new_tokens={cfg.max_new_tokens}",
                f"dtype={dtype}",
                "threads=1",
                f"out={out / 'eval'}",
            ),
            out / "eval",
        ),
    ]


def probe_seconds(dtype: str) -> float:
    """Seconds this host takes, on one thread, for a fixed sample of the demo's work on the target in ``dtype``: a
    forward of a small training batch and a few one-token decode steps (after one warm-up call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every stage runs
    try:
        model = load_model("smollm2", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        batch = torch.randint(100, 10000, PROBE_BATCH, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            model(batch[:, :16])  # warm-up: allocation and kernel selection
            start = time.perf_counter()
            model(batch)
            cache = model(batch[:1], use_cache=True).past_key_values
            token = batch[:1, -1:]
            for _ in range(PROBE_DECODE_STEPS):
                cache = model(token, past_key_values=cache, use_cache=True).past_key_values
            return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def host_pace(seconds: float) -> tuple[float, str]:
    """This host's minutes per reference minute from the probe's seconds, and a note saying so."""
    pace = seconds / REFERENCE_PROBE_SECONDS
    return pace, (
        f"pace probe {seconds:.1f} s against {REFERENCE_PROBE_SECONDS:.1f} s on the reference machine: "
        f"stage estimates x{pace:.2f}"
    )


def run_stages(cfg: DemoConfig) -> None:
    stages = select(build_stages(cfg), cfg.stages)
    print(f"[demo] output: {cfg.out}/", flush=True)
    pace, note = 1.0, ""
    if not all(s.done() for s in stages):
        pace, note = host_pace(probe_seconds(serving_dtype(cfg.dtype)))
    # One thread per stage: side-by-side stages then share the two cores instead of oversubscribing them.
    ran = run_pipeline(
        stages, label="demo", rerun_hint="`make demo`", env={"OMP_NUM_THREADS": "1"}, pace=pace, pace_note=note
    )
    timings = Path(cfg.out) / "stage_minutes.json"
    timings.write_text(json.dumps(stage_minutes(stages), indent=1) + "\n")
    print(f"[demo] stage minutes (reference, announced, measured): {timings}", flush=True)
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
