"""Self-Draft on the engine loop: requests run side by side, each in its own row, get exactly the tokens and counters
of the same request run alone, greedy and seeded, prefill apart and in place, fp32 and bf16 (and under a step budget
the trees shrink, down to batched AR's tokens at width 1), as
``tests/inference/test_engine_loop.py`` checks for chains and ``tests/inference/test_engine_trees.py`` for drafter trees.

A row's drafts are its grid and its view of the context cache: a copy of the shared cache taken when the request
is admitted, plus its own grams (they go into the shared cache when it ends). So "its run alone" is the request run
alone from the cache its row was admitted with; the tokens do not depend on the cache at all."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import after_a_failing_forward, counters, jobs, side_by_side, solo, stream_consumer
from tiny_targets import tiny_llama

from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine
from inference.engine.state import Failed, Finished, RowRequest
from inference.runner import ModelRunner

VOCAB = 97
OPTIONS = {"branch_len": 5, "branch_num": 3}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=VOCAB, layers=2, temperature_scale=6.0)


def self_draft(target, rows: int = 1, spare: bool = True, dtype: torch.dtype = torch.float32):
    runner = ModelRunner.from_hf_model(target, max_batch_size=2 * rows if spare else rows, max_seq_len=160, dtype=dtype)
    built = build_algorithm("self_draft", runner, **OPTIONS)
    assert built.target.exact
    return built


def recording_admissions(algorithm) -> dict:
    """Make ``algorithm.strategy()`` record, per request key, a copy of the shared context cache as the request is
    admitted (what its row reads)."""
    taken = {}
    make = algorithm.strategy

    def strategy():
        built = make()
        admit = built.admit

        def recording(states, hidden):
            for state in states:
                taken[state.request.key] = algorithm.context.copy()
            admit(states, hidden)

        built.admit = recording
        return built

    algorithm.strategy = strategy
    return taken


def assert_alone_and_side_by_side(lone, batched) -> list:
    """The 7 jobs side by side on 3 rows with an EOS id some rows meet early; then each alone on ``lone`` from the
    cache its row was admitted with: same tokens, same counters. Returns the runs alone."""
    all_jobs = jobs(VOCAB)
    eos = solo(lone, all_jobs[0]).tokens[9]
    taken = recording_admissions(batched)
    events = side_by_side(batched, all_jobs, rows=3, eos_ids=[eos])
    expected = []
    for k, job in enumerate(all_jobs):
        lone.context = taken[k].copy()  # its end replays its grams into it
        want = solo(lone, job, eos_ids=[eos])
        expected.append(want)
        assert isinstance(events[k], Finished), events[k]
        assert events[k].result.tokens == want.tokens, f"request {k}"
        assert counters(events[k].result.stats) == counters(want.stats), f"request {k}"
    assert any(eos in r.tokens for r in expected)
    assert len(taken[0]) == 0 and len(taken[len(all_jobs) - 1]) > 0  # later rows read the grams of ended ones
    assert sum(r.stats.accepted_draft_tokens for r in expected) >= 15  # drafts really are accepted
    return expected


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
def test_each_request_gets_the_tokens_and_counters_of_its_run_alone(target, spare):
    assert_alone_and_side_by_side(self_draft(target), self_draft(target, rows=3, spare=spare))


def test_bf16_rows_equal_their_runs_alone(target):
    assert_alone_and_side_by_side(
        self_draft(target, dtype=torch.bfloat16), self_draft(target, rows=3, dtype=torch.bfloat16)
    )


def test_a_failing_row_ends_alone_and_a_failing_forward_fails_the_rows_in_flight(target):
    """Request 2's stream consumer raises at its third token: it fails, the others get their solo tokens. Then a
    target forward that fails (the first step, which reads the prompts) ends the rows in flight, and the engine
    serves the next requests as they run alone."""
    lone = self_draft(target)
    all_jobs = jobs(VOCAB)
    expected = [solo(lone, job).tokens for job in all_jobs]
    events = side_by_side(self_draft(target, rows=3), all_jobs, rows=3, on_tokens=stream_consumer(fails=2))
    assert isinstance(events[2], Failed) and "consumer gone" in str(events[2].error)
    assert all(events[k].result.tokens == expected[k] for k in (0, 1, 3, 4, 5, 6))
    assert after_a_failing_forward(self_draft(target, rows=2), all_jobs) == expected[2:4]


def run_with(algorithm, rows: int, **policy) -> dict:
    """The jobs side by side on ``rows`` rows under a width policy (``DecodeEngine``'s keywords)."""
    queue = [RowRequest(k, p, b, s, torch.Generator().manual_seed(seed)) for k, (p, b, s, seed) in enumerate(jobs())]
    events = {}
    DecodeEngine(algorithm.target, algorithm.strategy(), rows=rows, **policy).run(
        lambda: queue.pop(0) if queue else None, lambda event: events.setdefault(event.key, event)
    )
    return events


def test_under_a_one_row_step_budget_every_row_takes_batched_ars_tokens(target):
    """``max_step_tokens=1``: every row's width is 1, so its step proposes no node, an AR step: greedy and seeded,
    each request gets batched AR's tokens, one target forward a token."""
    ar = build_algorithm("ar", ModelRunner.from_hf_model(target, max_batch_size=6, max_seq_len=160))
    expected = side_by_side(ar, jobs(), rows=3)
    events = run_with(self_draft(target, rows=3), 3, max_step_tokens=1)
    for k in expected:
        stats = events[k].result.stats
        assert events[k].result.tokens == expected[k].result.tokens, k
        assert stats.target_forwards == stats.new_tokens and stats.rounds == stats.drafted_tokens == 0, k


def test_a_budget_squeezes_the_trees_losslessly_and_one_every_tree_fits_changes_nothing(target):
    """A budget of 12 rows a step (4 a row while 3 run): squeezed trees keep their first candidate nodes, the grid sits
    those steps out, and greedy
    answers are still the target's. A budget every tree fits in: the tokens and counters of no budget."""
    plain = side_by_side(self_draft(target, rows=3), jobs(), rows=3)
    tight = run_with(self_draft(target, rows=3), 3, max_step_tokens=3 * 4)
    roomy = self_draft(target, rows=3)
    fits = run_with(roomy, 3, max_step_tokens=3 * roomy.lookahead())
    for k, (_, _, sampling, _) in enumerate(jobs()):
        if not sampling.temperature:
            assert tight[k].result.tokens == plain[k].result.tokens, k
        assert fits[k].result.tokens == plain[k].result.tokens, k
        assert counters(fits[k].result.stats) == counters(plain[k].result.stats), k
    squeezed = [tight[k].result.stats for k in tight]
    assert sum(s.accepted_draft_tokens for s in squeezed) > 0  # candidates still get accepted
    assert sum(s.drafted_tokens for s in squeezed) < sum(plain[k].result.stats.drafted_tokens for k in plain)
