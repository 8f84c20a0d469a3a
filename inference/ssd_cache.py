"""SSD's speculation cache and its fan-out allocator (docs/algorithms/ssd.md §4–5).

While the target verifies round T, the draft side grows, for every sequence, ``B`` candidate next speculations,
one per guessed verification outcome ``(k accepted, bonus token t)``; :class:`SpecCache` holds them keyed by
``(sequence, k, t)`` and answers next round's lookups. :func:`geometric_fanout` splits the budget ``B`` over the
acceptance lengths ``k = 0..K`` (more guesses where outcomes are likelier).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

NO_KEY = -1  # k of a key that can never hit (first round, finished rows, unused branch slots)


def fanout_weights(k_max: int, a_p: float, r: float) -> list[float]:
    """Continuous optimum ``F_k ∝ π_k^{1/(1+r)}`` of ``Σ π_k (1 − c F_k^{−r})`` (unnormalised), ``k = 0..K``."""
    e = 1.0 / (1.0 + r)
    return [a_p ** (k * e) for k in range(k_max)] + [a_p ** (k_max * e) * (1.0 - a_p) ** (-e)]


def largest_remainder_round(x: Sequence[float], total: int) -> list[int]:
    """Integers summing to ``total`` closest to ``x`` (Hamilton rounding: floors, then the largest remainders)."""
    floors = [math.floor(v) for v in x]
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def geometric_fanout(
    budget: int, k_max: int, a_p: float, r: float = 1.0, f_max: int | None = None, f0_min: int = 1
) -> list[int]:
    """Integer fan-out ``[F_0..F_K]`` summing to ``budget`` from the closed form of §5, with ``F_0 ≥ f0_min``
    and every ``F_k ≤ f_max`` (the excess goes to the entries with the largest fractional parts still below the
    cap). ``a_p`` (per-token acceptance) is clamped to [0.01, 0.99] so both ends stay finite."""
    if budget < 1 or k_max < 1:
        raise ValueError(f"fan-out needs budget >= 1 and K >= 1, got budget={budget}, K={k_max}")
    if f_max is not None and f_max * (k_max + 1) < budget:
        raise ValueError(
            f"budget {budget} cannot be split over {k_max + 1} lengths with at most {f_max} each; lower the budget"
        )
    a_p = min(max(a_p, 0.01), 0.99)
    w = fanout_weights(k_max, a_p, r)
    x = [budget * wi / sum(w) for wi in w]
    fan = largest_remainder_round(x, budget)
    if fan[0] < f0_min:  # take the guarantee for k = 0 from the largest other entries
        need = min(f0_min, budget) - fan[0]
        fan[0] += need
        for _ in range(need):
            fan[max(range(1, len(fan)), key=lambda i: (fan[i], -i))] -= 1
    if f_max is not None:
        excess = sum(max(f - f_max, 0) for f in fan)
        fan = [min(f, f_max) for f in fan]
        for _ in range(excess):  # spill to the uncapped entry with the largest remainder of its optimum
            i = max((i for i in range(len(fan)) if fan[i] < f_max), key=lambda i: (x[i] - fan[i], -i))
            fan[i] += 1
    return fan


def parse_fanout(spec: str | Sequence[int], k_max: int) -> list[int] | None:
    """``"geometric"`` → None (computed online); otherwise an explicit list of K+1 ints (``"4,3,3,2,4"``, ``"4:3"``
    or a sequence)."""
    if isinstance(spec, str):
        if spec == "geometric":
            return None
        try:
            spec = [int(v) for v in spec.replace(":", ",").strip("[]").split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"fan-out must be 'geometric' or a list of K+1={k_max + 1} ints like 4,3,3,2,4; got {spec!r}"
            ) from None
    fan = [int(v) for v in spec]
    if len(fan) != k_max + 1 or min(fan) < 0 or sum(fan) < 1:
        raise ValueError(f"explicit fan-out needs K+1={k_max + 1} non-negative ints with a positive sum, got {fan}")
    return fan


@dataclass
class AcceptanceEMA:
    """Online per-token acceptance ``a_p`` from verification rounds: EMA of accepted and judged tokens."""

    decay: float = 0.2
    prior: float = 0.6
    accepted: float = 0.0
    judged: float = 0.0

    def update(self, num_accepted: int, drafted: int) -> None:
        judged = min(num_accepted + 1, drafted)
        if self.judged == 0.0:
            self.accepted, self.judged = float(num_accepted), float(judged)
            return
        self.accepted += self.decay * (num_accepted - self.accepted)
        self.judged += self.decay * (judged - self.judged)

    @property
    def value(self) -> float:
        return self.accepted / self.judged if self.judged > 0 else self.prior


class SpecCache:
    """The cached speculations of one round, for a batch of sequences: ``B`` branches per sequence, static shapes.

    keys [b, B, 2] = (k, bonus token) per branch (``k = NO_KEY`` for unused slots); tokens [b, B, K]; logits
    [b, B, K, V] (raw draft logits each token was sampled from); tops [b, B, K] (SAGUARO set sizes used).
    The sequence is the row, so a key is (row, k, t). The cache only ever holds branches grown from the speculation
    being verified and is replaced every round.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.tokens: Tensor | None = None
        self.logits: Tensor | None = None
        self.tops: Tensor | None = None

    def clear(self) -> None:
        self.keys = self.tokens = self.logits = self.tops = None

    def populate(self, keys: Tensor, tokens: Tensor, logits: Tensor, tops: Tensor) -> None:
        self.keys, self.tokens, self.logits, self.tops = keys, tokens, logits, tops

    def lookup(self, query: Tensor) -> tuple[Tensor, Tensor]:
        """query [b, 2] = (k, t) per row → (hit [b] bool, branch index [b]). Looks only at keys, never at the
        branch tokens (that would bias which speculation is served)."""
        if self.keys is None:
            return (
                torch.zeros(query.shape[0], dtype=torch.bool, device=query.device),
                torch.zeros(query.shape[0], dtype=torch.long, device=query.device),
            )
        match = (self.keys == query.to(self.keys.device)[:, None, :]).all(dim=-1) & (query[:, None, 0] != NO_KEY)
        return match.any(dim=1), match.to(torch.uint8).argmax(dim=1)

    def fetch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [b, K], logits [b, K, V], tops [b, K]) of branch ``index[b]`` of each row."""
        rows = torch.arange(index.shape[0], device=index.device)
        return self.tokens[rows, index], self.logits[rows, index], self.tops[rows, index]
