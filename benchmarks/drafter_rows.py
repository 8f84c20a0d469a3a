"""``python benchmarks/drafter_rows.py [rows=[1,8]] [threads=1] [repeats=7] [context=200]``

What a drafter's batched serving call costs, and what its row-exact mode adds: milliseconds per call of
``Eagle3Drafter.step`` (one and four new rows per cache row), ``PEagleDrafter.draft`` (1-3 committed rows, K = 4)
and ``DFlashDrafter.draft`` (1-3 new context positions, a block of 8, two layers), for B rows of ragged cached
lengths (about ``context``), padded (one call under masks) and row-exact (``set_row_exact``: each row bitwise its solo
call). Random fp32 drafters shaped like SmolLM2-135M's layers, an 8,192-token draft vocabulary. Prints a table;
compare the columns of one run only (median of ``repeats`` blocks of calls).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.config import BenchConfig, Repeats, parse_bench
from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.peagle import PEagleConfig, PEagleDrafter
from core.overrides import run_cli
from inference.algorithms.options import apply_threads

USAGE = "python benchmarks/drafter_rows.py rows=[1,8] threads=1 repeats=7 context=200"
HIDDEN, VOCAB = 576, 49152
SHAPE = dict(
    hidden_size=HIDDEN,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=VOCAB,
    draft_vocab_size=8192,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)
CALLS_PER_BLOCK = 5


@dataclass
class DrafterRowsConfig(BenchConfig, Repeats):
    rows: list[int] = field(default_factory=lambda: [1, 8])
    context: int = 200


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # kernel selection and the RoPE table out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS_PER_BLOCK):
            fn()
        times.append((time.perf_counter() - start) / CALLS_PER_BLOCK)
    return 1e3 * sorted(times)[repeats // 2]


def _drafters() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN)
    aux = dict(target_hidden_size=HIDDEN, aux_layer_ids=[1, 2, 3])
    dflash = DFlashConfig(
        **SHAPE, target_hidden_size=HIDDEN, aux_layer_ids=[1, 2], block_size=8, num_layers=2, mask_token_id=7
    )
    drafters = {
        "eagle3": Eagle3Drafter(Eagle3Config(**SHAPE, **aux), embed),
        "peagle": PEagleDrafter(PEagleConfig(**SHAPE, **aux, mask_token_id=7, num_depths=4), embed),
        "dflash": DFlashDrafter(dflash, embed),
    }
    return {name: drafter.eval().requires_grad_(False) for name, drafter in drafters.items()}


def _call(name: str, drafter, rows: int, context: int, new: int) -> Callable[[], None]:
    """One serving call on a cache of ``rows`` ragged rows, rolled back after each call."""
    cache = drafter.new_cache(context + 64, batch_size=rows)
    held = [context - 7 * b for b in range(rows)]
    cache.held = list(held)
    counts = torch.tensor([1 + b % 3 for b in range(rows)])
    if name == "eagle3":
        tokens, hidden = torch.randint(0, VOCAB, (rows, new)), torch.randn(rows, new, HIDDEN)
        positions = torch.tensor(held)[:, None] + torch.arange(new)
        run = lambda: drafter.step(tokens, hidden, positions, cache)  # noqa: E731
    elif name == "peagle":
        features, tokens = torch.randn(rows, 3, 3 * HIDDEN), torch.randint(0, VOCAB, (rows, 3))
        run = lambda: drafter.draft(cache, features, tokens, 4, counts)  # noqa: E731
    else:
        features, anchors = torch.randn(rows, 3, 2 * HIDDEN), torch.randint(0, VOCAB, (rows,))
        run = lambda: drafter.draft(cache, features, anchors, counts)  # noqa: E731

    def call() -> None:
        run()
        cache.truncate(held)

    return call


@torch.no_grad()
def measure(cfg: DrafterRowsConfig) -> list[dict]:
    apply_threads(cfg)
    drafters = _drafters()
    cases = [
        ("eagle3", 1, "EAGLE-3 step, 1 new row"),
        ("eagle3", 4, "EAGLE-3 step, 4 new rows"),
        ("peagle", 0, "P-EAGLE draft, K = 4"),
        ("dflash", 0, "DFlash draft, block 8"),
    ]
    results = []
    for name, new, label in cases:
        row = {"call": label}
        for rows in cfg.rows:
            for exact in (False, True):
                drafters[name].set_row_exact(exact)
                call = _call(name, drafters[name], rows, cfg.context, new)
                row[(rows, exact)] = _median_ms(call, cfg.repeats)
        drafters[name].set_row_exact(False)
        results.append(row)
    return results


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, DrafterRowsConfig, USAGE)


def _run(argv: list[str]) -> None:
    cfg = parse_args(argv)
    results = measure(cfg)
    print(
        f"SmolLM2-135M-shaped drafters, fp32, {cfg.threads} thread(s), ~{cfg.context} cached rows, "
        f"median of {cfg.repeats}\n"
    )
    heads = [f"{rows} rows {'row-exact' if exact else 'padded'} ms" for rows in cfg.rows for exact in (False, True)]
    print("| call | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for row in results:
        cells = [f"{row[(rows, exact)]:.1f}" for rows in cfg.rows for exact in (False, True)]
        print(f"| {row['call']} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, _run, doc=__doc__, schema=DrafterRowsConfig)


if __name__ == "__main__":
    sys.exit(main())
