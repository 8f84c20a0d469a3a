"""The engine loop (inference.engine.loop): requests run side by side, each in its own row, get exactly the tokens
and counters of the same request run alone (``Algorithm.generate``, itself a one-row engine run), greedy and seeded,
whoever their neighbours are: rows are admitted as others end (prefill apart in spare rows, or in place), drafts are
ragged (a row near its budget drafts fewer tokens), some rows stop at EOS inside an accepted draft. On a CPU in exact
mode a row's logits do not depend on its neighbours (tests/inference/test_exact_batch.py), so equality is bitwise."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    GREEDY,
    VARIANTS,
    after_a_failing_forward,
    algorithm,
    alone_and_side_by_side,
    counters,
    jobs,
    runner_of,
    side_by_side,
    solo,
    stream_consumer,
    target_and_draft,
)

from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine
from inference.engine.state import Failed, Finished, RowRequest


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_request_gets_the_tokens_and_counters_of_its_run_alone(models, name, spare):
    expected = alone_and_side_by_side(algorithm(name, models), algorithm(name, models, rows=3, spare=spare), jobs())
    if name != "ar":
        assert sum(r.stats.accepted_draft_tokens for r in expected) > 20  # drafts really are accepted


def test_the_ar_strategy_equals_the_continuous_batcher_and_a_row_alone(models):
    """Greedy AR through the engine is the target's greedy decode (the old per-request loop's answer)."""
    target, _ = models
    prompt = [3, 1, 4, 1, 5]
    reference = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    tokens = solo(algorithm("ar", models), (prompt, 20, GREEDY, 0)).tokens
    assert tokens == reference[0, len(prompt) :].tolist()


def test_a_failing_callback_ends_its_request_alone(models):
    """Request 2's stream consumer raises at its third token: it fails, the others get their solo answers; a
    consumer that returns False ends its request there (a client that went away)."""
    lone = algorithm("sps", models)
    all_jobs = jobs()
    expected = [solo(lone, job) for job in all_jobs]
    events = side_by_side(
        algorithm("sps", models, rows=3), all_jobs, rows=3, on_tokens=stream_consumer(fails=2, stops=4)
    )
    assert isinstance(events[2], Failed) and "consumer gone" in str(events[2].error)
    assert isinstance(events[4], Finished) and 5 <= len(events[4].result.tokens) < len(expected[4].tokens)
    assert events[4].result.tokens == expected[4].tokens[: len(events[4].result.tokens)]
    for k in (0, 1, 3, 5, 6):
        assert events[k].result.tokens == expected[k].tokens


def test_a_failing_forward_fails_the_rows_in_flight_and_the_engine_goes_on(models):
    all_jobs = jobs()
    lone = algorithm("sps", models)
    assert after_a_failing_forward(algorithm("sps", models, rows=2), all_jobs) == [
        solo(lone, job).tokens for job in all_jobs[2:4]
    ]


def test_rows_must_fit_the_runner(models):
    alg = algorithm("ar", models, rows=2, spare=False)
    with pytest.raises(Exception, match="max_batch_size"):
        DecodeEngine(alg.target, alg.strategy(), rows=3)


def test_a_step_budget_of_one_token_a_row_makes_every_step_an_ar_step(models):
    """``max_step_tokens=1``: SpS drafts nothing and each request gets AR's own tokens, greedy and seeded (AR
    draws one sample a token from the row's generator, as a width-1 step does), one target forward a token."""
    ar = algorithm("ar", models)
    all_jobs = jobs()
    sps = algorithm("sps", models, rows=3)
    engine = DecodeEngine(sps.target, sps.strategy(), rows=3, max_step_tokens=1)
    queue = [RowRequest(k, p, b, s, torch.Generator().manual_seed(seed)) for k, (p, b, s, seed) in enumerate(all_jobs)]
    events = {}
    engine.run(lambda: queue.pop(0) if queue else None, lambda e: events.setdefault(e.key, e))
    for k, job in enumerate(all_jobs):
        stats = events[k].result.stats
        assert events[k].result.tokens == solo(ar, job).tokens, k
        assert stats.target_forwards == stats.new_tokens and stats.rounds == 0


@pytest.mark.parametrize("budget", [4, 7])
def test_a_squeezed_step_budget_stays_greedy_equal_to_ar(models, budget):
    """Widths shrink as rows share the budget (3 rows: 1 or 2 target rows each; a row alone: up to γ + 1), rows
    switch between drafting and AR steps, and the draft catches up on the tokens it skipped: greedy answers are still
    AR's, and drafts are still accepted."""
    ar = algorithm("ar", models)
    greedy = [(p, b, GREEDY, seed) for p, b, _, seed in jobs()]
    sps = algorithm("sps", models, rows=3)
    engine = DecodeEngine(sps.target, sps.strategy(), rows=3, max_step_tokens=budget)
    queue = [RowRequest(k, p, b, s, None) for k, (p, b, s, _) in enumerate(greedy)]
    events = {}
    engine.run(lambda: queue.pop(0) if queue else None, lambda e: events.setdefault(e.key, e))
    assert [events[k].result.tokens for k in range(len(greedy))] == [solo(ar, job).tokens for job in greedy]
    assert sum(events[k].result.stats.accepted_draft_tokens for k in events) > 0


@pytest.mark.parametrize("name", ["ar", "sps"])
def test_generate_batch_answers_each_prompt_as_alone(models, name):
    """``generate_batch`` (``inference.evaluate batch_size=N``): prompts side by side, greedy answers and counters
    those of each prompt alone, the batch's wall time split evenly."""
    lone = algorithm(name, models)
    greedy = [(p, b, GREEDY, seed) for p, b, _, seed in jobs()[:5]]
    batched = algorithm(name, models, rows=5).generate_batch(
        [p for p, *_ in greedy], max_new_tokens=14, sampling=GREEDY
    )
    for result, (prompt, _, _, seed) in zip(batched, greedy):
        alone = solo(lone, (prompt, 14, GREEDY, seed))
        assert result.tokens == alone.tokens and counters(result.stats) == counters(alone.stats)
    assert len({r.stats.wall_s for r in batched}) == 1
    with pytest.raises(Exception, match="answers one prompt at a time"):
        build_algorithm("pearl", lone.target, runner_of(models[1])).generate_batch(
            [[1]], max_new_tokens=2, sampling=GREEDY
        )
