"""Tree strategies on the engine loop (EAGLE-3 trees and chains): requests run side by side, each in its own row,
get exactly the tokens and counters of the same request run alone, greedy and seeded, prefill apart and in place, as
``tests/test_engine_loop.py`` checks for chains. Each row's tree is scored under its own ancestor mask in the step's
one padded target forward and committed per row; the drafter is row-exact (``set_row_exact``), so a row's trees do
not depend on its neighbours either."""

from __future__ import annotations

import copy

import pytest
import torch
from test_algorithms import tiny_llama
from test_eagle3_tree import random_drafter
from test_engine_loop import (after_a_failing_forward, alone_and_side_by_side, counters, runner_of, side_by_side, solo,
                              stream_consumer)
from test_engine_loop import jobs as loop_jobs

from inference.algorithms import build_algorithm
from inference.engine.state import Failed
from inference.runner import ModelRunner

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
    return loop_jobs(VOCAB)


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
@pytest.mark.parametrize("name", list(TREES))
def test_each_tree_request_gets_the_tokens_and_counters_of_its_run_alone(models, name, spare):
    expected = alone_and_side_by_side(algorithm(name, models), algorithm(name, models, rows=3, spare=spare), jobs())
    accepted = sum(r.stats.accepted_draft_tokens for r in expected)
    assert accepted >= {"eagle3_tree": 10, "eagle3_chain": 4}[name]  # paths really are accepted (EOS comes early)


def test_a_failing_tree_row_ends_alone_and_a_failing_forward_fails_the_rows_in_flight(models):
    """Request 2's stream consumer raises at its third token: it fails, the others get their solo answers. Then a
    target forward that fails ends the rows in flight, and the engine serves the next requests as they run alone."""
    lone = algorithm("eagle3_tree", models)
    all_jobs = jobs()
    expected = [solo(lone, job) for job in all_jobs]
    events = side_by_side(algorithm("eagle3_tree", models, rows=3), all_jobs, rows=3,
                          on_tokens=stream_consumer(fails=2))
    assert isinstance(events[2], Failed) and "consumer gone" in str(events[2].error)
    assert all(events[k].result.tokens == expected[k].tokens for k in (0, 1, 3, 4, 5, 6))

    assert after_a_failing_forward(algorithm("eagle3_tree", models, rows=2), all_jobs) == [
        r.tokens for r in expected[2:4]]


def test_bf16_tree_rows_equal_their_runs_alone(models):
    """The same in bf16 (the target's exact mode and the row-exact drafter cover batched bf16 rows)."""
    target, drafter = models
    drafter = copy.deepcopy(drafter).to(torch.bfloat16)

    def bf16(rows: int):
        runner = ModelRunner.from_hf_model(target, max_batch_size=2 * rows, max_seq_len=160, dtype=torch.bfloat16)
        return build_algorithm("eagle3_tree", runner, drafter, **TREES["eagle3_tree"])

    expected = [solo(bf16(1), job) for job in jobs()]
    events = side_by_side(bf16(3), jobs(), rows=3)
    for k, want in enumerate(expected):
        assert events[k].result.tokens == want.tokens, f"request {k}"
        assert counters(events[k].result.stats) == counters(want.stats), f"request {k}"
