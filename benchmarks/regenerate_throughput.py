"""``python -m benchmarks.regenerate_throughput [n_prompts=24] [max_new_tokens=128] [batch_sizes=[8,16,24]] [threads=1]
[dtype=auto|fp32|bf16] [bench=gsm_symbolic] [out=DIR]``

Batched regeneration (``inference.batched_generation``, what ``data_prep.regenerate`` runs) against one-prompt AR
(``inference.algorithms.ar``) on the same held-out prompts (GSM-symbolic unless ``bench``), in one process:
generated tokens/s, the ratio to AR, and how many answers equal AR's token for token (all of them on the exact
path, which covers batched CPU rows; on the approximate path a padded batch sums in another order, so a near-tie
may resolve differently).
Prompts are answered greedily up to ``max_new_tokens`` or EOS. ``out=DIR`` also writes ``DIR/results.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from benchmarks.config import Bench, BenchConfig, Dtype, Output, Target, Workload, parse_bench
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.batched_generation import ContinuousBatcher, Job
from inference.drafters import eos_token_ids, load_lm, model_dtype, serving_dtype
from inference.sampling import SamplingParams

USAGE = "python -m benchmarks.regenerate_throughput n_prompts=24 max_new_tokens=128 batch_sizes=[8,16,24] threads=1"


@dataclass
class ThroughputConfig(BenchConfig, Output, Target, Dtype, Bench, Workload):
    """``out``: a directory for results.json (optional)."""

    n_prompts: int = 24  # as many as the largest batch
    batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 24])
    exact: bool | None = None  # the runner's exact mode (default: on for CPU rows); false: the approximate path


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ThroughputConfig, USAGE)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    apply_threads(cfg)
    largest = max(cfg.batch_sizes)
    target = load_lm(
        cfg.target,
        device="cpu",
        max_seq_len=1024,
        max_batch_size=2 * largest,
        dtype=model_dtype(serving_dtype(cfg.dtype), "cpu"),
        exact=cfg.exact,
    )
    eos = eos_token_ids(target.tokenizer, target.model.config)
    prompts = [render_prompt(target.tokenizer, prompt_turns(c)) for c in load_prompts(cfg.bench, n=cfg.n_prompts)]
    greedy = SamplingParams(0.0)

    ar = build_algorithm("ar", target.runner)
    ar.generate(prompts[0], max_new_tokens=8, sampling=greedy)  # warm-up
    start = time.perf_counter()
    reference = [
        ar.generate(p, max_new_tokens=cfg.max_new_tokens, sampling=greedy, eos_ids=eos).tokens for p in prompts
    ]
    ar_s = time.perf_counter() - start
    ar_tokens = sum(len(t) for t in reference)
    rows = [("ar (one prompt at a time)", ar_tokens, ar_s, len(prompts))]
    for size in cfg.batch_sizes:
        queue = [Job(i, p, cfg.max_new_tokens) for i, p in enumerate(prompts)]
        answers: dict[int, list[int]] = {}
        batcher = ContinuousBatcher(target.runner, batch_size=size, eos_ids=eos, sampling=greedy)
        start = time.perf_counter()
        batcher.run(
            lambda q=queue: q.pop(0) if q else None, lambda job, tokens, a=answers: a.__setitem__(job.key, tokens)
        )
        seconds = time.perf_counter() - start
        same = sum(answers[i] == reference[i] for i in range(len(prompts)))
        rows.append((f"batched, {size} rows", batcher.new_tokens, seconds, same))
    dtype = str(target.runner.dtype).removeprefix("torch.")
    print(
        f"{cfg.n_prompts} held-out GSM-symbolic prompts, greedy, max_new_tokens={cfg.max_new_tokens}, "
        f"{cfg.threads} thread(s), target {cfg.target}, {dtype}; {target.runner.exactness.summary()}"
    )
    print("| mode | tokens | seconds | tokens/s | × AR | answers equal to AR's |")
    print("|---|---|---|---|---|---|")
    for name, tokens, seconds, same in rows:
        print(
            f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | {tokens / seconds / (ar_tokens / ar_s):.2f} "
            f"| {same}/{len(prompts)} |"
        )
    if cfg.out:
        results = {
            "config": OmegaConf.to_container(cfg, resolve=True),
            "dtype": dtype,
            "exactness": target.runner.exactness.as_dict(),
            "rows": [
                {
                    "mode": name,
                    "tokens": tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 2),
                    "x_ar": round(tokens / seconds / (ar_tokens / ar_s), 3),
                    "equal_to_ar": same,
                    "prompts": len(prompts),
                }
                for name, tokens, seconds, same in rows
            ],
        }
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
