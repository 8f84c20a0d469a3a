"""``python benchmarks/dflash_attention.py [length=640] [anchors=32] [block_size=8] [chunks=[4,8,16,32]] [threads=1] [repeats=7]``

Why DFlash trains with chunked anchor attention on a CPU (``core.drafters.dflash.attention``): milliseconds for one
forward + backward of one layer's anchor attention with SmolLM2-135M's head shapes (9 heads, 3 KV heads, head dim
64), batch 1, under the dense anchor mask [A·K, T + A·K] (what flex attention's block mask replaces on a GPU) and
chunked with several anchors per chunk. Also prints the share of the dense mask's entries each computes.
Compare the rows of one run only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.config import BenchConfig, Repeats, parse_bench
from core.drafters.dflash.attention import AnchorLayout, anchor_block_attention
from inference.algorithms.options import apply_threads

USAGE = (
    "python benchmarks/dflash_attention.py length=640 anchors=32 block_size=8 chunks=[4,8,16,32] threads=1 repeats=7"
)


@dataclass
class AttentionBenchConfig(BenchConfig, Repeats):
    length: int = 640
    anchors: int = 32
    block_size: int = 8
    chunks: list[int] = field(default_factory=lambda: [4, 8, 16, 32])


def _step_ms(tensors: list[torch.Tensor], layout: AnchorLayout, repeats: int) -> float:
    """Median ms of one forward + backward of the attention alone (the mask or chunk plan built inside)."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        layout._masks.clear()  # training builds them once per step
        start = time.perf_counter()
        anchor_block_attention(*tensors, layout).square().mean().backward()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def run(cfg: AttentionBenchConfig) -> None:
    apply_threads(cfg)
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2-135M
    queries = cfg.anchors * cfg.block_size
    shapes = [
        (1, heads, queries),
        (1, kv_heads, queries),
        (1, kv_heads, queries),
        (1, kv_heads, cfg.length),
        (1, kv_heads, cfg.length),
    ]
    tensors = [torch.randn(*shape, head_dim, requires_grad=True) for shape in shapes]
    anchors = torch.sort(torch.randperm(cfg.length - cfg.block_size)[: cfg.anchors]).values[None]
    dense = AnchorLayout(anchors, cfg.block_size, dense=True)
    dense_entries = queries * (cfg.length + queries)
    print(f"T={cfg.length}, {cfg.anchors} anchors of {cfg.block_size}, {cfg.threads} thread(s)")
    print("| attention | ms (forward + backward) | entries computed ÷ dense |\n|---|---|---|")
    print(f"| dense mask | {_step_ms(tensors, dense, cfg.repeats):.1f} | 1.00 |")
    for chunk in cfg.chunks:
        layout = AnchorLayout(anchors, cfg.block_size, chunk_anchors=chunk)
        entries = sum(mask.shape[-2] * mask.shape[-1] for _, _, mask in layout.chunks(cfg.length))
        ms = _step_ms(tensors, layout, cfg.repeats)
        print(f"| chunks of {chunk} anchors | {ms:.1f} | {entries / dense_entries:.2f} |")


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, AttentionBenchConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
