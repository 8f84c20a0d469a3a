"""What every decoding algorithm shares: its result, its statistics and the generation loop's bookkeeping.

An algorithm turns a prompt into new tokens with one target runner (and, for draft-model algorithms, a draft
runner). It reports the counters docs/architecture.md §6.4 lists, so evaluation treats all algorithms alike.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from core.errors import UserError
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


class Algorithm(ABC):
    """A lossless decoding algorithm. Subclasses declare which drafter they need and implement ``_generate``."""

    name: ClassVar[str]
    drafter: ClassVar[str] = "none"  # none | draft_lm | features (EAGLE-3) | specblock

    def __init__(self, target, *, max_seq_len: int | None = None):
        self.target = target
        self.max_seq_len = max_seq_len or target.max_seq_len

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        """Constructor keyword arguments taken from an evaluate/generate config (override per algorithm)."""
        return {}

    def extra_metrics(self) -> dict:
        """Algorithm-specific figures for the evaluation record of the runs since the previous call (e.g. an
        executor's simulated-overlap timing); each call starts a new period. Default: none."""
        return {}

    def lookahead(self) -> int:
        """Cache slots needed beyond the committed tokens during one step."""
        return 1

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        needed = prompt_len + max_new_tokens + self.lookahead()
        if needed > self.max_seq_len:
            raise UserError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} (+{self.lookahead()} lookahead) "
                f"needs {needed} cache slots but max_seq_len={self.max_seq_len}; shorten the prompt, lower "
                "max_new_tokens or raise max_seq_len"
            )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        eos_ids: Sequence[int] = (),
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        if len(prompt_ids) == 0:
            raise UserError("empty prompt: give at least one token")
        self.check_fits(len(prompt_ids), max_new_tokens)
        stats = GenerationStats()
        out = OutputBuffer(max_new_tokens, eos_ids, on_tokens)
        start = time.perf_counter()
        self._generate(list(prompt_ids), out, sampling, generator, stats)
        _synchronize(self.target)
        stats.wall_s = time.perf_counter() - start
        stats.new_tokens = len(out.tokens)
        return GenerationResult(out.tokens, stats)

    @abstractmethod
    def _generate(
        self,
        prompt_ids: list[int],
        out: OutputBuffer,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        ...


def _synchronize(runner) -> None:
    device = getattr(runner, "device", torch.device("cpu"))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def as_batch(tokens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)
