"""Chain speculative decoding with a draft LM (Leviathan et al. / Chen et al.), any chain verifier.

Each round the draft LM proposes γ tokens one forward at a time, the target scores all of them in ONE forward,
and a chain verifier (tokenwise, block = HSD capped, or the lossy HSD-uncapped rule) keeps a prefix plus one
correction/bonus token. Both KV caches are then rolled back to the kept tokens.

It runs on the engine loop as :class:`DraftChain`: the draft LM's runner holds one row per engine row, and one
draft forward a step drafts for every running row. Cache bookkeeping: every emitted token is eventually fed to both
models. A row's ``pending`` (the engine's) / ``draft_pending`` hold the emitted tokens a model has not seen yet (the
target always lags by the last emitted token; the draft also lags by the last draft token after a fully accepted
round, which it never ran).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from inference.algorithms.base import Algorithm
from inference.algorithms.options import SpsOptions, with_fields
from inference.engine.rows import forward_rows, prefill_rows
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, Strategy
from inference.runner_contract import RunnerOutput, check_same_vocab
from inference.sampling import sample
from inference.verify import ChainVerifier, VerifyResult, get_verifier
from inference.runner_loading import limited_draft


@dataclass(frozen=True)
class RoundInfo:
    """One verification round, handed to ``SpeculativeSampling(on_round=...)`` (acceptance traces).

    The branch token is the first drafted token. The target's hidden states are taken at the position before it
    (the last emitted token, whose output predicted the branch token), in the runner's capture convention: layer
    i = output of decoder layer i (0-based); ``last_hidden`` is after the final norm.
    """

    index: int  # round number within this generation, from 0
    prefix_len: int  # tokens before the branch token (prompt + emitted so far), i.e. the branch token's position
    draft_tokens: list[int]  # the drafted chain; draft_tokens[0] is the branch token
    draft_probs: list[float]  # probability of each drafted token under the draft's temperature-1 softmax
    draft_max_probs: list[float]  # max_v of that softmax at each step (SpecBranch's draft confidence)
    num_accepted: int  # leading drafted tokens the verifier kept
    hidden: dict[int, torch.Tensor]  # {layer: [H]} target hidden states at position prefix_len - 1
    last_hidden: torch.Tensor  # [H] final-normed target hidden state at position prefix_len - 1


RoundHook = Callable[[RoundInfo], None]


class SpeculativeSampling(Algorithm):
    name = "sps"
    drafter = "draft_lm"
    batchable = True
    squeezable = True

    def __init__(
        self,
        target,
        draft,
        options: SpsOptions | None = None,
        *,
        max_seq_len: int | None = None,
        on_round: RoundHook | None = None,
        round_capture_layers: Sequence[int] = (),
        **fields,
    ):
        """``options.verifier`` may be a verifier's name or a :class:`ChainVerifier`. ``on_round`` (optional)
        receives a :class:`RoundInfo` after every verification, with the target's hidden states of
        ``round_capture_layers``; without it nothing extra is computed or kept. ``options.draft_vocab`` limits the
        draft runner (:func:`inference.runner_loading.limited_draft`)."""
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = options = with_fields(SpsOptions, options, fields)
        draft = limited_draft(draft, options.draft_vocab)
        gamma, verifier = options.gamma, options.verifier
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {gamma}")
        check_same_vocab(target, draft)
        self.draft = draft
        self.gamma = gamma
        self.max_seq_len = min(self.max_seq_len, draft.max_seq_len)
        verifier_kwargs = {"final_ratio": options.final_ratio} if verifier == "hsd" else {}
        self.verifier = get_verifier(verifier, **verifier_kwargs) if isinstance(verifier, str) else verifier
        self.on_round = on_round
        self.round_capture_layers = tuple(round_capture_layers)

    def lookahead(self) -> int:
        return self.gamma + 1

    def strategy(self) -> DraftChain:
        return DraftChain(self.draft, self.gamma, self.verifier, self.on_round, self.round_capture_layers)


@dataclass
class _DraftRow:
    """A row's draft-side state: the emitted tokens the draft LM has not read, and its round count (for hooks)."""

    pending: list[int]
    rounds: int = 0


@dataclass
class _Drafted:
    """What a step's drafting keeps for the hooks: each step's raw draft logits, when hooked."""

    raw_logits: list[torch.Tensor] = field(default_factory=list)


class DraftChain(Strategy):
    """γ tokens a row from a draft LM, one draft forward a token for every running row at once; a chain verifier
    (tokenwise, block = HSD) per row."""

    name = "sps"

    def __init__(
        self,
        draft,
        gamma: int,
        verifier: ChainVerifier,
        on_round: RoundHook | None = None,
        round_capture_layers: Sequence[int] = (),
    ):
        self.draft, self.gamma, self.verifier, self.on_round = draft, gamma, verifier, on_round
        if on_round is not None:
            self.capture_layers, self.wants_last_hidden = tuple(round_capture_layers), True

    def lookahead(self) -> int:
        return self.gamma + 1

    def open(self, rows: int) -> None:
        self.draft.reset(rows)

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        # The draft sees the prompt minus its last token, which it reads with the first new token in its first
        # drafting forward.
        prefill_rows(self.draft, [s.row for s in states], [list(s.request.prompt)[:-1] for s in states], logits=False)
        for state in states:
            state.stats.draft_forwards += int(len(state.request.prompt) > 1)
            state.draft = _DraftRow([state.request.prompt[-1], *state.pending])

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        """Each row drafts ``min(γ, tokens it may still emit, its width - 1)`` tokens; a row that has drafted all of
        its own feeds a pad while the longer rows go on (drawing nothing), and is rolled back after. A row that
        drafts nothing (an AR step) sits out, its new tokens left for the draft to read later; once it has γ + 1 of
        them it reads them in the first draft forward (so a catch-up feed is never wider than a target step)."""
        gammas = [min(self.gamma, s.out.remaining, s.width - 1 if s.width else self.gamma) for s in states]
        proposals = [
            Proposal(q=None if s.sampling.greedy or not g else [], extra=_Drafted()) for s, g in zip(states, gammas)
        ]
        catch_up = [not g and len(s.draft.pending) > self.gamma for s, g in zip(states, gammas)]
        if not any(gammas) and not any(catch_up):  # every row takes an AR step
            return proposals
        span = 1 + max(s.row for s, g, c in zip(states, gammas, catch_up) if g or c)
        feeds: list[list[int] | None] = [None] * span
        start = self.draft.cache_lens.clone()
        fed = {}
        for state, gamma, catching_up in zip(states, gammas, catch_up):
            if gamma or catching_up:
                feeds[state.row] = list(state.draft.pending)
                fed[state.row] = len(state.draft.pending) + max(gamma - 1, 0)
            elif state.row < span:
                feeds[state.row] = []  # drafts nothing this step: its cache sits out
        for step in range(max(1, max(gammas))):
            wanted = [None if feed is None else [len(feed) - 1] if feed else [] for feed in feeds]
            logits = forward_rows(self.draft, feeds, wanted).logits
            for state, gamma, proposal in zip(states, gammas, proposals):
                if step >= gamma:
                    if state.row < span and feeds[state.row] is not None:  # a pad: this row has its chain or
                        feeds[state.row] = [0] if gamma else []  # drafts nothing
                    continue
                state.stats.draft_forwards += 1
                row_logits = logits[state.row][0]
                if self.on_round is not None:
                    proposal.extra.raw_logits.append(row_logits)
                q = state.sampling.warp(row_logits)
                token = int(sample(q, state.generator))
                proposal.tokens.append(token)
                if proposal.q is not None:
                    proposal.q.append(q)
                feeds[state.row] = [token]
        # Keep each row's pending tokens and its drafts but the last (never run): as a run alone leaves it.
        lens = self.draft.cache_lens.clone()
        for state, catching_up in zip(states, catch_up):
            lens[state.row] = start[state.row] + fed.get(state.row, 0)
            if catching_up:
                state.draft.pending = []
        self.draft.truncate(lens)
        for proposal in proposals:
            if proposal.q is not None:
                proposal.q = torch.stack(proposal.q)
        return proposals

    def verified(
        self, state: RowState, proposal: Proposal, result: VerifyResult, forward: RunnerOutput, row: int
    ) -> None:
        if self.on_round is None or not proposal.tokens:
            return
        raw = proposal.extra.raw_logits
        softmax = torch.stack(raw).float().softmax(dim=-1)  # [γ, V], temperature 1
        tokens = torch.tensor(proposal.tokens, device=softmax.device)
        self.on_round(
            RoundInfo(
                index=state.draft.rounds,
                prefix_len=state.context_len,
                draft_tokens=proposal.tokens,
                draft_probs=softmax.gather(1, tokens[:, None]).squeeze(1).tolist(),
                draft_max_probs=softmax.max(dim=-1).values.tolist(),
                num_accepted=result.num_accepted,
                hidden={layer: h[row, 0] for layer, h in forward.hidden.items()},
                last_hidden=forward.last_hidden[row, 0],
            )
        )
        state.draft.rounds += 1

    def accepted(
        self, states: Sequence[RowState], proposals: Sequence[Proposal], results: Sequence[VerifyResult | None]
    ) -> None:
        lens = self.draft.cache_lens.clone()
        for state, proposal, result in zip(states, proposals, results):
            if result is None:
                continue
            if not proposal.tokens:  # an AR step: the draft reads the new token with the others next time
                state.draft.pending.append(int(result.tokens[-1]))
                continue
            gamma, accepted = len(proposal.tokens), result.num_accepted
            # the draft holds its pending tokens and the drafts but the last: keep the accepted ones of those
            lens[state.row] -= gamma - 1 - min(accepted, gamma - 1)
            emitted = [int(t) for t in result.tokens]
            # After full acceptance the draft never ran its last token: feed it with the bonus token.
            state.draft.pending = emitted[-2:] if accepted == gamma else [emitted[-1]]
        self.draft.truncate(lens)
