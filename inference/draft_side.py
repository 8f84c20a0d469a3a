"""The draft side of the overlapped algorithms (PEARL, SpecBranch): a draft LM with its own KV cache and RNG.

Executors (``inference.executors``) run draft work as method calls on a :class:`DraftSide`, in this process or in
a child one, so it is built by a picklable factory (:func:`draft_side_from_path`; tests pass a partial of a
top-level builder). The algorithm never touches the draft cache: every call sends the *context* the draft should
continue (committed tokens + pending segment). The side keeps, per cache row, the tokens whose K/V it holds and
the draft logits it computed after each of them, and re-syncs by longest common prefix:

- the row sharing the longest prefix with the context is kept (after branching, that is the survivor), the
  others are dropped and the row is truncated to the shared prefix (rollback);
- if the draft distribution right after the whole context was already computed (SpecBranch's cached branch
  point), it is reused without a forward; otherwise the uncached tail is fed (at least one token).

So after a round the draft cache holds |S|+|U| tokens when the branch-point distribution is cached and
|S|+|U|-1 otherwise (§10), with no bookkeeping in the algorithm.

Spec: docs/algorithms/specbranch.md §1, §4, §5, §9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from core import assets
from inference.drafters import pick_device
from inference.runner import ModelRunner
from inference.runner_contract import as_batch
from inference.runner_loading import load_runner, with_logit_vocab
from inference.sampling import SamplingParams, sample


@dataclass
class ChainDraft:
    """γ draft tokens after the context (PEARL)."""

    tokens: list[int]
    probs: torch.Tensor | None  # [γ, V] warped q each token was sampled from (CPU); None for greedy (point masses)
    forwards: int


@dataclass
class BranchDraft:
    """k branches at the branch point (SpecBranch, §5): branch token + γ-1 argmax continuation tokens each."""

    tokens: list[list[int]]  # [k][γ]; tokens[i][0] = i-th most probable draft token at the branch point
    confidence: list[list[float]]  # [k][γ]: max_v q(v) (temperature 1) of the distribution each token came from
    forwards: int
    reused_branch_q: bool  # the branch-point distribution came from the previous round (no forward)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def num_branches(confidence: float, kmax: int) -> int:
    """SpecBranch's branch count k = max(1, ⌊kmax·(1 − q(x_b))⌋) for draft confidence q(x_b) = max_v q_b(v)."""
    return min(kmax, max(1, math.floor(kmax * (1.0 - confidence))))


class DraftSide:
    """A draft LM runner (batch up to ``kmax`` rows) with per-row token bookkeeping and its own generator."""

    def __init__(self, runner: ModelRunner, *, seed: int = 0):
        self.runner = runner
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self.start(seed)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # -- state -----------------------------------------------------------------------------------------------

    def start(self, seed: int) -> None:
        """A new generation: empty cache, reseeded generator (the algorithm draws ``seed`` from its own RNG)."""
        self.runner.reset(1)
        self.rows: list[list[int]] = [[]]  # tokens whose K/V each cache row holds
        self.logits: list[dict[int, torch.Tensor]] = [{}]  # row -> {prefix length: draft logits [V] after it}
        self.generator.manual_seed(seed)

    def lengths(self) -> list[int]:
        return self.runner.lengths

    def select(self, context: list[int]) -> tuple[int, bool]:
        """Keep the row best matching ``context`` and roll it back (no forward); (cache length, q cached)."""
        shared = [common_prefix(row, context) for row in self.rows]
        best = max(range(len(shared)), key=shared.__getitem__)
        length = shared[best]
        cached = length == len(context) and length in self.logits[best]
        if not cached and length == len(context):
            length -= 1  # the last context token is fed again to get the distribution after it
        self._keep_row(best, length)
        return length, cached

    def _keep_row(self, row: int, length: int) -> None:
        self.runner.select_rows([row], length)  # the survivor's K/V become the only row
        # Only the distribution right after the kept tokens can be reused; drop the rest (V floats each).
        logits = {length: self.logits[row][length]} if length in self.logits[row] else {}
        self.rows, self.logits = [self.rows[row][:length]], [logits]

    def _sync(self, context: list[int]) -> tuple[torch.Tensor, int, bool]:
        """(draft logits [V] after ``context``, forwards run, reused) with row 0 holding the context."""
        length, cached = self.select(context)
        if cached:
            return self.logits[0][length], 0, True
        feed = context[length:]
        logits = self.runner.forward(as_batch(feed, self.device), only_last_logits=True).logits[0, -1]
        self.rows[0] = list(context)
        self.logits[0] = {len(context): logits}
        return logits, 1, False

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; logits [k, V]; records them per row."""
        logits = self.runner.forward(torch.tensor(tokens, device=self.device).view(-1, 1)).logits[:, -1]
        for row, token in enumerate(tokens):
            self.rows[row].append(token)
            self.logits[row][len(self.rows[row])] = logits[row]
        return logits

    # -- drafting --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def chain(self, context: list[int], n: int, sampling: SamplingParams) -> ChainDraft:
        """``n`` tokens sampled from the warped draft distribution (argmax when greedy), one forward each."""
        logits, forwards, _ = self._sync(context)
        tokens, probs = [], []
        for i in range(n):
            q = sampling.warp(logits)
            token = int(sample(q, self.generator))
            tokens.append(token)
            probs.append(q)
            if i < n - 1:  # the last drafted token is fed next round, with whatever follows it
                logits = self._feed([token])[0]
                forwards += 1
        return ChainDraft(tokens, None if sampling.greedy else torch.stack(probs).float().cpu(), forwards)

    @torch.no_grad()
    def branches(self, context: list[int], kmax: int, gamma: int) -> BranchDraft:
        """Top-k branch tokens at the point after ``context`` (k from the draft confidence), each continued by
        γ-1 argmax tokens in one batched forward per step, all rows sharing the context's K/V (§4–5)."""
        logits, forwards, reused = self._sync(context)
        q_b = logits.float().softmax(-1)  # temperature 1, as the authors' code (confidence and TopK)
        confidence = float(q_b.max())
        k = num_branches(confidence, kmax)
        branch_tokens = torch.topk(q_b, k).indices.tolist()
        self._fork(k)
        tokens = [[y] for y in branch_tokens]
        conf = [[confidence] for _ in range(k)]
        feed = branch_tokens
        for _ in range(gamma - 1):
            q = self._feed(feed).float().softmax(-1)
            forwards += 1
            best = q.max(-1)
            feed = best.indices.tolist()
            for row in range(k):
                tokens[row].append(feed[row])
                conf[row].append(float(best.values[row]))
        return BranchDraft(tokens, conf, forwards, reused)

    def _fork(self, k: int) -> None:
        """Copy row 0 (K/V, tokens, logits) into rows 1..k-1."""
        runner = self.runner
        if k > runner.max_batch_size:
            raise ValueError(
                f"{k} branches need a draft runner with max_batch_size >= {k}, it has "
                f"{runner.max_batch_size}; build the draft side with kmax={k}"
            )
        runner.select_rows([0] * k, runner.length(0))
        self.rows = [list(self.rows[0]) for _ in range(k)]
        self.logits = [dict(self.logits[0]) for _ in range(k)]


# ------------------------------------------------------------------------------------------------------------
# Factories (picklable: paths and numbers, or a live runner for in-process executors only)


def _native_copy(runner: Any, max_batch: int) -> ModelRunner:
    """A ModelRunner over ``runner``'s weights (shared, not copied) with its own cache of ``max_batch`` rows."""
    if not isinstance(runner, ModelRunner):
        raise ValueError(
            f"the draft side needs a ModelRunner draft (Llama-family), got {type(runner).__name__}; "
            "load the draft LM with backend=auto or native"
        )
    if max_batch <= runner.max_batch_size:
        return runner
    copy = ModelRunner.from_config(
        runner.config,
        runner.state_dict(),
        device=runner.device,
        dtype=runner.dtype,
        max_batch_size=max_batch,
        max_seq_len=runner.max_seq_len,
        exact=False,
    )
    copy.logit_vocab = runner.logit_vocab
    return copy


def draft_side_from_runner(runner: Any, max_batch: int = 1, seed: int = 0) -> DraftSide:
    """In-process draft side over a loaded draft runner (sequential / cuda_streams executors)."""
    return DraftSide(_native_copy(runner, max_batch), seed=seed)


def draft_side_from_path(
    path: str,
    *,
    device: str = "auto",
    max_seq_len: int = 2048,
    max_batch: int = 1,
    seed: int = 0,
    logit_vocab: int | None = None,
    dtype: torch.dtype | None = None,
) -> DraftSide:
    """Draft side that loads its draft LM from a directory (what a multiprocess draft process runs)."""
    device = pick_device(device)
    model = assets.load_model(path, device=device, dtype=dtype)
    runner = load_runner(
        model,
        backend="native",
        device=device,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch,
        exact=False,
    )
    return DraftSide(with_logit_vocab(runner, logit_vocab), seed=seed)
