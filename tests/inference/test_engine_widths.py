"""Width policies (inference.engine.widths): the cost model drafts where a wider step costs little and takes AR
steps where it costs as much as another request's token; either way output stays the target's (greedy = AR, seeded
AR steps = AR's own draws). The server's side: tests/inference/test_serve.py."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import algorithm, counters, jobs, solo, target_and_draft

from core.errors import UserError
from inference.engine.loop import DecodeEngine
from inference.engine.state import RowRequest
from inference.engine.widths import CostModelWidths, StepCosts, choose_widths, expected_tokens, measure_step_costs

LINEAR = StepCosts([1, 64], [1.0, 64.0], draft_s=0.5)  # a row costs as much as the next: drafting never pays
FLAT = StepCosts([1, 64], [1.0, 1.0], draft_s=0.0)  # rows are free: every row drafts as far as it may


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


def run(engine: DecodeEngine, job_list) -> dict:
    queue = [RowRequest(k, p, b, s, torch.Generator().manual_seed(seed)) for k, (p, b, s, seed) in enumerate(job_list)]
    events = {}
    engine.run(lambda: queue.pop(0) if queue else None, lambda e: events.setdefault(e.key, e))
    return events


def test_expected_tokens_and_the_greedy_choice():
    assert expected_tokens(0.5, 1) == 1 and expected_tokens(0.5, 3) == 1.75 and expected_tokens(1.0, 4) == 4
    assert choose_widths(LINEAR, [0.9, 0.5, 0.99], [5, 5, 5]) == [1, 1, 1]
    assert choose_widths(FLAT, [0.9, 0.5, 0.1], [5, 3, 5]) == [5, 3, 5]
    # A knee: 8 rows cost as much as 1, each row past them as much as a whole step. Four rows share the cheap
    # rows, the better accepted rows first.
    knee = StepCosts([1, 8, 16], [1.0, 1.0, 9.0])
    widths = choose_widths(knee, [0.9, 0.2, 0.6, 0.9], [5, 5, 5, 5])
    assert sum(widths) <= 9 and widths[0] == widths[3] >= widths[2] >= widths[1] >= 1 and max(widths) > 1
    assert knee.target(12) == 5.0 and knee.target(20) == 13.0 and knee.target(1) == 1.0


def test_where_rows_cost_what_tokens_do_every_step_is_an_ar_step_with_ars_tokens(models):
    """Linear costs: the policy picks width 1 for every row, so each request gets AR's own tokens, greedy and
    seeded (a width-1 step draws as AR does), one target forward a token."""
    ar = algorithm("ar", models)
    sps = algorithm("sps", models, rows=3)
    policy = CostModelWidths(LINEAR)
    events = run(DecodeEngine(sps.target, sps.strategy(), rows=3, width_policy=policy), jobs())
    for k, job in enumerate(jobs()):
        stats = events[k].result.stats
        assert events[k].result.tokens == solo(ar, job).tokens, k
        assert stats.target_forwards == stats.new_tokens and stats.rounds == 0
    assert policy.last_widths and set(policy.last_widths) == {1}


def test_where_rows_are_free_every_row_drafts_as_without_a_policy(models):
    """Flat costs: full widths, so tokens and counters equal the engine's without a policy, greedy and seeded."""
    sps = algorithm("sps", models, rows=3)
    plain = run(DecodeEngine(sps.target, sps.strategy(), rows=3), jobs())
    sps = algorithm("sps", models, rows=3)
    policed = run(DecodeEngine(sps.target, sps.strategy(), rows=3, width_policy=CostModelWidths(FLAT)), jobs())
    for k in plain:
        assert policed[k].result.tokens == plain[k].result.tokens, k
        assert counters(policed[k].result.stats) == counters(plain[k].result.stats), k


def test_measured_costs_grow_with_the_rows_scored_and_leave_the_caches_empty(models):
    sps = algorithm("sps", models, rows=2)
    strategy = sps.strategy()
    costs = measure_step_costs(sps.target, strategy.draft, 2, strategy.lookahead(), context=16, repeats=1)
    assert costs.tokens == [1, 2, 4, 8, 10] and all(s > 0 for s in costs.target_s) and costs.draft_s > 0
    assert int(sps.target.cache_lens.sum()) == 0 and int(strategy.draft.cache_lens.sum()) == 0
    with pytest.raises(UserError, match="not both"):
        DecodeEngine(sps.target, strategy, rows=2, max_step_tokens=4, width_policy=CostModelWidths(FLAT))
