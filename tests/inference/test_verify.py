"""Verifiers are lossless: exact enumeration on table-driven toy LMs (docs/algorithms/hsd.md §6), Monte Carlo on the code path.

A toy LM is a list of conditional tables: table[ℓ] has shape (V,)*ℓ + (V,) and table[ℓ][prefix] is the
next-token distribution after `prefix`. Target tables go up to prefix length γ (the bonus row).
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from inference.verify import (
    BlockVerifier,
    HSDVerifier,
    LossyVerifierWarning,
    TokenwiseVerifier,
    VerifyResult,
    block,
    block_outcome_law,
    block_plan,
    get_verifier,
    hsd,
    multi_candidate,
    tokenwise,
    tokenwise_outcome_law,
    tokenwise_plan,
    tree_walk,
    tree_walk_law,
)

F64 = torch.float64


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12) -> None:
    # Plain max-abs check: torch.testing.assert_close costs ~1 s of lazy imports on first use.
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert (actual - expected).abs().max().item() <= atol, (actual, expected)


# ---------------------------------------------------------------------------------------------------------
# Toy LMs
# ---------------------------------------------------------------------------------------------------------


def _random_row(rng: np.random.Generator, V: int, kind: str) -> np.ndarray:
    row = rng.dirichlet(np.full(V, 0.7))
    if kind == "onehot" and rng.random() < 0.5:
        row = np.eye(V)[rng.integers(V)]
    if kind == "zeros" and rng.random() < 0.7:  # zero out a random strict subset, keep at least one token
        keep = rng.random(V) < 0.5
        keep[rng.integers(V)] = True
        row = np.where(keep, row, 0.0)
        row = row / row.sum()
    return row


def make_toy_lm(V: int, depth: int, seed: int, kind: str = "dirichlet") -> tuple[list, list]:
    """Target tables for prefixes of length 0..depth and draft tables for 0..depth-1.

    kind: "dirichlet" (both Dirichlet(0.7)), "onehot" (about half of all rows one-hot), "identical" (q = p),
    "zeros" (target rows with zeros; draft rows full support).
    """
    rng = np.random.default_rng(seed)
    P, Q = [], []
    for length in range(depth + 1):
        shape = (V,) * length
        p_rows = np.zeros(shape + (V,))
        q_rows = np.zeros(shape + (V,))
        for prefix in itertools.product(range(V), repeat=length):
            p_rows[prefix] = _random_row(rng, V, kind)
            q_rows[prefix] = (
                p_rows[prefix] if kind == "identical" else _random_row(rng, V, "dirichlet" if kind == "zeros" else kind)
            )
        P.append(torch.tensor(p_rows, dtype=F64))
        Q.append(torch.tensor(q_rows, dtype=F64))
    return P, Q[:depth]


def target_joint(P: list) -> torch.Tensor:
    """Target probability of every sequence of length len(P): shape (V,)*len(P)."""
    joint = P[0]
    for table in P[1:]:
        joint = joint.unsqueeze(-1) * table
    return joint


def rows_along(tables: list, drafts: torch.Tensor) -> torch.Tensor:
    """[B, len(tables), V]: row t is tables[t][draft[:t]] for every draft."""
    first = tables[0].expand(drafts.shape[0], -1)  # the empty prefix indexes no dimension
    return torch.stack([first] + [tables[t][tuple(drafts[:, :t].T)] for t in range(1, len(tables))], dim=1)


def all_drafts(V: int, gamma: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(V), repeat=gamma)), dtype=torch.long).reshape(-1, gamma)


def continued_law_per_draft(outcome_law: torch.Tensor, drafts: torch.Tensor, P: list) -> torch.Tensor:
    """§6 steps 2–3 for every draft: emit X_{1:τ} + y, then continue to length γ+1 with P.

    outcome_law [B, γ+1, V], drafts [B, γ] -> [B] + [V] * (γ+1).
    Continuation is a forward pass over lengths, so no division by prefix probabilities is needed.
    """
    batch, gamma = drafts.shape
    V = P[0].shape[-1]
    continued = None
    for tau in range(gamma + 1):
        emitted = torch.zeros((batch,) + (V,) * (tau + 1), dtype=F64)
        emitted[(torch.arange(batch),) + tuple(drafts[:, :tau].T)] = outcome_law[:, tau]
        continued = emitted if continued is None else continued.unsqueeze(-1) * P[tau] + emitted
    return continued


def continued_law(outcome_law: torch.Tensor, drafts: torch.Tensor, weights: torch.Tensor, P: list) -> torch.Tensor:
    """§6 step 4: mix the continued per-draft laws with draft probabilities -> law over V^(γ+1)."""
    per_draft = continued_law_per_draft(outcome_law, drafts, P)
    return (weights.reshape((-1,) + (1,) * (per_draft.dim() - 1)) * per_draft).sum(0)


def draft_weights(Q: list, drafts: torch.Tensor) -> torch.Tensor:
    q_rows = rows_along(Q, drafts)
    return q_rows.gather(-1, drafts.unsqueeze(-1)).squeeze(-1).prod(dim=-1)


def mixed_law_and_length(law_fn, P: list, Q: list) -> tuple[torch.Tensor, float]:
    """Law over V^(γ+1) after one sampled-draft step + continuation, and E[tokens/step]."""
    gamma, V = len(Q), P[0].shape[-1]
    drafts = all_drafts(V, gamma)
    weights = draft_weights(Q, drafts)
    law = law_fn(drafts, rows_along(Q, drafts), rows_along(P, drafts))
    lengths = torch.arange(1, gamma + 2, dtype=F64)
    expected_tokens = float((weights * (law.sum(-1) * lengths).sum(-1)).sum())
    return continued_law(law, drafts, weights, P), expected_tokens


CHAIN_LAWS = {
    "tokenwise": tokenwise_outcome_law,
    "block": block_outcome_law,
    "hsd_capped": HSDVerifier("capped").outcome_law,
}


def uncapped_law(x: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    return block_outcome_law(x, q, p, final_ratio="uncapped")


CONFIGS = [(V, gamma) for V in (2, 3, 4) for gamma in (1, 2, 3, 4)]
KINDS = ["dirichlet", "onehot", "identical", "zeros"]


# ---------------------------------------------------------------------------------------------------------
# Exact enumeration (§6 steps 1–6)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("V,gamma", CONFIGS)
def test_sampled_drafts_are_exact(V: int, gamma: int, kind: str) -> None:
    P, Q = make_toy_lm(V, gamma, seed=100 * V + 10 * gamma + KINDS.index(kind), kind=kind)
    joint = target_joint(P)
    expected = {}
    for name, law_fn in CHAIN_LAWS.items():
        law, expected[name] = mixed_law_and_length(law_fn, P, Q)
        err = (law - joint).abs().max().item()
        assert err < 1e-12, f"{name}: max |law - target| = {err:.3e}"
    # §6 step 6: block is optimal, so it never accepts less than tokenwise; HSD capped is block.
    assert expected["tokenwise"] <= expected["block"] + 1e-12
    assert expected["block"] == pytest.approx(expected["hsd_capped"], abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("V,gamma", CONFIGS)
def test_deterministic_drafts_are_exact_for_every_draft(V: int, gamma: int, kind: str) -> None:
    # A deterministic draft is a point mass, so EVERY single draft must already reproduce the target law.
    P, _ = make_toy_lm(V, gamma, seed=7 + 100 * V + 10 * gamma + KINDS.index(kind), kind=kind)
    joint = target_joint(P)
    drafts = all_drafts(V, gamma)
    target_rows = rows_along(P, drafts)
    for name, law_fn in {**CHAIN_LAWS, "hsd_uncapped": uncapped_law}.items():
        law = law_fn(drafts, None, target_rows)
        errors = (continued_law_per_draft(law, drafts, P) - joint).abs().flatten(1).max(dim=1).values
        worst = int(errors.argmax())
        assert errors[worst] < 1e-12, (
            f"{name}, draft {drafts[worst].tolist()}: max |law - target| = {errors[worst]:.3e}"
        )


def test_hsd_capped_is_block_verification() -> None:
    P, Q = make_toy_lm(4, 4, seed=9)
    drafts = all_drafts(4, 4)
    q_rows, p_rows = rows_along(Q, drafts), rows_along(P, drafts)
    assert torch.equal(HSDVerifier().outcome_law(drafts, q_rows, p_rows), block.outcome_law(drafts, q_rows, p_rows))


def test_outcome_laws_are_distributions() -> None:
    P, Q = make_toy_lm(4, 4, seed=3, kind="zeros")
    drafts = all_drafts(4, 4)
    for law_fn in [*CHAIN_LAWS.values(), uncapped_law]:
        law = law_fn(drafts, rows_along(Q, drafts), rows_along(P, drafts))
        assert (law >= 0).all()
        assert_close(law.sum(dim=(-2, -1)), torch.ones(drafts.shape[0], dtype=F64), atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The hand fixture of §6 (V=2, γ=2)
# ---------------------------------------------------------------------------------------------------------


def hand_fixture() -> tuple[list, list]:
    P = [
        torch.tensor([0.6, 0.4], dtype=F64),
        torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=F64),
        torch.tensor([[[0.5, 0.5], [0.3, 0.7]], [[0.6, 0.4], [0.1, 0.9]]], dtype=F64),
    ]
    Q = [torch.tensor([0.8, 0.2], dtype=F64), torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=F64)]
    return P, Q


def test_hand_fixture_expected_tokens_and_laws() -> None:
    P, Q = hand_fixture()
    joint = target_joint(P)
    target_two = {(0, 0): 0.54, (0, 1): 0.06, (1, 0): 0.08, (1, 1): 0.32}
    for s, value in target_two.items():
        assert joint.sum(-1)[s].item() == pytest.approx(value, abs=1e-12)

    expected_tokens = {"tokenwise": 2.18, "block": 2.24, "hsd_capped": 2.24}
    for name, law_fn in CHAIN_LAWS.items():
        law, tokens = mixed_law_and_length(law_fn, P, Q)
        assert tokens == pytest.approx(expected_tokens[name], abs=1e-12), name
        assert (law - joint).abs().max().item() < 1e-12, name

    law, tokens = mixed_law_and_length(uncapped_law, P, Q)
    assert tokens == pytest.approx(2.28, abs=1e-12)
    first_two = law.sum(-1)
    expected_uncapped = {**target_two, (1, 0): 0.12, (1, 1): 0.28}
    for s, value in expected_uncapped.items():
        assert first_two[s].item() == pytest.approx(value, abs=1e-12), s
    assert 0.5 * (law - joint).abs().sum().item() == pytest.approx(0.04, abs=1e-12)


def test_hand_fixture_worked_draft() -> None:
    # Draft X = (1, 0): r = (1, 2, 0.8), r* = (1, 1, 0.4); h = (1, 1, 0.4) capped, h_2 = 0.8 uncapped.
    P, Q = hand_fixture()
    x = torch.tensor([1, 0])
    q_rows, p_rows = rows_along(Q, x[None])[0], rows_along(P, x[None])[0]
    capped = block_plan(x, q_rows, p_rows)
    assert_close(capped.stop_probs, torch.tensor([1.0, 1.0, 0.4], dtype=F64), atol=1e-15)
    assert_close(capped.residuals[1], torch.tensor([0.0, 1.0], dtype=F64), atol=0)
    uncapped = block_plan(x, q_rows, p_rows, final_ratio="uncapped")
    assert uncapped.stop_probs[-1].item() == pytest.approx(0.8, abs=1e-15)
    # Capped: (1, 0, ·) with probability 0.4, (1, 1) with probability 0.6.
    law = capped.outcome_law()
    assert law[2].sum().item() == pytest.approx(0.4, abs=1e-15)
    assert law[1, 1].item() == pytest.approx(0.6, abs=1e-15)


# ---------------------------------------------------------------------------------------------------------
# HSD uncapped: lossy (regression), warns
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("V,gamma,seed", [(2, 2, 0), (3, 2, 1), (3, 3, 2), (4, 3, 0), (2, 4, 1)])
def test_hsd_uncapped_is_not_exact(V: int, gamma: int, seed: int) -> None:
    P, Q = make_toy_lm(V, gamma, seed=seed)
    joint = target_joint(P)
    law, uncapped_tokens = mixed_law_and_length(uncapped_law, P, Q)
    assert 0.5 * (law - joint).abs().sum().item() > 1e-3
    _, block_tokens = mixed_law_and_length(block_outcome_law, P, Q)
    assert uncapped_tokens > block_tokens  # the bias buys extra acceptance that no exact verifier can get


def test_hsd_uncapped_warns_once_per_construction() -> None:
    with pytest.warns(LossyVerifierWarning, match="lossy"):
        verifier = HSDVerifier(final_ratio="uncapped")
    assert not verifier.lossless
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P, Q = hand_fixture()
        x = torch.tensor([1, 0])
        verifier(x, rows_along(Q, x[None])[0], rows_along(P, x[None])[0], torch.Generator().manual_seed(0))
        assert HSDVerifier().lossless and HSDVerifier("capped").lossless  # capped: silent


# ---------------------------------------------------------------------------------------------------------
# Registry, shapes, edge cases
# ---------------------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert isinstance(get_verifier("tokenwise"), TokenwiseVerifier)
    assert isinstance(get_verifier("block"), BlockVerifier)
    assert get_verifier("hsd").final_ratio == "capped"
    with pytest.warns(LossyVerifierWarning):
        assert get_verifier("hsd", final_ratio="uncapped").final_ratio == "uncapped"
    with pytest.raises(ValueError, match="valid names: tokenwise, block, hsd"):
        get_verifier("typical")
    with pytest.raises(ValueError, match="final_ratio"):
        get_verifier("hsd", final_ratio="half")


def test_bad_shapes_raise() -> None:
    p = torch.full((3, 4), 0.25, dtype=F64)
    with pytest.raises(ValueError, match="target_probs"):
        block(torch.tensor([0, 1, 2]), None, p)
    with pytest.raises(ValueError, match="draft_probs"):
        tokenwise(torch.tensor([0, 1]), torch.full((2, 5), 0.2, dtype=F64), p)
    with pytest.raises(ValueError, match="1-D"):
        tokenwise(torch.tensor([[0, 1]]), None, p[None])


@pytest.mark.parametrize("verifier", [tokenwise, block, hsd], ids=["tokenwise", "block", "hsd"])
def test_empty_draft_emits_one_target_token(verifier) -> None:
    p = torch.tensor([[0.0, 1.0, 0.0]], dtype=F64)
    result = verifier(torch.zeros(0, dtype=torch.long), None, p, torch.Generator().manual_seed(0))
    assert result == VerifyResult(0, result.tokens) and result.tokens.tolist() == [1]


def test_default_generator_is_allowed() -> None:
    P, Q = hand_fixture()
    x = torch.tensor([0, 1])
    result = tokenwise(x, rows_along(Q, x[None])[0], rows_along(P, x[None])[0])
    assert len(result.tokens) == result.num_accepted + 1
    assert multi_candidate([1], P[0]).token in (0, 1)


def test_zero_mass_residual_falls_back_to_target_row() -> None:
    # q = p: the residual max(0, r*·p − q) has no mass; a stop there could only come from round-off.
    P, _ = make_toy_lm(3, 2, seed=5)
    x = torch.tensor([2, 1])
    p_rows = rows_along(P, x[None])[0]
    for plan in (tokenwise_plan(x, p_rows[:-1], p_rows), block_plan(x, p_rows[:-1], p_rows)):
        assert_close(plan.residuals, p_rows, atol=0)
    assert_close(tokenwise_plan(x, p_rows[:-1], p_rows).stop_probs[:-1], torch.zeros(2, dtype=F64))


def test_zero_draft_probability_stays_finite() -> None:
    # A token with q(x) = 0 cannot be drafted; the law must still be a finite distribution.
    x = torch.tensor([0, 1])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=F64)
    p = torch.tensor([[0.5, 0.5], [0.2, 0.8], [0.3, 0.7]], dtype=F64)
    for law_fn in [*CHAIN_LAWS.values(), uncapped_law]:
        law = law_fn(x, q, p)
        assert torch.isfinite(law).all() and law.sum().item() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Greedy: exactly the target's argmax continuation
# ---------------------------------------------------------------------------------------------------------


def test_greedy_target_gives_greedy_tokens() -> None:
    V, gamma = 5, 4
    gen = torch.Generator().manual_seed(0)
    for trial in range(25):
        target_argmax = torch.randint(V, (gamma + 1,), generator=gen)
        target_probs = torch.nn.functional.one_hot(target_argmax, V).to(F64)
        draft = torch.where(
            torch.rand(gamma, generator=gen) < 0.7,
            target_argmax[:gamma],
            torch.randint(V, (gamma,), generator=gen),
        )
        draft_probs = torch.softmax(torch.randn(gamma, V, generator=gen, dtype=F64), -1)
        leading = int(torch.cumprod((draft == target_argmax[:gamma]).long(), 0).sum())
        expected = target_argmax[: leading + 1].tolist()
        for verifier in (tokenwise, block, hsd):
            for q in (draft_probs, None):
                rng = torch.Generator().manual_seed(trial)
                state = rng.get_state()
                result = verifier(draft, q, target_probs, rng)
                assert result.num_accepted == leading and result.tokens.tolist() == expected
                assert torch.equal(rng.get_state(), state), "greedy verification must not consume randomness"


# ---------------------------------------------------------------------------------------------------------
# Implementation-level Monte Carlo (§6 step 7): the sampling path follows the exact law
# ---------------------------------------------------------------------------------------------------------


def assert_within_4_sigma(counts: torch.Tensor, law: torch.Tensor, n: int, label: str) -> None:
    empirical = counts.to(F64) / n
    sigma = (law * (1 - law) / n).sqrt()
    excess = (empirical - law).abs() - 4 * sigma - 1e-12
    assert (excess <= 0).all(), f"{label}: empirical {empirical.tolist()} vs exact {law.tolist()}"


@pytest.mark.parametrize(
    "verifier", [tokenwise, block, HSDVerifier("capped")], ids=["tokenwise", "block", "hsd_capped"]
)
def test_monte_carlo_matches_exact_law(verifier) -> None:
    V, gamma, n = 3, 3, 20_000
    P, Q = make_toy_lm(V, gamma, seed=11)
    gen = torch.Generator().manual_seed(1234)
    for draft in ([0, 1, 2], [2, 2, 0], [1, 0, 1]):
        x = torch.tensor(draft)
        q_rows, p_rows = rows_along(Q, x[None])[0], rows_along(P, x[None])[0]
        for q in (q_rows, None):
            plan = verifier.plan(x, q, p_rows)
            tau, token = plan.draw(gen, num_samples=n)
            counts = torch.bincount(tau * V + token, minlength=(gamma + 1) * V).reshape(gamma + 1, V)
            assert_within_4_sigma(counts, plan.outcome_law(), n, f"{verifier!r} draft {draft}")


@pytest.mark.parametrize("verifier", [tokenwise, block], ids=["tokenwise", "block"])
def test_verifier_call_is_the_planned_draw(verifier) -> None:
    # The MC test above samples through plan.draw; the public call must be that same draw.
    P, Q = make_toy_lm(4, 3, seed=2)
    x = torch.tensor([3, 0, 1])
    q_rows, p_rows = rows_along(Q, x[None])[0], rows_along(P, x[None])[0]
    for seed in range(30):
        result = verifier(x, q_rows, p_rows, torch.Generator().manual_seed(seed))
        tau, token = verifier.plan(x, q_rows, p_rows).draw(torch.Generator().manual_seed(seed))
        assert result.num_accepted == int(tau) and result.tokens.tolist() == x[: int(tau)].tolist() + token.tolist()


def test_verifier_calls_follow_exact_law() -> None:
    V, gamma, n = 2, 2, 1_500
    P, Q = hand_fixture()
    x = torch.tensor([1, 0])
    q_rows, p_rows = rows_along(Q, x[None])[0], rows_along(P, x[None])[0]
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(gamma + 1, V, dtype=torch.long)
    for _ in range(n):
        result = block(x, q_rows, p_rows, gen)
        counts[result.num_accepted, result.tokens[-1]] += 1
    assert_within_4_sigma(counts, block_outcome_law(x, q_rows, p_rows), n, "block calls")


# ---------------------------------------------------------------------------------------------------------
# Multi-candidate and tree walk
# ---------------------------------------------------------------------------------------------------------


def test_multi_candidate_emits_target_law() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=F64)
    candidates = [0, 1]  # the example of docs/algorithms/specbranch.md §12 item 2, where the public rule is biased
    gen = torch.Generator().manual_seed(0)
    n = 6_000
    token_counts = torch.zeros(4, dtype=torch.long)
    survivor_counts = torch.zeros(3, dtype=torch.long)  # candidate 0, candidate 1, none
    for _ in range(n):
        match = multi_candidate(candidates, p, gen)
        token_counts[match.token] += 1
        survivor_counts[2 if match.candidate_index is None else match.candidate_index] += 1
        assert match.candidate_index is None or candidates[match.candidate_index] == match.token
    assert_within_4_sigma(token_counts, p, n, "emitted token")
    assert_within_4_sigma(survivor_counts, torch.tensor([0.5, 0.3, 0.2], dtype=F64), n, "survivor")


def test_multi_candidate_greedy() -> None:
    p = torch.tensor([0.0, 0.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert multi_candidate(torch.tensor([3, 2]), p, gen).candidate_index == 1
    match = multi_candidate([0, 1], p, gen)
    assert match.candidate_index is None and match.token == 2
    assert torch.equal(gen.get_state(), state)


def tree_target_rows(P: list, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Row 0 = root distribution; row i+1 = distribution after node i's path."""

    def path(node: int) -> tuple[int, ...]:
        return () if node < 0 else path(parents[node]) + (tokens[node],)

    return torch.stack([P[0]] + [P[len(path(i))][path(i)] for i in range(len(tokens))])


def random_tree(rng: np.random.Generator, V: int, depth: int, size: int) -> tuple[list[int], list[int]]:
    tokens, parents, depths = [], [], []
    for _ in range(size):
        options = [-1] + [i for i in range(len(tokens)) if depths[i] < depth]
        parent = int(rng.choice(options))
        used = {tokens[i] for i in range(len(tokens)) if parents[i] == parent}
        free = [v for v in range(V) if v not in used]
        if not free:
            continue
        tokens.append(int(rng.choice(free)))
        parents.append(parent)
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return tokens, parents


def law_dict_continued(law: dict, P: list) -> torch.Tensor:
    """Continue each emitted sequence to length len(P) with target conditionals."""
    V, length = P[0].shape[-1], len(P)
    continued = None
    for ell in range(1, length + 1):
        emitted = torch.zeros((V,) * ell, dtype=F64)
        for seq, w in law.items():
            if len(seq) == ell:
                emitted[seq] += w
        continued = emitted if continued is None else continued.unsqueeze(-1) * P[ell - 1] + emitted
    return continued


@pytest.mark.parametrize("kind", ["dirichlet", "onehot", "zeros"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_walk_law_is_target(seed: int, kind: str) -> None:
    V, depth = 3, 3  # node depth 0..2, so emitted sequences have length 1..4
    P, _ = make_toy_lm(V, depth, seed=seed, kind=kind)
    rng = np.random.default_rng(seed)
    tokens, parents = random_tree(rng, V, depth - 1, size=9)
    law = tree_walk_law(tokens, parents, tree_target_rows(P, tokens, parents))
    first_token = torch.zeros(V, dtype=F64)
    for seq, w in law.items():
        first_token[seq[0]] += w
    assert (first_token - P[0]).abs().max().item() < 1e-12
    assert (law_dict_continued(law, P) - target_joint(P)).abs().max().item() < 1e-12


def test_tree_walk_greedy_follows_argmax_path() -> None:
    V, depth = 4, 3
    for seed in range(20):
        P, _ = make_toy_lm(V, depth, seed=seed)
        greedy = [torch.nn.functional.one_hot(t.argmax(-1), V).to(F64) for t in P]
        tokens, parents = random_tree(np.random.default_rng(seed), V, depth - 1, size=12)
        rows = tree_target_rows(greedy, tokens, parents)
        # The target's greedy continuation, then the deepest tree path that spells its prefix.
        greedy_seq = []
        for t in range(depth + 1):
            greedy_seq.append(int(P[t][tuple(greedy_seq)].argmax()))
        expected_path, node = [], -1
        for token in greedy_seq:
            child = [i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token]
            if not child:
                break
            node = child[0]
            expected_path.append(node)
        gen = torch.Generator().manual_seed(0)
        state = gen.get_state()
        result = tree_walk(tokens, parents, rows, gen)
        assert result.path == expected_path
        assert result.tokens.tolist() == greedy_seq[: len(expected_path) + 1]
        assert torch.equal(gen.get_state(), state)


def test_tree_walk_samples_follow_exact_law() -> None:
    V, depth, n = 3, 3, 2_500
    P, _ = make_toy_lm(V, depth, seed=21)
    tokens, parents = [0, 1, 2, 1, 0, 2], [-1, -1, 0, 0, 2, 1]
    rows = tree_target_rows(P, tokens, parents)
    law = tree_walk_law(tokens, parents, rows)
    outcomes = sorted(law)
    index = {seq: i for i, seq in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=torch.long)
    gen = torch.Generator().manual_seed(5)
    for _ in range(n):
        result = tree_walk(tokens, parents, rows, gen)
        emitted = tuple(result.tokens.tolist())
        assert emitted[:-1] == tuple(tokens[i] for i in result.path) and result.num_accepted == len(result.path)
        counts[index[emitted]] += 1
    assert_within_4_sigma(counts, torch.tensor([law[s] for s in outcomes], dtype=F64), n, "tree walk")


def test_tree_walk_bad_input_raises() -> None:
    rows = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="parent"):
        tree_walk([0, 1], [-1, 5], rows)
    with pytest.raises(ValueError, match=r"target_probs \[N\+1, V\]"):
        tree_walk([0, 1], [-1, 0], rows[:2])
