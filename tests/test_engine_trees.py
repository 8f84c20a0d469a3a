"""Tree strategies on the engine loop (EAGLE-3 trees and chains): requests run side by side, each in its own row,
get exactly the tokens and counters of the same request run alone, greedy and seeded, prefill apart and in place, as
``tests/test_engine_loop.py`` checks for chains. Each row's tree is scored under its own ancestor mask in the step's
one padded target forward and committed per row; the drafter is row-exact (``set_row_exact``), so a row's trees do
not depend on its neighbours either."""

from __future__ import annotations

import pytest
import torch
from test_algorithms import tiny_llama
from test_eagle3_tree import random_drafter
from test_engine_loop import GREEDY, SAMPLED, WARPED, counters, runner_of, side_by_side, solo

from inference.algorithms import build_algorithm

VOCAB = 16
TREES = {"eagle3_tree": {"tree_depth": 3, "tree_topk": 3, "tree_total": 10},
         "eagle3_chain": {"tree_depth": 4, "tree_topk": 1, "tree_total": 5}}


@pytest.fixture(scope="module")
def models():
    """A sharp target over a small vocabulary and a random row-exact drafter over all of it: trees often keep a
    few tokens, not always."""
    target = tiny_llama(0, vocab=VOCAB, layers=3, temperature_scale=6.0)
    drafter = random_drafter(target, draft_vocab=VOCAB)
    drafter.set_row_exact(True)
    return target, drafter


def algorithm(name: str, models, rows: int = 1, spare: bool = True):
    target, drafter = models
    built = build_algorithm("eagle3_tree", runner_of(target, rows, spare), drafter, **TREES[name])
    assert built.target.exact
    return built


def jobs() -> list[tuple[list[int], int, object, int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 1, 23, 9, 40, 2, 14)
    budgets = (24, 7, 31, 1, 18, 26, 12)
    settings = (GREEDY, SAMPLED, WARPED, SAMPLED, GREEDY, WARPED, SAMPLED)
    return [(torch.randint(0, VOCAB, (n,), generator=generator).tolist(), budget, sampling, 100 + k)
            for k, (n, budget, sampling) in enumerate(zip(lengths, budgets, settings))]


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
@pytest.mark.parametrize("name", list(TREES))
def test_each_tree_request_gets_the_tokens_and_counters_of_its_run_alone(models, name, spare):
    lone = algorithm(name, models)
    all_jobs = jobs()
    eos = solo(lone, all_jobs[0]).tokens[9]  # met early by some rows, inside accepted paths
    expected = [solo(lone, job, eos_ids=[eos]) for job in all_jobs]
    events = side_by_side(algorithm(name, models, rows=3, spare=spare), all_jobs, rows=3, eos_ids=[eos])
    for k, want in enumerate(expected):
        assert events[k].result.tokens == want.tokens, f"request {k}"
        assert counters(events[k].result.stats) == counters(want.stats), f"request {k}"
    accepted = sum(r.stats.accepted_draft_tokens for r in expected)
    assert accepted >= {"eagle3_tree": 10, "eagle3_chain": 4}[name]  # paths really are accepted (EOS comes early)
