"""PEARL (docs/algorithms/specbranch.md §1): parallel speculative decoding with adaptive draft length.

Each round the target scores the pending segment U (plus the last committed token) while the draft side,
concurrently, drafts γ tokens d_1..d_γ after S+U as if U were accepted. At the join, U + [d_1] is verified
tokenwise (docs/algorithms/verify.md §2; §3 when greedy) against the target's rows p(·|S), .., p(·|S,U):

- all accepted: S += U + [d_1], U = d_2..d_γ ("post-verify": the next round checks them while drafting more);
- a rejection: S += accepted prefix + [residual sample], U = [] ("pre-verify": the next round's target call
  checks only the first new draft token, while the draft drafts the rest).

The first round is a pre-verify round whose target call is the prompt prefill, so the draft's prefill
overlaps it. No bonus token: the target's last row always judges a draft token. Draft length adapts on its own.

It runs on the engine loop (``inference.engine.loop``) as :class:`PearlRows`, one row at a time (its draft side
holds one sequence): the engine's target forward (the prefill, then each step's ``[last committed, *U]``) runs
through ``beside``, which drafts beside it on the executor; ``first`` / ``verify`` judge ``U + [d_1]`` at the
forward's rows. The target cache always holds the committed tokens but the last, as the engine keeps every row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.algorithms.options import PearlOptions, with_fields
from inference.algorithms.overlapped import DraftFactory, OneRowStrategy, OverlappedDraftAlgorithm
from inference.draft_side import ChainDraft
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, T
from inference.verify import VerifyResult, tokenwise
from inference.runner_loading import limited_draft


def verify_without_bonus(
    tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int | None]:
    """Tokenwise verification of ``tokens`` [n] with one target row per token ([n, V], no bonus row):
    (accepted count, correction token or None when all were accepted)."""
    n, vocab = target_probs.shape
    # A point-mass placeholder bonus row: the verifier draws from it only when all n are accepted, and a point
    # mass is resolved without the generator, so it changes neither the law nor the random stream.
    placeholder = F.one_hot(torch.zeros(1, dtype=torch.long), vocab).to(target_probs)
    result = tokenwise(
        torch.tensor(tokens, dtype=torch.long), draft_probs, torch.cat([target_probs, placeholder]), generator
    )
    if result.num_accepted == n:
        return n, None
    return result.num_accepted, int(result.tokens[-1])


class Pearl(OverlappedDraftAlgorithm):
    name = "pearl"

    context = ("draft_path",)

    def __init__(
        self,
        target,
        draft,
        options: PearlOptions | None = None,
        *,
        draft_path: str | None = None,
        draft_factory: DraftFactory | None = None,
        max_seq_len: int | None = None,
        executor_kwargs: dict | None = None,
        **fields,
    ):
        """``draft_path`` / ``draft_factory`` / ``executor_kwargs``: :class:`OverlappedDraftAlgorithm`'s."""
        self.options = options = with_fields(PearlOptions, options, fields)
        if options.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {options.gamma}")
        super().__init__(
            target,
            limited_draft(draft, options.draft_vocab),
            executor=options.executor,
            draft_path=draft_path,
            draft_factory=draft_factory,
            max_batch=1,
            max_seq_len=max_seq_len,
            executor_kwargs=executor_kwargs,
        )
        self.gamma = options.gamma

    def lookahead(self) -> int:
        return 2 * self.gamma  # the pending segment plus a fresh draft sit in the draft cache at once

    def strategy(self) -> PearlRows:
        return PearlRows(self)


@dataclass
class _PearlRow:
    """A row's PEARL state: S (prompt and emitted tokens), U and the laws its tokens were drawn from (None when
    greedy), this round's draft (made beside the target forward) and what its verification judged."""

    committed: list[int]
    pending: list[int]
    pending_q: torch.Tensor | None = None
    draft: ChainDraft | None = None
    judged: int = 0
    accepted: int = 0


class PearlRows(OneRowStrategy):
    """PEARL as a strategy of the engine loop, one row at a time (its draft side holds one sequence)."""

    name = "pearl"

    def __init__(self, algorithm: Pearl):
        super().__init__(algorithm)
        self.gamma = algorithm.gamma

    def beside(self, states: Sequence[RowState], forward: Callable[[], T], *, prefill: bool = False) -> T:
        """The target forward, and beside it the draft side drafting γ tokens after S + U as if U were accepted."""
        (state,) = states
        if prefill:  # the draft side's seed is the first draw of the row's generator
            self.algorithm.start_draft(state.generator)
            state.draft = _PearlRow(list(state.request.prompt), [])
        row = state.draft
        result, row.draft = self.executor.overlap(
            forward, "chain", row.committed + row.pending, self.gamma, state.sampling
        )
        return result

    def first(self, state: RowState, logits: torch.Tensor) -> list[int]:
        """The prefill's round: d_1 judged at the prompt's last row (U is empty)."""
        result = self._judge(state, logits[None])
        self.count_round(state, Proposal(), result)
        return result.tokens.tolist()

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        """U, judged at the forward's rows; the draft's d_1 joins it in ``verify``."""
        return [Proposal(list(state.draft.pending), state.draft.pending_q) for state in states]

    def verify(self, state: RowState, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        return self._judge(state, logits)

    def _judge(self, state: RowState, logits: torch.Tensor) -> VerifyResult:
        """U + [d_1] verified tokenwise against the rows p(·|S), .., p(·|S,U) of ``logits`` [|U| + 1, V]; the next
        U is d_2..d_γ when all were accepted, else empty. The result counts the U tokens kept (the forward's)."""
        row, draft = state.draft, state.draft.draft
        target_probs = state.sampling.warp(logits).float().cpu()
        judged = row.pending + draft.tokens[:1]
        judged_q = (
            None
            if draft.probs is None
            else torch.cat([row.pending_q if row.pending_q is not None else draft.probs[:0], draft.probs[:1]])
        )
        accepted, correction = verify_without_bonus(judged, judged_q, target_probs, state.generator)
        row.judged, row.accepted = len(judged), accepted
        if correction is None:
            new = judged
            row.pending, row.pending_q = draft.tokens[1:], None if draft.probs is None else draft.probs[1:]
        else:
            new = judged[:accepted] + [correction]
            row.pending, row.pending_q = [], None
        row.committed += new
        return VerifyResult(min(accepted, len(judged) - 1), torch.tensor(new, dtype=torch.long))

    def count_round(self, state: RowState, proposal: Proposal, result: VerifyResult) -> None:
        """Every round judges U + [d_1]; γ tokens were drafted (counted when drafted, whatever is judged)."""
        row, stats = state.draft, state.stats
        stats.draft_forwards += row.draft.forwards
        stats.record_round(row.judged, row.accepted)
        stats.drafted_tokens += self.gamma - row.judged

    def release(self, state: RowState) -> None:
        if state.out.done:
            self.algorithm.note_generation(time.perf_counter() - state.started, len(state.out.tokens))
