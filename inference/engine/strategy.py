"""A decoding algorithm as a strategy of the engine loop: it proposes drafts for every running row at once, and the
loop scores them in one target forward and accepts per row.

A strategy owns its drafter's state (a draft LM's rows, a drafter cache with one length per row), never the target
and never a decode loop. The loop (``inference.engine.loop``) calls, per step:

1. ``propose(states)``: one :class:`Proposal` per running row (its drafted chain, and the law it was drawn from);
2. the target forward over ``[pending, *drafts]`` of every row, right-padded, run by ``beside`` (a strategy whose
   draft work runs beside the target, through an executor, starts it there);
3. ``verify(state, proposal, logits)`` per row: how much of the chain the target keeps, plus one token (a tree:
   the accepted path, which the loop commits per row with ``runner.commit``), and ``count_round`` of that round;
4. ``verified(state, proposal, result, forward, row)`` per row, before the tokens are emitted (round hooks);
5. ``accepted(states, proposals, results)`` once: the drafter's per-row rollback.

Admission runs the new rows' prefill through ``beside`` too, and ``first`` turns each row's prefill logits into
its first token(s).

Lossless per row: each row's drafts are drawn with the row's own generator from a law computed for that row, and the
row's verifier gets that law and the row's own target probabilities, so the per-row proofs of ``inference.verify``
hold whatever the neighbours are. A row draws only what its run alone would draw, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from inference.engine.state import RowState
from inference.runner_contract import RunnerOutput
from inference.sampling import sample
from inference.tree import DraftTree
from inference.verify import ChainVerifier, VerifyResult

T = TypeVar("T")


@dataclass
class Proposal:
    """A row's drafted chain (target ids) and the warped law each token was drawn from (``q`` [len, V]; None =
    chosen deterministically, a point mass). No tokens: the row takes an AR step."""

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    extra: Any = None  # what the strategy keeps for its hooks (a draft LM's raw logits)
    tree: DraftTree | None = None  # a draft tree below the pending token (``tokens`` = its nodes); None: a chain

    @property
    def drafted(self) -> int:
        """Draft tokens the row's counters see as its chain: a tree's depth (its other nodes are counted apart)."""
        return self.tree.max_depth if self.tree is not None else len(self.tokens)

    @property
    def width(self) -> int:
        """Target rows this proposal is scored on: the pending token and the drafts."""
        return 1 + len(self.tokens)


class Strategy:
    """The AR strategy, and the base of the speculative ones: no drafter, width 1. A speculative strategy drafts at
    most ``state.width - 1`` tokens for a row whose ``width`` the engine capped (``max_step_tokens``), none at width
    1: that row takes an AR step."""

    name = "ar"
    draft = None  # a draft LM's runner, where the strategy has one (a width policy measures its forward's cost)
    capture_layers: tuple[int, ...] = ()  # target layers the forward must capture for ``verified``
    wants_last_hidden = False
    verifier: ChainVerifier | None = None
    # Tree proposals: the loop hands ``verify`` an ``inference.row_logits.RowLogits`` of the row's forward, whose
    # rows are scored when read (True: from the final hidden states, a CPU's cheaper way) or with the forward.
    lazy_tree_rows = False
    # True: admission prefills nothing and samples nothing; a new row's pending tokens are its whole prompt, which its
    # first step's forward reads together with its first drafts (Self-Draft verifies candidates from the prefill on).
    reads_prompt = False

    def lookahead(self) -> int:
        """Cache slots needed beyond a row's committed tokens during one step."""
        return 1

    def open(self, rows: int) -> None:
        """Make the drafter's state for ``rows`` rows, empty."""

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        """Drafter-side prefill of new rows: their prompts are in the target already, their first token is
        ``state.pending``; ``hidden[k]`` holds the target's captured layers over row k's prompt."""

    def first(self, state: RowState, logits: torch.Tensor) -> list[int]:
        """The tokens a new row emits after its prefill (``logits``: float32 [V], the target's at its last prompt
        token): one token sampled from them, as AR. A strategy whose first round judges drafts made beside the
        prefill (``beside``) verifies them here, and counts that round."""
        return [int(sample(state.sampling.warp(logits), state.generator))]

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        return [Proposal() for _ in states]

    def beside(self, states: Sequence[RowState], forward: Callable[[], T], *, prefill: bool = False) -> T:
        """Run the engine's target forward ``forward()`` for ``states`` (their prefill, or a step's scoring of
        their proposals) and return its result. A strategy whose draft work runs beside the target forward (an
        executor, in a thread or another process: PEARL, SpecBranch) runs it here, overlapped, and keeps its
        result for ``first`` / ``verify``: drafts decided after the forward."""
        return forward()

    def verify(self, state: RowState, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        """``logits`` [width, V]: the target's at the pending token and after each draft (a tree proposal: a
        ``RowLogits`` of its rows, the strategy's own ``verify`` walks it and returns the walk, with its ``path``). Width 1 samples as AR
        does (not through a zero-draft plan, whose float64 residuals could draw differently with one generator)."""
        if not proposal.tokens:
            token = sample(state.sampling.warp(logits[0]), state.generator)
            return VerifyResult(0, token.view(1))
        drafts = torch.tensor(proposal.tokens, dtype=torch.long, device=logits.device)
        return self.verifier(drafts, proposal.q, state.sampling.warp(logits), state.generator)

    def count_round(self, state: RowState, proposal: Proposal, result: VerifyResult) -> None:
        """A row's counters after its verification: a chain's drafts, or a tree's depth as its chain and its other
        nodes as drafted tokens too."""
        if proposal.tokens:
            state.stats.record_round(proposal.drafted, result.num_accepted)
            state.stats.drafted_tokens += len(proposal.tokens) - proposal.drafted

    def verified(
        self, state: RowState, proposal: Proposal, result: VerifyResult, forward: RunnerOutput, row: int
    ) -> None:
        """Per row, after verification and before its tokens are emitted (``row``: its index in ``forward``)."""

    def accepted(
        self, states: Sequence[RowState], proposals: Sequence[Proposal], results: Sequence[VerifyResult | None]
    ) -> None:
        """After a step, once for every row that took part (None: the row failed); the drafter's rollback."""

    def release(self, state: RowState) -> None:
        """A row ended; its drafter slot is free."""

    def close(self) -> None:
        """Release what ``open`` made."""
