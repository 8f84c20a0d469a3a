"""Whether the runner's greedy output is bitwise the target's, and on what grounds.

In exact mode (``inference.llama.EXACT_ROWS``) attention, RMSNorm, SiLU and fp32 linears are row-exact by
construction; bf16 linears are the host's oneDNN GEMM, whose row results must not depend on how many rows share a
call. That is a property of the kernels on this machine, so before the mode claims anything (in either dtype, as a
check of the whole path) a probe tests it on the model's own shapes (a two-layer copy with the model's real first and
last layers and lm_head), for every call size the engine can make: a forward runs at most EXACT_ROWS tokens per call,
so chains, trees, grids, prefills and their tails all take 1..EXACT_ROWS rows. Against decoding 64 tokens one at a
time it checks

- the lm_head on hidden rows (the runner's ``logits_from_hidden``: the forward's own logits and the rows verification
  computes later, alone or a grid's at once) for every size 1..64, at several offsets into the rows. In bf16 at the
  full vocabulary; in fp32 over the first ``FP32_HEAD_IDS`` ids: the fp32 linear (``core.kernels.exact_cpu``) runs
  the same code for every output column whatever the width, at a fiftieth of the full head's cost here;
- the decoder on a block of every size 2..64 (the final hidden states), and one pass in blocks of 5, whose keys
  written by one block are read by the next;
- a tree with gaps against decoding each node's path (full logits).

With sparse mixture-of-experts MLPs the copy holds a sparse layer (the runner picks one if neither end is), so the
blocks also give each expert's linears every row count they meet and check the router kernel.

If a check differs, the runner verifies token by token (every call then has a decode's shape: bitwise by
construction, slower), and the probe checks that path too (without the sweeps: its calls have one row each). Results
are kept per process and per (shapes, dtype, thread count).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from inference.llama import EXACT_ROWS

EXACT = "exact"  # chunks of up to EXACT_ROWS tokens; GEMM rows probed invariant
PER_TOKEN = "exact-per-token"  # every forward token by token, each call shaped as a decode step
APPROXIMATE = "approximate"  # SDPA and batched GEMMs: greedy equality up to rounding (near-ties can flip)
# the reason a CPU runner serving several rows is not exact: the probe left only the token-by-token path, and a
# batch's decode step is a call of as many rows as the batch
BATCHED_ROWS = "this CPU's GEMM rows depend on the row count; batched rows run the approximate path"
# the reason the transformers fallback is not exact (README, "Model families")
TRANSFORMERS_BACKEND = (
    "transformers backend: its attention and GEMMs compute a verification's rows together; "
    "exact mode needs the native runner (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral families)"
)

PROBE_PROMPT = 70
PROBE_TOKENS = EXACT_ROWS  # every call size up to the most a forward's call takes
PROBE_CHUNK = 5  # one pass in blocks of 5, 5, ..., 4: keys written by one block, read by the next
FP32_HEAD_IDS = 1024  # the fp32 lm_head sweep's width (module docstring); a multiple of 64, the kernel's block
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


def _final_hidden(runner, tokens: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden rows [T, H] of a forward of ``tokens`` [1, T] (no lm_head)."""
    return runner.forward(tokens, return_last_hidden=True, logit_rows=slice(0, 0)).last_hidden[0]


def _first_row(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).reshape(len(a), -1).any(-1).nonzero()[0])


@torch.no_grad()
def first_mismatch(runner, seed: int = 0, sweep: bool = True) -> str | None:
    """Run the probe's checks on ``runner`` (any runner of the forward contract, one row, room for PROBE_SEQ_LEN
    tokens); None when every result is bitwise equal, else what differed. ``sweep=False`` skips the checks of every
    call size (for the per-token path, whose calls all have one row)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROBE_PROMPT), generator=generator)
    tokens = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator)
    runner.reset(1)
    runner.forward(prompt)
    stepwise = torch.cat([_final_hidden(runner, tokens[:, j : j + 1]) for j in range(PROBE_TOKENS)])
    mismatch = _head_mismatch(runner, stepwise) if sweep else None  # first: in fp32 the cheaper sweep
    if mismatch is not None:
        return mismatch
    for block in range(2, PROBE_TOKENS + 1) if sweep else ():
        runner.truncate(PROBE_PROMPT)
        blocked, expected = _final_hidden(runner, tokens[:, :block]), stepwise[:block]
        if not torch.equal(blocked, expected):
            return (
                f"a block of {block} tokens gave token {_first_row(blocked, expected)} other hidden states than "
                "decoding it alone"
            )
    runner.truncate(PROBE_PROMPT)
    chunked = torch.cat(
        [_final_hidden(runner, tokens[:, j : j + PROBE_CHUNK]) for j in range(0, PROBE_TOKENS, PROBE_CHUNK)]
    )
    if not torch.equal(chunked, stepwise):
        return (
            f"blocks of {PROBE_CHUNK} tokens gave token {_first_row(chunked, stepwise)} other hidden states than "
            "decoding it alone"
        )
    mask, depth = tree_mask(PROBE_TREE)
    runner.truncate(PROBE_PROMPT)
    tree = runner.forward(
        tokens[:, : len(PROBE_TREE)], attention_mask=mask, positions=torch.tensor([depth]) + PROBE_PROMPT
    ).logits[0]
    for node in range(len(PROBE_TREE)):
        runner.truncate(PROBE_PROMPT)
        path = mask[node].nonzero()[:, 0].tolist()  # oldest first
        for i in path[:-1]:
            _final_hidden(runner, tokens[:, i : i + 1])
        decoded = runner.forward(tokens[:, path[-1] : path[-1] + 1]).logits[0, -1]
        if not torch.equal(tree[node], decoded):
            return f"tree node {node} got other logits than decoding its path"
    return None


def _head_mismatch(runner, hidden: torch.Tensor) -> str | None:
    """Whether ``runner.logits_from_hidden`` gives each of ``hidden``'s rows the same logits on it alone and among
    1..len(hidden) rows (module docstring; fp32 over FP32_HEAD_IDS ids)."""
    full_vocab = runner.logit_vocab
    if runner.dtype == torch.float32 and full_vocab is None:
        runner.logit_vocab = min(FP32_HEAD_IDS, runner.config.vocab_size)
    try:
        alone = torch.cat([runner.logits_from_hidden(hidden[j : j + 1]) for j in range(len(hidden))])
        for count in range(2, len(hidden) + 1):
            start = count * 7 % (len(hidden) - count + 1)  # rows at varying offsets, as verification slices them
            rows = runner.logits_from_hidden(hidden[start : start + count])
            expected = alone[start : start + count]
            if not torch.equal(rows, expected):
                return (
                    f"the lm_head on {count} hidden rows gave row {_first_row(rows, expected)} other logits than "
                    "on it alone"
                )
    finally:
        runner.logit_vocab = full_vocab
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
        fallback = first_mismatch(make_runner(PER_TOKEN), sweep=False)
        if fallback is None:
            result = Exactness(
                PER_TOKEN,
                f"failed: {mismatch}",
                True,
                "this CPU's GEMM rows depend on the row count; verifying token by token",
            )
        else:
            result = Exactness(
                APPROXIMATE,
                f"failed: {mismatch}; token by token: {fallback}",
                False,
                "this CPU's kernels are not deterministic",
            )
        warnings.warn(
            f"exact mode: {mismatch} on this CPU; {result.reason} "
            f"({'still bitwise, slower' if result.bitwise else 'greedy equality only up to rounding'})",
            ExactnessWarning,
            stacklevel=3,
        )
    result = Exactness(result.path, result.probe, result.bitwise, result.reason, round(time.perf_counter() - start, 3))
    _results[key] = result
    return result
