"""Whether the runner's greedy output is bitwise the target's, and on what grounds.

In exact mode (``inference.llama.EXACT_ROWS``) attention, RMSNorm, SiLU and fp32 linears are row-exact by
construction; bf16 linears are the host's oneDNN GEMM, whose row results must not depend on how many rows share a
call. That is a property of the kernels on this machine, so before the mode claims anything (in either dtype, as a
check of the whole path) a probe tests it on the model's own shapes (a
two-layer copy with the model's real first and last layers and lm_head): decoding 64 tokens one at a time against
blocks of 2, 3, 5, 13, 33, 48 and 64, and a tree with gaps against decoding each node's path. If a block differs,
the runner verifies token by token (every call then has a decode's shape: bitwise by construction, slower), and the
probe checks that path too. Results are kept per process and per (shapes, dtype, thread count).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

EXACT = "exact"  # chunks of up to EXACT_ROWS tokens; GEMM rows probed invariant
PER_TOKEN = "exact-per-token"  # every forward token by token, each call shaped as a decode step
APPROXIMATE = "approximate"  # SDPA and batched GEMMs: greedy equality up to rounding (near-ties can flip)

PROBE_PROMPT = 70
PROBE_TOKENS = 64
PROBE_BLOCKS = (2, 3, 5, 13, 33, 48, 64)
# A tree whose nodes leave gaps between their ancestors' slots (node i's parent; -1: below the cache).
PROBE_TREE = (-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 2, 10, 11, 4)
PROBE_SEQ_LEN = PROBE_PROMPT + PROBE_TOKENS + len(PROBE_TREE)


class ExactnessWarning(UserWarning):
    """The exact mode's probe failed on this machine; the runner says what it does instead."""


@dataclass(frozen=True)
class Exactness:
    """``path``: EXACT, PER_TOKEN or APPROXIMATE; ``probe``: "passed", "failed: ..." or "not run";
    ``bitwise``: greedy output equals decoding token by token, bit for bit."""

    path: str
    probe: str
    bitwise: bool
    reason: str = ""
    probe_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for reports and /health."""
        claim = "bitwise equal to AR by construction" if self.bitwise else "equal to AR up to rounding"
        line = f"{self.path} ({claim}; probe {self.probe})"
        return f"{line}: {self.reason}" if self.reason else line


def approximate(reason: str) -> Exactness:
    return Exactness(APPROXIMATE, "not run", False, reason)


def tree_mask(parents: tuple[int, ...] | list[int]) -> tuple[torch.Tensor, list[int]]:
    """[T, T] ancestor-or-self mask and each node's depth, for nodes given by their parent (-1: below the cache)."""
    mask, depth = torch.zeros(len(parents), len(parents), dtype=torch.bool), []
    for node, parent in enumerate(parents):
        mask[node, node] = True
        if parent >= 0:
            mask[node] |= mask[parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return mask, depth


@torch.no_grad()
def first_mismatch(runner, seed: int = 0) -> str | None:
    """Run the probe's checks on ``runner`` (any runner of the forward contract, one row, room for PROBE_SEQ_LEN
    tokens); None when every logit is bitwise equal, else what differed."""
    generator = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROBE_PROMPT), generator=generator)
    tokens = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator)
    runner.reset(1)
    runner.forward(prompt)
    stepwise = torch.cat([runner.forward(tokens[:, j:j + 1]).logits[0] for j in range(PROBE_TOKENS)])
    for block in PROBE_BLOCKS:
        runner.truncate(PROBE_PROMPT)
        blocked = torch.cat([runner.forward(tokens[:, j:j + block]).logits[0]
                             for j in range(0, PROBE_TOKENS, block)])
        if not torch.equal(blocked, stepwise):
            row = int((blocked != stepwise).any(-1).nonzero()[0])
            return f"a block of {block} tokens gave token {row} other logits than decoding it alone"
    mask, depth = tree_mask(PROBE_TREE)
    runner.truncate(PROBE_PROMPT)
    tree = runner.forward(tokens[:, :len(PROBE_TREE)], attention_mask=mask,
                          positions=torch.tensor([depth]) + PROBE_PROMPT).logits[0]
    for node in range(len(PROBE_TREE)):
        runner.truncate(PROBE_PROMPT)
        for i in mask[node].nonzero()[:, 0].tolist():  # its path, oldest first
            decoded = runner.forward(tokens[:, i:i + 1]).logits[0, -1]
        if not torch.equal(tree[node], decoded):
            return f"tree node {node} got other logits than decoding its path"
    return None


_results: dict[tuple, Exactness] = {}


def probe(key: tuple, make_runner: Callable[[str], Any]) -> Exactness:
    """The exactness of a runner whose kernels ``key`` identifies (shapes, dtype, threads). ``make_runner(path)``
    builds the probe's small runner running ``path`` (EXACT or PER_TOKEN). Warns, in one line, when the fast path
    fails."""
    key = (*key, torch.get_num_threads())
    if key in _results:
        return _results[key]
    start = time.perf_counter()
    mismatch = first_mismatch(make_runner(EXACT))
    if mismatch is None:
        result = Exactness(EXACT, "passed", True)
    else:
        fallback = first_mismatch(make_runner(PER_TOKEN))
        if fallback is None:
            result = Exactness(PER_TOKEN, f"failed: {mismatch}", True,
                               "this CPU's GEMM rows depend on the row count; verifying token by token")
        else:
            result = Exactness(APPROXIMATE, f"failed: {mismatch}; token by token: {fallback}", False,
                               "this CPU's kernels are not deterministic")
        warnings.warn(f"exact mode: {mismatch} on this CPU; {result.reason} "
                      f"({'still bitwise, slower' if result.bitwise else 'greedy equality only up to rounding'})",
                      ExactnessWarning, stacklevel=3)
    result = Exactness(result.path, result.probe, result.bitwise, result.reason,
                       round(time.perf_counter() - start, 3))
    _results[key] = result
    return result
