"""Tree strategies on the engine loop (EAGLE-3 trees and chains, SpecBlock trees): requests run side by side, each in its own row,
get exactly the tokens and counters of the same request run alone, greedy and seeded, prefill apart and in place, as
``tests/inference/test_engine_loop.py`` checks for chains. Each row's tree is scored under its own ancestor mask in the step's
one padded target forward and committed per row; the drafter is row-exact (``set_row_exact``), so a row's trees do
not depend on its neighbours either."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_targets import tiny_llama
from eagle3_tree_builders import random_drafter
from specblock_tree_builders import random_drafter as specblock_drafter
from engine_helpers import (
    after_a_failing_forward,
    alone_and_side_by_side,
    counters,
    runner_of,
    side_by_side,
    solo,
    stream_consumer,
)
from engine_helpers import jobs as loop_jobs

from inference.algorithms import build_algorithm
from inference.engine.state import Failed
from inference.runner import ModelRunner

VOCAB = 16
TREES = {
    "eagle3_tree": {"tree_depth": 3, "tree_topk": 3, "tree_total": 10},
    "eagle3_chain": {"tree_depth": 4, "tree_topk": 1, "tree_total": 5},
    "specblock_tree": {"width": 3, "budget": 12, "blocks": 3},
}
ALGORITHM = {"eagle3_tree": "eagle3_tree", "eagle3_chain": "eagle3_tree", "specblock_tree": "specblock_tree"}


@pytest.fixture(scope="module")
def models():
    """A sharp target over a small vocabulary and random row-exact drafters (EAGLE-3, SpecBlock K=2) over all of
    it: trees often keep a few tokens, not always."""
    target = tiny_llama(0, vocab=VOCAB, layers=3, temperature_scale=6.0)
    drafters = {
        "eagle3_tree": random_drafter(target, draft_vocab=VOCAB),
        "specblock_tree": specblock_drafter(target, draft_vocab=VOCAB, block_size=2),
    }
    for drafter in drafters.values():
        drafter.set_row_exact(True)
    return target, drafters


def algorithm(name: str, models, rows: int = 1, spare: bool = True):
    target, drafters = models
    built = build_algorithm(ALGORITHM[name], runner_of(target, rows, spare), drafters[ALGORITHM[name]], **TREES[name])
    assert built.target.exact
    return built


def jobs() -> list[tuple[list[int], int, object, int]]:
    return loop_jobs(VOCAB)


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
@pytest.mark.parametrize("name", list(TREES))
def test_each_tree_request_gets_the_tokens_and_counters_of_its_run_alone(models, name, spare):
    expected = alone_and_side_by_side(algorithm(name, models), algorithm(name, models, rows=3, spare=spare), jobs())
    accepted = sum(r.stats.accepted_draft_tokens for r in expected)
    assert (
        accepted >= {"eagle3_tree": 10, "eagle3_chain": 4, "specblock_tree": 5}[name]
    )  # paths really are accepted (EOS comes early)


@pytest.mark.parametrize("name", ["eagle3_tree", "specblock_tree"])
def test_a_failing_tree_row_ends_alone_and_a_failing_forward_fails_the_rows_in_flight(models, name):
    """Request 2's stream consumer raises at its third token: it fails, the others get their solo answers. Then a
    target forward that fails ends the rows in flight, and the engine serves the next requests as they run alone."""
    lone = algorithm(name, models)
    all_jobs = jobs()
    expected = [solo(lone, job) for job in all_jobs]
    events = side_by_side(algorithm(name, models, rows=3), all_jobs, rows=3, on_tokens=stream_consumer(fails=2))
    assert isinstance(events[2], Failed) and "consumer gone" in str(events[2].error)
    assert all(events[k].result.tokens == expected[k].tokens for k in (0, 1, 3, 4, 5, 6))

    assert after_a_failing_forward(algorithm(name, models, rows=2), all_jobs) == [r.tokens for r in expected[2:4]]


@pytest.mark.parametrize("name", ["eagle3_tree", "specblock_tree"])
def test_bf16_tree_rows_equal_their_runs_alone(models, name):
    """The same in bf16 (the target's exact mode and the row-exact drafter cover batched bf16 rows)."""
    target, drafters = models
    drafter = copy.deepcopy(drafters[name]).to(torch.bfloat16)

    def bf16(rows: int):
        runner = ModelRunner.from_hf_model(target, max_batch_size=2 * rows, max_seq_len=160, dtype=torch.bfloat16)
        return build_algorithm(name, runner, drafter, **TREES[name])

    expected = [solo(bf16(1), job) for job in jobs()]
    events = side_by_side(bf16(3), jobs(), rows=3)
    for k, want in enumerate(expected):
        assert events[k].result.tokens == want.tokens, f"request {k}"
        assert counters(events[k].result.stats) == counters(want.stats), f"request {k}"
