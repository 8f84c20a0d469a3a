"""SSD vs SpS on a real target + draft LM: hit rate, τ, tokens/s (real and simulated-overlap), batch 1 and b.

    python benchmarks/ssd_sweep.py drafter=DIR [target=smollm2] [n_prompts=6] [max_new_tokens=128]
        [batches=[1,4]] [gamma=4] [configs=[jit:8:1.0,fast:8:1.0]] [temperature=0] [threads=1]
        [executor=sequential] [bench=gsm_symbolic] [draft_vocab=0] [fork_vocab=full] [fanout=geometric]
        [out=runs/ssd_sweep]

``configs`` entries are ``fallback:B:C`` (fallback jit | fast | auto; B = cache budget per sequence; C = SAGUARO
scale). ``sps`` runs prompt by prompt (batch 1, its only mode) with the same γ; every SSD config runs the same
prompts in batches of each size. "tokens/s sim" is SSD's simulated-overlap rate from the sequential executor
(Σ max(t_verify, t_draft) per round in place of their sum): what a second device would give if transfers were free.
At temperature 0 each run's tokens are compared with sps's (they must be equal). ``fork_vocab`` (full | draft) and
``fanout`` (geometric | uniform | K+1 ints separated by commas inside quotes) are SSD's ``ssd_fork_vocab`` and
``ssd_fanout``; the teacher-forced recall behind the hit rate is ``benchmarks/ssd_recall.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from benchmarks.config import Bench, BenchConfig, DraftLM, Output, Seeded, Target, Workload, parse_bench, run_dir
from core.overrides import OverrideError
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_draft_lm, load_lm
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams


@dataclass
class SweepConfig(BenchConfig, Output, Target, DraftLM, Bench, Workload, Seeded):
    """``out``: a directory (default runs/ssd_sweep)."""

    batches: list[int] = field(default_factory=lambda: [1, 4])
    gamma: int = 4
    configs: list[str] = field(default_factory=lambda: ["jit:8:1.0", "fast:8:1.0"])
    temperature: float = 0.0
    executor: str = "sequential"
    fork_vocab: str = "full"  # SSD's fork guesses from the drafter's whole head (full) or its limited one (draft)
    fanout: str = "geometric"  # geometric | uniform | K+1 ints


USAGE = __doc__.splitlines()[2].strip()
OLD_SPELLINGS = {"n": "n_prompts"}


def parse_args(argv: list[str]) -> Any:
    cfg = parse_bench(argv, SweepConfig, USAGE, OLD_SPELLINGS)
    if not cfg.drafter:
        raise OverrideError(f"drafter=DIR (a draft LM) is required; usage: {USAGE}")
    return cfg


def run_sps(cfg, target, draft, prompts, eos, sampling) -> dict:
    sps = build_algorithm("sps", target.runner, draft.runner, gamma=cfg.gamma)
    sps.generate(prompts[0], max_new_tokens=8, sampling=sampling, eos_ids=eos)  # warm-up
    generator = torch.Generator().manual_seed(cfg.seed)
    outputs, tokens, forwards, start = [], 0, 0, time.perf_counter()
    for ids in prompts:
        result = sps.generate(
            ids, max_new_tokens=cfg.max_new_tokens, sampling=sampling, generator=generator, eos_ids=eos
        )
        outputs.append(result.tokens)
        tokens += result.stats.new_tokens
        forwards += result.stats.target_forwards
    wall = time.perf_counter() - start
    return {
        "algorithm": "sps",
        "batch": 1,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 3),
        "tau": round(tokens / forwards, 3),
        "outputs": outputs,
    }


def run_ssd(cfg, target, draft, prompts, eos, sampling, spec: str, batch: int) -> dict:
    fallback, budget, c = spec.split(":")
    ssd = build_algorithm(
        "ssd",
        target.runner,
        draft.runner,
        gamma=cfg.gamma,
        budget=int(budget),
        fallback=fallback,
        saguaro_c=float(c),
        executor=cfg.executor,
        seed=cfg.seed,
        max_batch_size=batch,
        fanout=cfg.fanout,
        fork_vocab=cfg.fork_vocab,
    )
    try:
        ssd.generate_batch(prompts[:batch], max_new_tokens=8, sampling=sampling, eos_ids=eos)  # warm-up
        ssd.extra_metrics()
        generator = torch.Generator().manual_seed(cfg.seed)
        outputs, tokens, forwards, start = [], 0, 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            for result in ssd.generate_batch(
                prompts[i : i + batch],
                max_new_tokens=cfg.max_new_tokens,
                sampling=sampling,
                generator=generator,
                eos_ids=eos,
            ):
                outputs.append(result.tokens)
                tokens += result.stats.new_tokens
                forwards += result.stats.target_forwards
        wall = time.perf_counter() - start
        metrics = ssd.extra_metrics()
    finally:
        ssd.close()
    return {
        "algorithm": f"ssd[{spec}]",
        "batch": batch,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 3),
        "tau": round(tokens / forwards, 3),
        "tokens_per_s_sim": metrics["simulated_tokens_per_s"],
        "outputs": outputs,
        **metrics,
    }


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    apply_threads(cfg)
    max_batch = max(cfg.batches)
    target = load_lm(cfg.target, device="cpu", max_seq_len=1024, max_batch_size=max_batch)
    draft = load_draft_lm(cfg.drafter, target, device="cpu", max_seq_len=1024, max_batch_size=max_batch)
    if cfg.draft_vocab:
        draft = dataclasses.replace(draft, runner=with_logit_vocab(draft.runner, cfg.draft_vocab))
    eos = eos_token_ids(target.tokenizer, target.model.config)
    prompts = [render_prompt(target.tokenizer, prompt_turns(c)) for c in load_prompts(cfg.bench, n=cfg.n_prompts)]
    sampling = SamplingParams(cfg.temperature)
    runs = [run_sps(cfg, target, draft, prompts, eos, sampling)]
    print(f"sps        b=1  tok/s={runs[0]['tokens_per_s']:.2f} tau={runs[0]['tau']:.2f}", flush=True)
    for batch in cfg.batches:
        for spec in cfg.configs:
            run = run_ssd(cfg, target, draft, prompts, eos, sampling, spec, batch)
            if cfg.temperature == 0:
                run["greedy_equal_to_sps"] = run["outputs"] == runs[0]["outputs"]
            runs.append(run)
            print(
                f"{run['algorithm']:10s} b={batch}  tok/s={run['tokens_per_s']:.2f} "
                f"sim={run['tokens_per_s_sim']} tau={run['tau']:.2f} hit={run['cache_hit_rate']} "
                f"by_k={run['cache_hit_rate_by_k']} bonus_hit={run['bonus_hit_rate']} "
                f"outside_vocab={run['cache_hits_outside_draft_vocab']}/{run['cache_lookups_outside_draft_vocab']} "
                f"fallbacks={run['fallback_counts']} idle={run['drafter_idle_s']}s "
                f"equal={run.get('greedy_equal_to_sps')}",
                flush=True,
            )
    for run in runs:
        run.pop("outputs")
    out = run_dir(cfg, "ssd_sweep")
    out.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg)
    (out / "results.json").write_text(json.dumps({"config": config, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
