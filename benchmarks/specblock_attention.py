"""``python -m benchmarks.specblock_attention [anchors=300] [chunks=[8,16,32,64]] [steps=6] [precision=32-true] [threads=1]
[key=value ...]``

Where SpecBlock's training attention time goes, dense masks against block-sparse, in ONE process
(``threads``, one by default):

1. kernel: forward + backward of one layer's attention for blocks 1, 2 and 3 (cuts 2 and 3) at ``anchors``
   anchors with the SmolLM2 drafter's heads (B = 4, 9 heads, 3 K/V heads, D = 64), random tensors: the dense
   mask against block-sparse at each chunk size in ``chunks``;
2. step (``steps`` > 0): recipe ``specblock_smollm2_gsm``'s first ``steps`` batches after ``benchmarks.train_step``'s
   warm-up one, forward + backward under torch.profiler with each attention, split into attention kernels, the
   lm_head's matmuls, the other matmuls and the rest. Other ``key=value`` are recipe overrides (``data.source=...``).
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.config import BenchConfig, parse_bench, split_own
from core.drafters.specblock import first_block_mask, later_block_mask
from core.drafters.specblock.attention import BlockLayout, block_sparse_attention
from inference.algorithms.options import apply_threads
from spectrain.fit import build_module_and_data, compose_recipe, import_kind_modules

USAGE = (
    "python -m benchmarks.specblock_attention anchors=300 chunks=[8,16,32,64] steps=6 precision=32-true threads=1 "
    "[overrides]"
)


@dataclass
class AttentionBenchConfig(BenchConfig):
    anchors: int = 300
    chunks: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    steps: int = 6
    precision: str = "32-true"  # or bf16-mixed (kernel part: bf16 tensors)


def _seconds(fn, repeats: int = 2) -> float:
    fn()  # warm-up
    start = time.process_time()  # CPU time: other jobs' load does not inflate it
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats


def kernel_table(anchors: int, chunks: list[int], dtype: torch.dtype, k: int = 4) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, entries = 4, 9, 3, 64, anchors * k

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    q = leaf(batch, heads, entries, dim)
    own, first, second = ((leaf(batch, kv_heads, entries, dim), leaf(batch, kv_heads, entries, dim)) for _ in range(3))
    print(f"attention forward + backward, CPU s, {anchors} anchors, {dtype}")
    print("| block | dense mask | " + " | ".join(f"block-sparse, chunk {c}" for c in chunks) + " |")
    print("|---" * (2 + len(chunks)) + "|")
    for name, cuts, groups in (("1", (), []), ("2", (2,), [first, first]), ("3", (2, 3), [first, first, second])):
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in _block_seconds(q, own, groups, cuts, chunks, k)) + " |")


def _block_seconds(
    q: torch.Tensor, own: tuple, groups: list[tuple], cuts: tuple[int, ...], chunks: list[int], k: int
) -> list[float]:
    """[dense, block-sparse at each chunk size] CPU seconds of one block's attention forward + backward."""
    anchors = q.shape[2] // k
    mask = later_block_mask(anchors, k, first_block=True, ttt_valid=cuts) if cuts else first_block_mask(anchors, k)
    past_k, past_v = [g[0] for g in groups], [g[1] for g in groups]

    def dense() -> None:
        keys, values = torch.cat(past_k + [own[0]], dim=2), torch.cat(past_v + [own[1]], dim=2)
        F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True).sum().backward()

    def sparse(chunk: int) -> None:
        layout = BlockLayout(
            anchors, k, first_block=bool(cuts), ttt_valid=cuts, own_sees_earlier=not cuts, chunk_anchors=chunk
        )
        block_sparse_attention(q, *own, past_k, past_v, layout).sum().backward()

    return [_seconds(dense)] + [_seconds(lambda c=c: sparse(c)) for c in chunks]


def step_table(cfg: AttentionBenchConfig, overrides: list[str]) -> None:
    import_kind_modules()
    recipe = compose_recipe(["recipe=specblock_smollm2_gsm", f"trainer.precision={cfg.precision}", *overrides])
    module, data = build_module_and_data(recipe)
    data.setup("fit")
    batches = iter(data.train_dataloader())
    warm, timed = next(batches), [next(batches) for _ in range(cfg.steps)]
    module.train()
    module.log = lambda *a, **k: None  # no Trainer attached

    def run(batch, attention: str) -> None:
        module.cfg.model.attention = attention
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16-mixed"):
            loss = module.training_step(batch, 0)
        loss.backward()
        module.zero_grad(set_to_none=True)

    print(
        f"\nforward + backward per step, profiled, {cfg.precision}, batches "
        f"{[tuple(b['input_ids'].shape) for b in timed]}"
    )
    print("| attention | total s | attention kernels | lm_head matmuls | other matmuls | rest |")
    print("|---|---|---|---|---|---|")
    for attention in ("dense", "block_sparse"):
        run(warm, attention)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for batch in timed:
                run(batch, attention)
        parts = collections.Counter()
        for event in prof.key_averages(group_by_input_shape=True):
            name, seconds = event.key, event.self_cpu_time_total / 1e6 / cfg.steps
            if "flash_attention" in name or "scaled_dot_product" in name:
                parts["attention"] += seconds
            elif name in ("aten::mm", "aten::addmm", "aten::bmm"):
                wide = str(module.drafter.config.draft_vocab_size) in str(event.input_shapes)
                parts["lm_head" if wide else "matmul"] += seconds
            else:
                parts["rest"] += seconds
        total = sum(parts.values())
        print(
            f"| {attention} | {total:.2f} | "
            + " | ".join(
                f"{parts[p]:.2f} ({100 * parts[p] / total:.0f} %)" for p in ("attention", "lm_head", "matmul", "rest")
            )
            + " |"
        )


def parse_args(argv: Sequence[str]) -> tuple[Any, list[str]]:
    """The benchmark's own config, and the recipe overrides (every other ``key=value``)."""
    own, overrides = split_own(argv, AttentionBenchConfig)
    return parse_bench(own, AttentionBenchConfig, USAGE), overrides


def main(argv: list[str]) -> None:
    own, overrides = parse_args(argv)
    apply_threads(own)
    kernel_table(own.anchors, list(own.chunks), torch.bfloat16 if own.precision == "bf16-mixed" else torch.float32)
    if own.steps > 0:
        step_table(own, overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
