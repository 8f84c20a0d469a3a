"""``python -m benchmarks.forward_cost [tokens=[1,2,5,8,16,32,48,64]] [trees=[16,48]] [context=300] [dtypes=[fp32,bf16]]``

What a speculative step costs on this machine: milliseconds of one SmolLM2 target forward of T new tokens over
``context`` cached tokens (median of ``repeats``), relative to a one-token decode step, per compute dtype. A
drafter pays for itself when the tokens it gets accepted outweigh that ratio plus its own forwards.

``trees``: the same for a tree of T nodes (chains of ``tree_depth`` nodes from the cached text, each node seeing
only its own ancestors, as a draft tree's verification does). In bf16's batch-invariant mode each tree node
attends over its own contiguous copy of its keys, so a tree costs more than a chain of as many tokens.

It also checks batch invariance: the logits of 64 continuation tokens decoded one at a time against the same
tokens run in blocks of 5, 16 and 48 (bitwise). bf16 on a CPU with native bf16 runs the runner's batch-invariant
mode (``inference.llama.INVARIANT_ROWS``), where they must be equal; fp32 is not batch-invariant (MKL's GEMM
sums in another order for other row counts), so its rows differ in the last bits.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from core.overrides import parse_cli, run_cli
from inference.drafters import load_lm, model_dtype

USAGE = ("python -m benchmarks.forward_cost tokens=[1,2,5,8,16,32,48,64] trees=[16,48] context=300 dtypes=[fp32,bf16] "
         "threads=1")


@dataclass
class ForwardCostConfig:
    target: str = "smollm2"
    tokens: list[int] = field(default_factory=lambda: [1, 2, 5, 8, 16, 32, 48, 64])
    context: int = 300
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    trees: list[int] = field(default_factory=lambda: [16, 48])
    tree_depth: int = 6
    repeats: int = 9
    threads: int = 1


def chains_tree(nodes: int, depth: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask [1, T, T], positions [1, T]) of ``nodes`` nodes in chains of ``depth`` from the context."""
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        first = i - i % depth  # the chain's first node
        mask[i, first:i + 1] = True
    return mask[None], (context + torch.arange(nodes) % depth)[None]


def step_ms(runner, ids: torch.Tensor, repeats: int, **forward) -> float:
    start_len = runner.length()
    times = []
    for _ in range(repeats + 1):  # the first call pays for allocation and kernel selection
        start = time.perf_counter()
        runner.forward(ids, **forward)
        times.append(time.perf_counter() - start)
        runner.truncate(start_len)
    return statistics.median(times[1:]) * 1000


def invariant_rows(runner, context: torch.Tensor, tokens: torch.Tensor) -> dict[int, int]:
    """Block size -> how many of the tokens' logit rows equal the one-at-a-time rows bitwise."""
    runner.reset(1)
    runner.forward(context)
    start = runner.length()
    stepwise = torch.cat([runner.forward(tokens[:, j:j + 1]).logits[0] for j in range(tokens.shape[1])])
    equal = {}
    for block in (5, 16, 48):
        runner.truncate(start)
        rows = torch.cat([runner.forward(tokens[:, j:j + block]).logits[0]
                          for j in range(0, tokens.shape[1], block)])
        equal[block] = int((rows == stepwise).all(dim=-1).sum())
    return equal


def run(cfg: ForwardCostConfig) -> str:
    torch.set_num_threads(cfg.threads)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 8192, (1, cfg.context), generator=generator)
    continuation = torch.randint(0, 8192, (1, 64), generator=generator)
    lines = [f"SmolLM2 target forward of T new tokens over {cfg.context} cached tokens, {cfg.threads} thread(s), "
             f"median of {cfg.repeats}", "",
             "| dtype | batch-invariant | " + " | ".join(f"T={t}" for t in cfg.tokens)
             + "".join(f" | tree T={t}" for t in cfg.trees) + " | rows equal to one-at-a-time (blocks 5 / 16 / 48, of 64) |",
             "|---|---|" + "---|" * (len(cfg.tokens) + len(cfg.trees)) + "---|"]
    for name in cfg.dtypes:
        target = load_lm(cfg.target, device="cpu", max_seq_len=cfg.context + 128, dtype=model_dtype(name, "cpu"))
        runner = target.runner
        runner.reset(1)
        runner.forward(context)
        costs = [step_ms(runner, continuation[:, :t], cfg.repeats) for t in cfg.tokens]
        for t in cfg.trees:
            mask, positions = chains_tree(t, cfg.tree_depth, cfg.context)
            costs.append(step_ms(runner, continuation[:, :t], cfg.repeats, attention_mask=mask, positions=positions))
        base = costs[0] if cfg.tokens[0] == 1 else None
        cells = [f"{ms:.1f} ms" + (f" ({ms / base:.2f}×)" if base else "") for ms in costs]
        equal = invariant_rows(runner, context, continuation)
        lines.append(f"| {name} | {'yes' if runner.batch_invariant else 'no'} | " + " | ".join(cells)
                     + f" | {equal[5]} / {equal[16]} / {equal[48]} |")
        del target, runner
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, lambda args: run(parse_cli(args, ForwardCostConfig, USAGE)), doc=__doc__,
                   schema=ForwardCostConfig, report=print)


if __name__ == "__main__":
    sys.exit(main())
