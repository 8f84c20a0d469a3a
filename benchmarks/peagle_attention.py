"""``python benchmarks/peagle_attention.py [length=640] [answer=0.6] [num_depths=6] [chunks=[16,32,64,128,256]] [threads=1] [repeats=7]``

Why P-EAGLE trains with chunked chain attention on a CPU (``core.drafters.peagle.attention``): milliseconds for one
forward + backward of one layer's attention with SmolLM2-135M's head shapes (9 heads, 3 KV heads, head dim 64),
batch 1, over every position's depth-0 row plus the chain rows COD draws (speculators' ratios 0.7 / 0.2) when the
last ``answer`` share of the sequence is scored: under the dense mask [T + N, T + N] restricted to the chain rows'
queries (the depth-0 rows are one causal attention in both) and chunked with several chain rows per chunk. Also
prints the share of the dense chain mask's entries each computes. Compare the rows of one run only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.config import BenchConfig, Repeats, parse_bench
from core.drafters.peagle.attention import ChainLayout
from inference.algorithms.options import apply_threads
from spectrain.kinds.peagle.losses import cod_sample

USAGE = (
    "python benchmarks/peagle_attention.py length=640 answer=0.6 num_depths=6 chunks=[16,32,64,128,256] "
    "threads=1 repeats=7"
)


@dataclass
class ChainBenchConfig(BenchConfig, Repeats):
    length: int = 640
    answer: float = 0.6  # the scored share of the sequence (its end)
    num_depths: int = 6
    chunks: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])


def _step_ms(tensors: list[torch.Tensor], layout: ChainLayout, repeats: int) -> float:
    """Median ms of one forward + backward of the attention alone (the masks built inside, once per step)."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        layout._masks.clear()
        start = time.perf_counter()
        layout.attend(*tensors).square().mean().backward()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def run(cfg: ChainBenchConfig) -> None:
    apply_threads(cfg)
    torch.manual_seed(0)
    scored = torch.zeros(cfg.length, dtype=torch.bool)
    scored[int(cfg.length * (1 - cfg.answer)) : cfg.length - 2] = True
    anchors, depths = cod_sample(scored, cfg.num_depths, 0.7, 0.2, None, torch.Generator().manual_seed(0))
    rows = cfg.length + len(anchors)
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2-135M
    tensors = [torch.randn(1, h, rows, head_dim, requires_grad=True) for h in (heads, kv_heads, kv_heads)]
    valid = torch.ones(1, len(anchors), dtype=torch.bool)
    dense = ChainLayout(anchors[None], depths[None], valid, dense=True)
    dense_entries = len(anchors) * rows
    print(f"T={cfg.length}, {len(anchors)} chain rows (K={cfg.num_depths}), {cfg.threads} thread(s)")
    print("| attention | ms (forward + backward) | chain entries computed ÷ dense |\n|---|---|---|")
    print(f"| dense mask | {_step_ms(tensors, dense, cfg.repeats):.1f} | 1.00 |")
    for chunk in cfg.chunks:
        layout = ChainLayout(anchors[None], depths[None], valid, chunk_rows=chunk)
        entries = sum(mask.shape[-2] * mask.shape[-1] for *_, mask in layout.chunks(cfg.length))
        ms = _step_ms(tensors, layout, cfg.repeats)
        print(f"| chunks of {chunk} rows | {ms:.1f} | {entries / dense_entries:.2f} |")


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ChainBenchConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
