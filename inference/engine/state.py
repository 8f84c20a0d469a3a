"""Per-request state of the engine loop (``inference.engine.loop``): what a request asks for, what the engine keeps
for it while it runs, and what it reports when it ends. The result types every algorithm shares live here too
(``GenerationStats``, ``GenerationResult``, ``OutputBuffer``): a request run alone and a request run beside others are
counted and cut (EOS, budget, callback) by the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.sampling import SamplingParams

# Called with each batch of emitted tokens; returning False ends the generation there, through the algorithm's
# normal end of query (a server's client went away, or a stop string was met), so no state is left half-done.
TokenCallback = Callable[[list[int]], "bool | None"]


@dataclass
class GenerationStats:
    """Counters of one or more generations; ``merge`` adds them up over prompts."""

    new_tokens: int = 0
    target_forwards: int = 0  # serial target calls, prefill included
    draft_forwards: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    rounds: int = 0  # verification rounds
    wall_s: float = 0.0
    draft_s: float = 0.0  # wall seconds inside the drafter, where an algorithm times it (tree drafting)
    accepted_at: list[int] = field(default_factory=list)  # [k]: rounds where draft position k+1 was accepted
    attempted_at: list[int] = field(default_factory=list)  # [k]: rounds where draft position k+1 was judged
    accepted_hist: list[int] = field(default_factory=list)  # [n]: rounds that kept exactly n drafted tokens

    def record_round(self, drafted: int, accepted: int) -> None:
        """One verification of ``drafted`` chain tokens of which the first ``accepted`` were kept."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_draft_tokens += accepted
        judged = min(accepted + 1, drafted)  # positions after the first rejection are never judged
        self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1
        self._grow(drafted)
        for k in range(judged):
            self.attempted_at[k] += 1
            self.accepted_at[k] += int(k < accepted)

    def _grow(self, n: int) -> None:
        while len(self.attempted_at) < n:
            self.attempted_at.append(0)
            self.accepted_at.append(0)

    def merge(self, other: GenerationStats) -> GenerationStats:
        self.new_tokens += other.new_tokens
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.drafted_tokens += other.drafted_tokens
        self.accepted_draft_tokens += other.accepted_draft_tokens
        self.rounds += other.rounds
        self.wall_s += other.wall_s
        self.draft_s += other.draft_s
        self._grow(len(other.attempted_at))
        for k, (acc, att) in enumerate(zip(other.accepted_at, other.attempted_at)):
            self.accepted_at[k] += acc
            self.attempted_at[k] += att
        self.accepted_hist.extend([0] * (len(other.accepted_hist) - len(self.accepted_hist)))
        for n, rounds in enumerate(other.accepted_hist):
            self.accepted_hist[n] += rounds
        return self

    @property
    def tau(self) -> float:
        """New tokens per target forward (block efficiency)."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollback_rate(self) -> float:
        """Discarded drafted tokens ÷ drafted tokens."""
        if not self.drafted_tokens:
            return 0.0
        return (self.drafted_tokens - self.accepted_draft_tokens) / self.drafted_tokens

    @property
    def acceptance_by_position(self) -> list[float]:
        return [acc / att if att else 0.0 for acc, att in zip(self.accepted_at, self.attempted_at)]


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats


class OutputBuffer:
    """Collects emitted tokens, stops at EOS or the token budget, and streams to an optional callback (which may
    end the generation early by returning False)."""

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int], on_tokens: TokenCallback | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(int(e) for e in eos_ids)
        self.on_tokens = on_tokens
        self.tokens: list[int] = []
        self.done = max_new_tokens <= 0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def extend(self, new: Sequence[int]) -> list[int]:
        """Append tokens up to the first EOS / the budget; returns what was actually kept."""
        kept = []
        for token in new:
            if self.done:
                break
            kept.append(int(token))
            if int(token) in self.eos_ids or len(self.tokens) + len(kept) >= self.max_new_tokens:
                self.done = True
        self.tokens.extend(kept)
        if kept and self.on_tokens is not None and self.on_tokens(kept) is False:
            self.done = True
        return kept


@dataclass
class RowRequest:
    """One request for the engine: ``prompt`` ids, its token budget, its sampling settings and its own random stream
    (``generator``; None = torch's default stream), and ``on_tokens`` (streaming; False ends the request there)."""

    key: Hashable
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None = None
    on_tokens: TokenCallback | None = None


@dataclass
class RowState:
    """What the engine keeps for a running request. ``row`` is its slot in the target runner and in every drafter
    cache; ``pending`` the emitted tokens the target has not read yet (its last token, between rounds); ``draft`` the
    strategy's own state of the row."""

    request: RowRequest
    row: int
    out: OutputBuffer
    stats: GenerationStats
    started: float
    pending: list[int] = field(default_factory=list)
    draft: Any = None
    width: int = 0  # target rows this row may be scored on this step (0 = no cap); 1 = an AR step
    first_logits: torch.Tensor | None = None  # the target's logits the first token was drawn from (float32 [V])

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def context_len(self) -> int:
        """Tokens of the request so far: its prompt and what it emitted."""
        return len(self.request.prompt) + len(self.out.tokens)


@dataclass
class Finished:
    """A request ended (EOS, budget, or its callback said stop): its tokens and counters."""

    key: Hashable
    result: GenerationResult


@dataclass
class Failed:
    """A request ended by an error: in its own row (its verification or callback), or in a batched call that failed
    every row in flight."""

    key: Hashable
    error: BaseException


def fit_problem(prompt_len: int, max_new_tokens: int, lookahead: int, max_seq_len: int) -> str:
    """Why a prompt and its budget do not fit a cache of ``max_seq_len`` slots with ``lookahead`` spare ('' if
    they do): the one check both a request run alone and a request admitted beside others go through."""
    needed = prompt_len + max_new_tokens + lookahead
    if needed <= max_seq_len:
        return ""
    return (
        f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} (+{lookahead} lookahead) needs "
        f"{needed} cache slots but max_seq_len={max_seq_len}; shorten the prompt, lower max_new_tokens or "
        "raise max_seq_len"
    )
