"""``python benchmarks/self_draft_sweep.py [grid=[[4,2],[5,3],[6,6]]] [candidates=[10]] [bench=gsm_symbolic] ...``

Self-Draft against ``ar`` on SmolLM2 over a small (L, N) grid: τ (tokens per target forward, prefill and
warm-up included), tokens/s, and the tokens/s ratio to ``ar`` measured in the same run. Prompts are the outer
loop and the algorithms the inner one, so load drift on a shared machine hits every setting alike.
Each setting is a fresh algorithm instance whose context cache then carries over from prompt to prompt, as in
``inference.evaluate``. Greedy outputs are checked against ``ar``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.config import Bench, BenchConfig, SeqLen, Target, Workload, parse_bench
from core.assets import tokenizer_fingerprint
from core.overrides import OverrideError
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_lm
from inference.evaluate import load_bench_prompts
from inference.ngram_cache import CorpusCache
from inference.sampling import SamplingParams

USAGE = (
    "python benchmarks/self_draft_sweep.py target=smollm2 bench=humaneval n_prompts=3 max_new_tokens=96 "
    "grid=[[4,2],[5,3]] candidates=[4,10] ngram_corpus=FILE corpus_candidates=3 grid_vocab=0 threads=1"
)


@dataclass
class SweepConfig(BenchConfig, Target, SeqLen, Bench, Workload):
    grid: list[list[int]] = field(default_factory=lambda: [[4, 2], [5, 3], [6, 6]])  # [L, N] pairs
    candidates: list[int] = field(default_factory=lambda: [10])  # context-cache candidates per step
    corpus_candidates: int = 3  # corpus-cache candidates per step (with ngram_corpus)
    grid_vocab: int = 0  # grid argmax over the K lowest ids + the text's tokens; 0 = full vocabulary
    ngram_corpus: str | None = None
    forward_cost: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 24, 32, 48])  # [] = skip


def settings(cfg) -> dict[str, dict]:
    out = {}
    for pair in cfg.grid:
        if len(pair) != 2:
            raise OverrideError(f"grid entries are [L, N] pairs, got {list(pair)}")
        for candidates in cfg.candidates:
            out[f"self_draft L={pair[0]} N={pair[1]} ctx={candidates}"] = {
                "branch_len": int(pair[0]),
                "branch_num": int(pair[1]),
                "ctx_candidates": int(candidates),
                "corpus_candidates": cfg.corpus_candidates,
                "grid_vocab": cfg.grid_vocab,
            }
    return out


def forward_costs(runner, sizes: Sequence[int], cached: int = 300, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one forward of T new tokens (tree-masked, as Self-Draft runs them) over ``cached``
    cached tokens: what a step costs against AR's T = 1, whatever the acceptance."""
    runner.reset(1)
    runner.forward(torch.randint(0, 1000, (1, cached)), only_last_logits=True)
    costs = {}
    for size in sizes:
        mask = torch.ones(size, size, dtype=torch.bool).tril()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(torch.randint(0, 1000, (1, size)), attention_mask=mask if size > 1 else None)
            times.append(time.perf_counter() - start)
            runner.truncate(cached)
        costs[size] = sorted(times)[repeats // 2]
    return costs


def sweep(cfg) -> tuple[list[dict], dict[int, float]]:
    apply_threads(cfg)
    target = load_lm(cfg.target, device="cpu", max_seq_len=cfg.max_seq_len)
    corpus = None
    if cfg.ngram_corpus:
        corpus = CorpusCache.load(cfg.ngram_corpus, tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer))
    eos = eos_token_ids(target.tokenizer, target.model.config)
    prompts = load_bench_prompts(cfg.bench, target.tokenizer, cfg.n_prompts).ids
    algorithms = {"ar": build_algorithm("ar", target.runner)}
    for name, options in settings(cfg).items():
        algorithms[name] = build_algorithm("self_draft", target.runner, corpus=corpus, **options)
    greedy = SamplingParams(temperature=0)
    for algorithm in algorithms.values():  # allocation and kernel selection out of the timings
        algorithm.generate(prompts[0], max_new_tokens=4, sampling=greedy, eos_ids=eos)

    totals = {name: {"tokens": 0, "forwards": 0, "wall_s": 0.0, "equal": True} for name in algorithms}
    for index, prompt in enumerate(prompts):
        reference = None
        for name, algorithm in algorithms.items():
            result = algorithm.generate(prompt, max_new_tokens=cfg.max_new_tokens, sampling=greedy, eos_ids=eos)
            reference = result.tokens if name == "ar" else reference
            row = totals[name]
            row["tokens"] += result.stats.new_tokens
            row["forwards"] += result.stats.target_forwards
            row["wall_s"] += result.stats.wall_s
            row["equal"] &= result.tokens == reference
            print(
                f"prompt {index}: {name}: {result.stats.new_tokens} tokens, tau {result.stats.tau:.2f}, "
                f"{result.stats.tokens_per_s:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    costs = forward_costs(target.runner, cfg.forward_cost) if cfg.forward_cost else {}
    ar_rate = totals["ar"]["tokens"] / totals["ar"]["wall_s"]
    rows = []
    for name, row in totals.items():
        rate = row["tokens"] / row["wall_s"]
        rows.append(
            {
                "setting": name,
                "tau": row["tokens"] / row["forwards"],
                "tokens_per_s": rate,
                "ratio_vs_ar": rate / ar_rate,
                "greedy_equal_to_ar": row["equal"],
                **row,
            }
        )
    return rows, costs


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, SweepConfig, USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        cfg = parse_args(argv)
        settings(cfg)
        rows, costs = sweep(cfg)
    except (OverrideError, ValueError) as exc:
        if os.environ.get("SPECTRAIN_DEBUG"):
            raise
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(
        f"\n{cfg.bench}, {cfg.n_prompts} prompts x {cfg.max_new_tokens} new tokens, greedy, CPU, "
        f"{torch.get_num_threads()} threads, corpus {cfg.ngram_corpus or 'none'}\n"
    )
    print("| setting | τ (tokens/forward) | tokens/s | ratio vs ar | greedy = ar |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setting']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | {row['ratio_vs_ar']:.2f} "
            f"| {'yes' if row['greedy_equal_to_ar'] else 'NO'} |"
        )
    if costs:
        print(
            "\nforward cost vs new tokens T (300 cached, median): "
            + ", ".join(f"T={t}: {1000 * c:.0f} ms ({c / costs[min(costs)]:.2f}x)" for t, c in costs.items())
        )
    return 0 if all(row["greedy_equal_to_ar"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
