"""SpecBranch's verification: the pending segment, then the lossless "Match" (docs/algorithms/specbranch.md §6).

The pending tokens u_1..u_m were drafted by argmax (deterministic), so each is judged with the one-candidate
rule (docs/algorithms/verify.md §3), the k branch tokens y_1..y_k (TopK, also deterministic) with the multi-candidate
rule: z ~ p_b is always the emitted token and the branch equal to z, if any, survives. Both are
``inference.verify.multi_candidate``; this module only chains them and gives the exact law for the tests.

The public code's rule (keep argmax_i p_b(y_i), accept with min(1, p/q), else the greedy residual) is NOT lossless
under sampling (§12 item 2); tests/inference/test_match.py keeps it as a regression fixture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.verify import multi_candidate


@dataclass(frozen=True)
class MatchResult:
    tokens: list[int]  # emitted: accepted pending tokens + one token (correction, or the Match token)
    pending_accepted: int
    survivor: int | None  # index of the surviving branch; None if a pending token or all branches were rejected


def match_round(
    pending: Sequence[int],
    candidates: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> MatchResult:
    """Verify ``pending`` [m] then Match ``candidates`` [k]; ``target_probs`` [m+1, V]: row j is the target's
    distribution before pending token j, row m the branch point's p_b. Greedy (one-hot rows) draws nothing."""
    if target_probs.dim() != 2 or target_probs.shape[0] != len(pending) + 1:
        raise ValueError(
            f"target_probs must be [{len(pending) + 1}, V] (one row per pending token + the branch "
            f"point), got {tuple(target_probs.shape)}"
        )
    for j, token in enumerate(pending):
        match = multi_candidate([int(token)], target_probs[j], generator)
        if match.candidate_index is None:
            return MatchResult([int(t) for t in pending[:j]] + [match.token], j, None)
    match = multi_candidate(list(candidates), target_probs[-1], generator)
    return MatchResult([int(t) for t in pending] + [match.token], len(pending), match.candidate_index)


def match_round_law(
    pending: Sequence[int], candidates: Sequence[int], target_probs: torch.Tensor
) -> dict[tuple[tuple[int, ...], int | None], float]:
    """Exact law of (emitted tokens, survivor) of :func:`match_round`, by enumerating the target rows."""
    probs = target_probs.to(torch.float64).tolist()
    law: dict[tuple[tuple[int, ...], int | None], float] = {}
    reach = 1.0
    for j, token in enumerate(pending):
        for z, p in enumerate(probs[j]):
            if z != token and p > 0:
                key = (tuple(pending[:j]) + (z,), None)
                law[key] = law.get(key, 0.0) + reach * p
        reach *= probs[j][int(token)]
    index = {int(y): i for i, y in reversed(list(enumerate(candidates)))}  # first candidate equal to z wins
    for z, p in enumerate(probs[-1]):
        if p > 0:
            key = (tuple(int(t) for t in pending) + (z,), index.get(z))
            law[key] = law.get(key, 0.0) + reach * p
    return law
