"""What algorithms whose drafter drafts a whole chain in ONE forward (``dflash``, ``peagle``) share: their strategy on
the engine loop (:class:`ParallelChain`: per step one drafter call drafts every running row's chain, the target
verifies all chains in one forward with the tokenwise rule, and each row's accepted rows' features go back to the
drafter at the next step) and turning the drafter's logits into draft tokens.

Per row and round, with ``n`` committed tokens in the target's cache and the last emitted token ``r`` (pending): the
drafter appends the features of the positions the last verification committed (at the start the prompt's, captured
by the prefill; each paired with the token after it) to its row of the drafter cache (one length per row,
:mod:`core.drafters.row_kv`) and drafts ``γ = max(1, min(draft_tokens, remaining - 1))`` tokens after ``r``.

Exactness at T > 0: the drafter's distribution for chain position k does not depend on the tokens drawn for the
earlier positions (DFlash's slots read mask tokens and the context, P-EAGLE's deeper rows the mask token and
``mask_hidden``), so ``q_k`` is also its law given them and the tokenwise rule (accept with ``min(1, p/q)``, else the
residual) keeps the target's law exactly, as for a draft LM. Each row draws its drafts with its own generator.

Rows side by side: where the target runner is exact (``target.exact``, a CPU) the drafter runs row-exact
(``set_row_exact``), so a row's drafts are bitwise those of its run alone, whoever shares the call.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.kernels.exact_cpu import KernelUnavailable
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, Strategy
from inference.runner_contract import RunnerOutput
from inference.sampling import SamplingParams, sample
from inference.verify import ChainVerifier, VerifyResult, get_verifier


class ParallelDrafting:
    """Mixin: the algorithm calls :meth:`_init_parallel` (setting ``self.drafter``, ``self.draft_tokens``, the most
    a round drafts, and ``self.aux_layers``) and implements ``_draft_logits``."""

    # Whether a row's draft logits depend on how many tokens the call drafts (P-EAGLE's mask rows): rows drafting
    # different counts then get calls of their own, each row the call it gets alone.
    depth_sensitive = False

    def _init_parallel(self, drafter, draft_tokens: int, most: int, why_most: str) -> None:
        """``draft_tokens``: the ``{name}.draft_tokens`` option, 1..``most`` (0: ``most``, what one drafter forward
        drafts); ``why_most`` says in the error what limits it, e.g. "this drafter's block drafts 7 tokens"."""
        if not 0 <= draft_tokens <= most:
            raise ValueError(
                f"{self.name}.draft_tokens={draft_tokens} but {why_most}; give 1..{most} (0 = all of them)"
            )
        self.drafter = drafter.eval()
        self.draft_tokens = draft_tokens or most
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.verifier = get_verifier("tokenwise")
        if getattr(self.target, "exact", False) and not drafter.row_exact:
            try:  # rows side by side get their solo drafts bitwise
                drafter.set_row_exact(True)
            except (ValueError, KernelUnavailable):  # not on this host or drafter: rows stay lossless, not bitwise
                pass

    def _draft_logits(
        self, cache, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None, gamma: int
    ) -> torch.Tensor:
        """One drafter forward over the cache's B rows: row b appends its first ``counts[b]`` committed rows
        (``features`` [B, n, ·] of the positions after those its cache holds, ``next_tokens`` [B, n] the token after
        each; ``counts`` None: all n) and drafts after the last of them (whose next token, the last emitted one, is
        not in the target's cache yet). Returns the drafts' logits [B, >= gamma, Vd]."""
        raise NotImplementedError

    def lookahead(self) -> int:
        return self.draft_tokens + 1

    def strategy(self) -> ParallelChain:
        return ParallelChain(self)


@dataclass
class _ChainRow:
    """What a row's next drafter call appends: the features of its newly committed positions [n, ·] and the token
    after each."""

    features: torch.Tensor
    next_tokens: list[int]


class ParallelChain(Strategy):
    """The engine strategy of a :class:`ParallelDrafting` algorithm: one drafter call drafts a chain per running
    row (one call per distinct chain length where the drafter is ``depth_sensitive``); tokenwise verification."""

    def __init__(self, algorithm: ParallelDrafting):
        self.algorithm = algorithm
        self.name = algorithm.name
        self.drafter, self.draft_tokens = algorithm.drafter, algorithm.draft_tokens
        self.capture_layers = algorithm.aux_layers
        self.verifier: ChainVerifier = algorithm.verifier
        self.cache = None

    def lookahead(self) -> int:
        return self.draft_tokens + 1

    def open(self, rows: int) -> None:
        if self.cache is not None and self.cache.batch == rows:
            self.cache.truncate(0)
        else:
            self.cache = self.drafter.new_cache(self.algorithm.max_seq_len, batch_size=rows)

    def close(self) -> None:
        self.cache = None

    def release(self, state: RowState) -> None:
        if self.cache is None:
            return
        held = list(self.cache.held)
        held[state.row] = 0  # an idle row appends nothing and holds nothing
        self.cache.truncate(held)

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The aux layers concatenated in the drafter's order, in the drafter's dtype."""
        return torch.cat([hidden[i] for i in self.capture_layers], dim=-1).to(self.drafter.fc.weight.dtype)

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        held = list(self.cache.held)
        for state, layers in zip(states, hidden):
            held[state.row] = 0
            state.draft = _ChainRow(self._features(layers), list(state.request.prompt)[1:] + state.pending)
        self.cache.truncate(held)

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        gammas = [max(1, min(self.draft_tokens, s.out.remaining - 1)) for s in states]  # never past the budget
        groups = (
            {g: [k for k, gk in enumerate(gammas) if gk == g] for g in sorted(set(gammas))}
            if self.algorithm.depth_sensitive
            else {max(gammas): list(range(len(states)))}
        )
        logits: list[torch.Tensor | None] = [None] * len(states)
        for gamma, members in groups.items():
            out = self._call([states[k] for k in members], gamma)
            for k in members:
                logits[k] = out[states[k].row, : gammas[k]]
        proposals = []
        for state, row_logits in zip(states, logits):
            state.stats.draft_forwards += 1
            tokens, q = self._draft(row_logits, state.sampling, state.generator)
            proposals.append(Proposal(tokens.tolist(), q))
        return proposals

    def _call(self, states: Sequence[RowState], gamma: int) -> torch.Tensor:
        """One drafter call in which ``states``' rows append their committed rows and draft; the other rows up to
        the last of them append nothing, and the rows after it sit the call out. Returns [rows called, ·, Vd]."""
        if self.cache.batch == 1:  # the one-row call (a row alone): its own tensors, unpadded
            (state,) = states
            return self.algorithm._draft_logits(
                self.cache, state.draft.features[None], torch.tensor([state.draft.next_tokens]), None, gamma
            )
        span = 1 + max(s.row for s in states)
        new = max(len(s.draft.next_tokens) for s in states)
        first = states[0].draft.features
        features = first.new_zeros(span, new, first.shape[-1])
        next_tokens = torch.zeros(span, new, dtype=torch.long)
        counts = [0] * span
        for state in states:
            n = len(state.draft.next_tokens)
            features[state.row, :n] = state.draft.features
            next_tokens[state.row, :n] = torch.tensor(state.draft.next_tokens)
            counts[state.row] = n
        cache = self._first_rows(span)
        try:
            return self.algorithm._draft_logits(cache, features, next_tokens, counts, gamma)
        finally:
            self.cache.held[:span] = cache.held

    def _first_rows(self, span: int):
        """The drafter cache's rows ``0..span-1`` as a cache of their own: views of its K/V (what a call writes
        lands in the whole cache) and a copy of their lengths (``_call`` copies them back)."""
        if span == self.cache.batch:
            return self.cache
        rows = copy.copy(self.cache)
        rows.k, rows.v = [k[:span] for k in self.cache.k], [v[:span] for v in self.cache.v]
        rows.held = self.cache.held[:span]
        return rows

    def _draft(
        self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary logits [γ, Vd] -> target ids [γ] and, when sampling, the distributions they were drawn
        from over the target vocabulary [γ, V] (None: argmax drafts, a point mass for the verifier)."""
        to_target = self.drafter.draft_ids_in_target().to(logits.device)
        if sampling.greedy:
            return to_target[logits.argmax(-1)], None
        q_draft = sampling.warp(logits.float())
        q = q_draft.new_zeros(len(logits), self.drafter.config.vocab_size)
        q[:, to_target] = q_draft
        return torch.stack([sample(row, generator) for row in q]), q

    def verified(
        self, state: RowState, proposal: Proposal, result: VerifyResult, forward: RunnerOutput, row: int
    ) -> None:
        # the pending token and the accepted drafts are committed: their features are the drafter's next rows
        kept = 1 + result.num_accepted
        state.draft = _ChainRow(
            self._features({i: forward.hidden[i][row, :kept] for i in self.capture_layers}),
            [int(t) for t in result.tokens],
        )
