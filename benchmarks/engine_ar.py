"""Engine AR vs transformers ``generate`` on SmolLM2: same prompts, same process, greedy.

    python benchmarks/engine_ar.py [target=smollm2] [bench=gsm_symbolic] [n_prompts=6] [max_new_tokens=128]
        [device=auto] [dtype=auto|fp32|bf16] [repeats=7] [threads=1]

Prints tokens/s of both and their ratio, and checks that both produced the same tokens. Timings on shared
machines are noisy: each configuration is run ``repeats`` times interleaved and the best run is kept.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.config import Bench, BenchConfig, Dtype, Repeats, SeqLen, Target, Workload, parse_bench
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_lm, model_dtype, pick_device, serving_dtype
from inference.sampling import SamplingParams

USAGE = "python benchmarks/engine_ar.py n_prompts=6 max_new_tokens=128 device=auto dtype=auto repeats=7 threads=1"


@dataclass
class EngineArConfig(BenchConfig, Target, Dtype, SeqLen, Bench, Workload, Repeats):
    device: str = "auto"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, EngineArConfig, USAGE)


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    apply_threads(cfg)
    dtype = model_dtype(serving_dtype(cfg.dtype), pick_device(cfg.device))
    target = load_lm(cfg.target, device=cfg.device, dtype=dtype, max_seq_len=cfg.max_seq_len)
    device = target.runner.device
    prompts = [render_prompt(target.tokenizer, prompt_turns(c)) for c in load_prompts(cfg.bench, n=cfg.n_prompts)]
    eos = eos_token_ids(target.tokenizer, target.model.config)
    ar = build_algorithm("ar", target.runner)
    greedy = SamplingParams(0.0)

    def engine() -> tuple[int, float, list]:
        tokens, wall, outs = 0, 0.0, []
        for ids in prompts:
            result = ar.generate(ids, max_new_tokens=cfg.max_new_tokens, sampling=greedy, eos_ids=eos)
            tokens, wall = tokens + result.stats.new_tokens, wall + result.stats.wall_s
            outs.append(result.tokens)
        return tokens, wall, outs

    def transformers_generate() -> tuple[int, float, list]:
        tokens, wall, outs = 0, 0.0, []
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            _sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                out = target.model.generate(
                    x, max_new_tokens=cfg.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
                )
            _sync(device)
            wall += time.perf_counter() - start
            new = out[0, len(ids) :].tolist()
            tokens += len(new)
            outs.append(new)
        return tokens, wall, outs

    # warm-up both paths once (allocations, kernel selection)
    ar.generate(prompts[0], max_new_tokens=8, sampling=greedy)
    target.model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=8, do_sample=False)
    best = {"engine": 0.0, "transformers": 0.0}
    outputs = {}
    for _ in range(cfg.repeats):
        for name, fn in (("engine", engine), ("transformers", transformers_generate)):
            tokens, wall, outs = fn()
            best[name] = max(best[name], tokens / wall)
            outputs[name] = outs
    same = outputs["engine"] == outputs["transformers"]
    print(
        f"device={device} dtype={cfg.dtype} prompts={len(prompts)} max_new_tokens={cfg.max_new_tokens} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"engine AR          : {best['engine']:.1f} tokens/s")
    print(f"transformers generate: {best['transformers']:.1f} tokens/s")
    print(f"ratio engine/transformers: {best['engine'] / best['transformers']:.2f}x   same tokens: {same}")
    if device.type == "cuda":
        weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
        print(
            f"weights: {weight_bytes / 1e9:.3f} GB; at B GB/s HBM the bandwidth bound is B/{weight_bytes / 1e9:.3f} "
            "tokens/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
