"""The per-query signal from rejected positions and the bandit's context (docs/algorithms/specblock.md §7).

At a rejected position the drafter's distribution and the target's token are both known; ``q_r`` is the
drafter's probability of that token. ``S = Σ_r −log(max(q_r, floor)) / max(1, rounds)`` is large when the drafter
is far from the target at several rejected positions and small when they nearly agree. The context is the bucket
of S among the signals seen so far (running quantiles), so it adapts to the drafter's own scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from core.errors import UserError


def query_signal(rejection_q: Sequence[float], rounds: int, floor: float = 1e-6) -> float:
    """S of one query from its rejected positions' ``q_r`` and its number of verification rounds."""
    return sum(-math.log(max(q, floor)) for q in rejection_q) / max(1, rounds)


def draft_prob_of(draft_logits: torch.Tensor, target_token: int, draft_index: torch.Tensor, t2d: torch.Tensor) -> float:
    """Drafter probability (softmax of ``draft_logits`` over the draft vocabulary) of a TARGET token id; 0 when
    the token is outside the draft vocabulary."""
    if not bool(t2d[target_token]):
        return 0.0
    return float(draft_logits.float().softmax(-1)[draft_index[target_token]])


class ContextBuckets:
    """Bucket of a signal among all signals seen so far: ``bins`` bins cut at running quantiles."""

    def __init__(self, bins: int = 4):
        if bins < 1:
            raise UserError(f"adapt.bins must be >= 1, got {bins}")
        self.bins = bins
        self.history: list[float] = []

    def observe(self, signal: float) -> int:
        """Record ``signal`` and return its bucket in 0..bins-1 (ties go to the lower bin)."""
        self.history.append(float(signal))
        if self.bins == 1 or len(self.history) < 2:
            return 0
        values = torch.tensor(self.history, dtype=torch.float64)
        edges = torch.quantile(values, torch.arange(1, self.bins, dtype=torch.float64) / self.bins)
        return int(torch.searchsorted(edges, torch.tensor([float(signal)], dtype=torch.float64), right=False))
