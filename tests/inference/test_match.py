"""SpecBranch's Match (docs/algorithms/specbranch.md §6): exact by enumeration, the implementation follows its law, the public rule's bias."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from inference.draft_side import num_branches
from inference.match import match_round, match_round_law


def table_lm(vocab: int, depth: int, seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Next-token rows (float64) for every prefix of length 0..depth; every third row has a zero entry."""
    generator = torch.Generator().manual_seed(seed)
    rows = {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            row = (2 * torch.randn(vocab, generator=generator, dtype=torch.float64)).softmax(-1)
            if len(rows) % 3 == 2:
                row[len(rows) % vocab] = 0
                row /= row.sum()
            rows[prefix] = row
    return rows


def joint(p: dict, seq: tuple[int, ...], start: int = 0) -> float:
    return math.prod(float(p[seq[:i]][seq[i]]) for i in range(start, len(seq)))


@pytest.mark.parametrize("m", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_match_round_is_exact_for_every_k(m, seed):
    """Pending chain (argmax drafts) + Match with TopK(q_b, k): the emitted tokens, continued by the target to a
    fixed length, follow the target's joint law exactly, for every k; survivor i has probability reach·p_b(y_i)."""
    vocab = 4
    p, q = table_lm(vocab, m + 1, seed), table_lm(vocab, m + 1, seed + 100)
    pending: list[int] = []
    for _ in range(m):  # the draft's own argmax chain, as SpecBranch's continuation tokens are
        pending.append(int(q[tuple(pending)].argmax()))
    rows = torch.stack([p[tuple(pending[:j])] for j in range(m + 1)])
    reach = joint(p, tuple(pending))
    for k in range(1, vocab + 1):
        candidates = torch.topk(q[tuple(pending)], k).indices.tolist()
        law = match_round_law(pending, candidates, rows)
        assert abs(sum(law.values()) - 1) < 1e-12
        extended: dict[tuple[int, ...], float] = {}
        for (emitted, _), weight in law.items():
            for rest in itertools.product(range(vocab), repeat=m + 1 - len(emitted)):
                seq = emitted + rest
                extended[seq] = extended.get(seq, 0.0) + weight * joint(p, seq, len(emitted))
        for seq in itertools.product(range(vocab), repeat=m + 1):
            assert abs(extended.get(seq, 0.0) - joint(p, seq)) < 1e-12
        for i, y in enumerate(candidates):
            assert abs(law[(tuple(pending) + (y,), i)] - reach * float(rows[-1][y])) < 1e-12


def test_match_round_samples_its_exact_law():
    """Monte Carlo on the code that runs: 10k draws within 4.5 sigma of the enumerated law."""
    vocab, runs = 4, 10000
    p = table_lm(vocab, 2, seed=7)
    pending, candidates = [1, 3], [2, 0]
    rows = torch.stack([p[()], p[(1,)], p[(1, 3)]]).float()
    law = match_round_law(pending, candidates, rows)
    generator = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(runs):
        result = match_round(pending, candidates, rows, generator)
        key = (tuple(result.tokens), result.survivor)
        assert result.pending_accepted == len(result.tokens) - 1
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(law)
    for key, prob in law.items():
        sigma = math.sqrt(runs * prob * (1 - prob))
        assert abs(counts.get(key, 0) - runs * prob) <= 4.5 * sigma + 1, key


def public_rule_law(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """The authors' survivor rule (§6 "What the public code does instead"): keep i* = argmax_i p(y_i) over
    y = TopK(q, k), accept it with min(1, p/q), else emit argmax(norm(max(0, p − q))). Exact law of the token."""
    candidates = torch.topk(q, k).indices
    best = candidates[p[candidates].argmax()]
    accept = min(1.0, float(p[best] / q[best]))
    law = torch.zeros_like(p)
    law[best] += accept
    law[(p - q).clamp_min(0).argmax()] += 1 - accept
    return law


def test_public_rule_is_biased_and_match_is_not():
    """Regression fixture (§12 item 2): p=(0.5,0.3,0.2), q=(0.6,0.3,0.1), k=2 gives (0.833, 0, 0.167)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    public = public_rule_law(p, q, 2)
    assert torch.allclose(public, torch.tensor([5 / 6, 0.0, 1 / 6], dtype=torch.float64))
    ours = match_round_law([], torch.topk(q, 2).indices.tolist(), p[None])
    emitted = torch.zeros(3, dtype=torch.float64)
    for (tokens, _), weight in ours.items():
        emitted[tokens[0]] += weight
    assert torch.allclose(emitted, p, atol=1e-15)


def test_greedy_match_draws_no_randomness():
    rows = torch.eye(5)[[3, 1, 4]]  # target argmax 3, then 1, then 4
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert match_round([3, 1], [2, 4], rows, generator).survivor == 1
    assert match_round([3, 0], [2, 4], rows, generator).tokens == [3, 1]
    assert match_round([3, 1], [2, 0], rows, generator).tokens == [3, 1, 4]
    assert torch.equal(generator.get_state(), state)


def test_branch_count_follows_the_confidence_formula():
    assert [num_branches(c, 3) for c in (0.95, 0.5, 0.34, 0.3, 0.1, 0.0)] == [1, 1, 1, 2, 2, 3]
    assert num_branches(0.0, 1) == 1 and num_branches(0.2, 5) == 4


def test_bad_rows_are_a_one_line_error():
    with pytest.raises(ValueError, match=r"target_probs must be \[3, V\]"):
        match_round([1, 2], [0], torch.ones(2, 4) / 4)
