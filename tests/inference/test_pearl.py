"""PEARL (docs/algorithms/specbranch.md §1): greedy equality with AR, the same tokens from every executor (its sampling law is checked in
test_sampling_laws.py)."""

from __future__ import annotations

import pytest
from pearl_helpers import PROMPT, ar_tokens, assert_executor_matches_sequential, tiny_pair
from tiny_targets import GREEDY, runner

from inference.algorithms import build_algorithm


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_pearl_greedy_equals_ar(pair, gamma):
    target, draft = pair
    pearl = build_algorithm("pearl", runner(target), runner(draft), gamma=gamma)
    result = pearl.generate(PROMPT, max_new_tokens=37, sampling=GREEDY)
    assert result.tokens == ar_tokens(target, 37)
    stats = result.stats
    assert stats.target_forwards == stats.rounds and stats.accepted_draft_tokens > 0
    assert stats.drafted_tokens == gamma * stats.rounds >= stats.accepted_draft_tokens
    if gamma > 1:  # pending segments were judged while more was drafted: fewer target calls than tokens
        assert stats.target_forwards < 37


def test_pearl_with_the_target_as_draft_accepts_every_judged_token(pair):
    target, _ = pair
    pearl = build_algorithm("pearl", runner(target), runner(target), gamma=3)
    result = pearl.generate(PROMPT, max_new_tokens=31, sampling=GREEDY)
    assert result.tokens == ar_tokens(target, 31)
    assert result.stats.acceptance_by_position == [1.0] * 3
    assert result.stats.rounds == 1 + (31 - 1 + 2) // 3  # one pre-verify round, then γ tokens per round


def test_extra_metrics_report_the_simulated_overlap_per_period(pair):
    target, draft = pair
    pearl = build_algorithm("pearl", runner(target), runner(draft), gamma=3)
    pearl.generate(PROMPT, max_new_tokens=20, sampling=GREEDY)
    first = pearl.extra_metrics()
    assert first["executor"] == "sequential" and first["overlap"]["rounds"] > 0
    overlap = first["overlap"]
    assert max(overlap["target_s"], overlap["draft_s"]) <= overlap["simulated_s"] + 1e-3
    assert first["simulated_tokens_per_s"] > 0
    assert pearl.extra_metrics()["overlap"]["rounds"] == 0  # a new period starts at each call


@pytest.mark.parametrize("name", ["cuda_streams", pytest.param("multiprocess", marks=pytest.mark.slow)])
def test_every_executor_gives_the_sequential_tokens(pair, name):
    """Same tokens at T=0 and, with one seeded generator, at T=1 (draft draws on the draft side's own stream)."""
    target, draft = pair
    assert_executor_matches_sequential(
        target,
        name,
        lambda executor, **kw: build_algorithm(
            "pearl", runner(target), runner(draft), gamma=3, executor=executor, **kw
        ),
        kmax=1,
    )


def test_bad_options_are_one_line_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        build_algorithm("pearl", runner(target), runner(draft), gamma=0)
    with pytest.raises(ValueError, match="unknown executor 'threads'; choose one of sequential"):
        build_algorithm("pearl", runner(target), runner(draft), executor="threads")
    with pytest.raises(ValueError, match="executor=multiprocess loads the draft LM in its own process"):
        build_algorithm("pearl", runner(target), runner(draft), executor="multiprocess")
    with pytest.raises(ValueError, match="needs a draft LM"):
        build_algorithm("pearl", runner(target))
