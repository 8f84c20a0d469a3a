"""``python -m benchmarks.forward_cost [tokens=[1,2,5,16,48,64]] [trees=[16,48]] [contexts=[300,1000,2000]]
[dtypes=[fp32,bf16]] [paths=[exact,plain]]``

What a speculative step costs on this machine: milliseconds of one SmolLM2 target forward of T new tokens over
``context`` cached tokens (median of ``repeats``), relative to a one-token decode step, per compute dtype and
attention path. A drafter pays for itself when the tokens it gets accepted outweigh that ratio plus its own
forwards.

``trees``: the same for a tree of T nodes (chains of ``tree_depth`` nodes from the cached text, each node seeing
only its own ancestors, as a draft tree's verification does); the table gives the 48-node tree over the 48-token
chain. ``paths``: ``exact`` is the runner's exact mode (one row on a CPU: each token attends over its own keys in
path order, ``inference.llama.EXACT_ROWS``); ``plain`` is ``exact=false`` (SDPA over a slot mask, no bitwise
claim), the baseline the exact decode step is compared with.

It also checks exactness: the logits of 64 continuation tokens decoded one at a time against the same tokens run
in blocks of 5, 16 and 48 (bitwise). The exact path must give 64 of 64 in every block; the plain path differs in
the last bits wherever the GEMM or SDPA reduces in another order for another row count.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.config import BenchConfig, Repeats, Target, parse_bench
from core.overrides import run_cli
from inference.algorithms.options import apply_threads
from inference.drafters import load_lm, model_dtype

USAGE = (
    "python -m benchmarks.forward_cost tokens=[1,2,5,16,48,64] trees=[16,48] contexts=[300,1000,2000] "
    "dtypes=[fp32,bf16] paths=[exact,plain] threads=1"
)


@dataclass
class ForwardCostConfig(BenchConfig, Target, Repeats):
    tokens: list[int] = field(default_factory=lambda: [1, 2, 5, 16, 48, 64])
    contexts: list[int] = field(default_factory=lambda: [300, 1000, 2000])
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    paths: list[str] = field(default_factory=lambda: ["exact", "plain"])
    trees: list[int] = field(default_factory=lambda: [16, 48])
    tree_depth: int = 6
    decode_pairs: int = 40  # alternating exact / plain decode steps for their ratio


def chains_tree(nodes: int, depth: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask [1, T, T], positions [1, T]) of ``nodes`` nodes in chains of ``depth`` from the context."""
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        first = i - i % depth  # the chain's first node
        mask[i, first : i + 1] = True
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


def equal_rows(runner, context: torch.Tensor, tokens: torch.Tensor) -> dict[int, int]:
    """Block size -> how many of the tokens' logit rows equal the one-at-a-time rows bitwise."""
    runner.reset(1)
    runner.forward(context)
    start = runner.length()
    stepwise = torch.cat([runner.forward(tokens[:, j : j + 1]).logits[0] for j in range(tokens.shape[1])])
    equal = {}
    for block in (5, 16, 48):
        runner.truncate(start)
        rows = torch.cat([runner.forward(tokens[:, j : j + block]).logits[0] for j in range(0, tokens.shape[1], block)])
        equal[block] = int((rows == stepwise).all(dim=-1).sum())
    return equal


def decode_ratio(target: str, dtype: torch.dtype, context: torch.Tensor, pairs: int) -> tuple[float, float, float]:
    """(exact ms, plain ms, median of the per-pair ratios): one decode step of each path in turn over the same
    cached text, so that a change in the machine's load hits both alike."""
    runners = [
        load_lm(target, device="cpu", max_seq_len=context.shape[1] + 8, dtype=dtype, exact=exact).runner
        for exact in (True, False)
    ]
    token = context[:, -1:]
    for runner in runners:
        runner.reset(1)
        runner.forward(context)
        step_ms(runner, token, 2)  # warm-up
    times: list[list[float]] = [[], []]
    for _ in range(pairs):
        for runner, spent in zip(runners, times):
            spent.append(step_ms(runner, token, 1))
    ratios = [a / b for a, b in zip(*times)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def run(cfg: Any) -> str:
    apply_threads(cfg)
    generator = torch.Generator().manual_seed(0)
    longest = max(cfg.contexts)
    text = torch.randint(0, 8192, (1, longest), generator=generator)
    continuation = torch.randint(0, 8192, (1, 64), generator=generator)
    header = (
        "| dtype | path | context | "
        + " | ".join(f"T={t}" for t in cfg.tokens)
        + "".join(f" | tree T={t}" for t in cfg.trees)
        + " | tree 48 ÷ chain 48 | rows equal to one-at-a-time "
        "(blocks 5 / 16 / 48, of 64) |"
    )
    lines = [
        f"SmolLM2 target forward of T new tokens, {cfg.threads} thread(s), median of {cfg.repeats}; "
        "in brackets: × that path's decode step",
        "",
        header,
        "|---|---|---|" + "---|" * (len(cfg.tokens) + len(cfg.trees)) + "---|---|",
    ]
    for name in cfg.dtypes:
        for path in cfg.paths:
            target = load_lm(
                cfg.target,
                device="cpu",
                max_seq_len=longest + 128,
                dtype=model_dtype(name, "cpu"),
                exact=path == "exact",
            )
            runner = target.runner
            for context in cfg.contexts:
                runner.reset(1)
                runner.forward(text[:, :context])
                costs = {t: step_ms(runner, continuation[:, :t], cfg.repeats) for t in cfg.tokens}
                trees = {}
                for t in cfg.trees:
                    mask, positions = chains_tree(t, cfg.tree_depth, context)
                    trees[t] = step_ms(
                        runner, continuation[:, :t], cfg.repeats, attention_mask=mask, positions=positions
                    )
                base = costs.get(1)
                cells = [
                    f"{ms:.1f} ms" + (f" ({ms / base:.2f}×)" if base else "")
                    for ms in [*costs.values(), *trees.values()]
                ]
                ratio = f"{trees[48] / costs[48]:.2f}" if 48 in trees and 48 in costs else "–"
                equal = equal_rows(runner, text[:, :context], continuation)
                lines.append(
                    f"| {name} | {runner.exactness.path} | {context} | "
                    + " | ".join(cells)
                    + f" | {ratio} | {equal[5]} / {equal[16]} / {equal[48]} |"
                )
            del target, runner
    if "exact" in cfg.paths and "plain" in cfg.paths:
        lines += [
            "",
            f"Decode step, exact ÷ plain: {cfg.decode_pairs} alternating steps of each, medians",
            "",
            "| dtype | context | exact | plain | exact ÷ plain (median of pairs) |",
            "|---|---|---|---|---|",
        ]
        for name in cfg.dtypes:
            for context in cfg.contexts:
                exact, plain, ratio = decode_ratio(
                    cfg.target, model_dtype(name, "cpu"), text[:, :context], cfg.decode_pairs
                )
                lines.append(f"| {name} | {context} | {exact:.1f} ms | {plain:.1f} ms | {ratio:.3f} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ForwardCostConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda args: run(parse_args(args)),
        doc=__doc__,
        schema=ForwardCostConfig,
        report=print,
    )


if __name__ == "__main__":
    sys.exit(main())
