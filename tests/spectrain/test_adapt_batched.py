"""The serving-time adapter on requests side by side (the engine's rows, ``batch_size`` > 1): each request gets the
tokens of its run alone, each round is charged its request's share of the engine step, and each decision is the
right request's, fed back by a request that started after it. The server's side: tests/inference/test_serve.py."""

from __future__ import annotations

import pytest
import torch
from adapt_helpers import adapter_for, forcing_settings, specblock_drafter, tiny_pair
from engine_helpers import jobs, side_by_side, solo
from tiny_targets import GREEDY, runner

from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine
from inference.engine.state import Finished, RowRequest

ROWS = 3
TREE = {"tree_depth": 3, "tree_topk": 3, "tree_total": 10}


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


def eagle3(tiny, costs, name: str = "eagle3_tree", **settings):
    """EAGLE-3 (or SpecBlock) trees with ``adapt=bandit`` under forcing settings (the head arm; the costs measured
    once into the file ``costs``)."""
    target, drafter = tiny
    settings = forcing_settings(arms="head", cost_cache=str(costs), **settings)
    options = TREE
    if name == "specblock_tree":
        drafter, options = specblock_drafter(target), {"width": 3, "budget": 12}
    return build_algorithm(
        name, runner(target, rows=2 * ROWS), drafter, adapt="bandit", adapt_settings=settings, **options
    )


def four_jobs() -> list[tuple]:
    """Mixed prompts, greedy and seeded, one a one-token answer (no round, no decision)."""
    return [(prompt, min(budget, 8), sampling, seed) for prompt, budget, sampling, seed in jobs()[:4]]


@pytest.mark.parametrize("name", ["eagle3_tree", "specblock_tree"])
def test_requests_side_by_side_get_their_tokens_alone_while_the_adapter_learns(tiny, tmp_path, name):
    """Greedy, with an update after every request (the drafter changes under the rows in flight): every answer is
    AR's. Seeded, with an adapter that never updates: every answer is the request's own run alone, bitwise (the
    served drafter is row-exact). Each request's decision is logged under its key."""
    target, _ = tiny
    ar = build_algorithm("ar", runner(target))
    greedy = [(prompt, budget, GREEDY, seed) for prompt, budget, _, seed in four_jobs()]
    learning = eagle3(tiny, tmp_path / "costs.json", name)
    assert learning.drafter.row_exact
    events = side_by_side(learning, greedy, rows=ROWS)
    for k, job in enumerate(greedy):
        assert isinstance(events[k], Finished) and events[k].result.tokens == solo(ar, job).tokens, k
    rows = learning.adapter.log.rows
    assert {row["request"] for row in rows} == {str(k) for k, job in enumerate(greedy) if job[1] > 1}
    assert any(row["arm"] != "skip" and row["kept"] for row in rows)  # it did update, with rows in flight

    still = eagle3(tiny, tmp_path / "costs.json", name, prior=0.0)  # no update is ever worth it: the drafter stays
    events = side_by_side(still, four_jobs(), rows=ROWS)
    for k, job in enumerate(four_jobs()):
        assert events[k].result.tokens == solo(still, job).tokens, k
    assert {row["arm"] for row in still.adapter.log.rows} == {"skip"}


class Ticks:
    """A clock that moves one second a call: a step (propose's two calls, then ``accepted``'s) lasts 2 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_each_round_is_charged_its_requests_share_of_the_step(tiny, tmp_path):
    """3 requests of different budgets on 3 rows: a step of 2 s charges each row 2 s x its tree's rows / all the
    step's rows (a row alone: the whole 2 s), and a decision's ``iter_ratio`` is its request's mean charge per
    round over the target forward's measured seconds. Charging every row the whole step (its run alone's rule)
    would count each shared step once per row."""
    algorithm = eagle3(tiny, tmp_path / "costs.json", prior=0.0)
    strategy = algorithm.strategy()
    strategy.clock = Ticks()
    propose, widths = strategy.propose, []

    def recording(states):
        proposals = propose(states)
        widths.append({state.request.key: proposal.width for state, proposal in zip(states, proposals)})
        return proposals

    strategy.propose = recording
    queue = [RowRequest(k, prompt, budget, GREEDY, None) for k, (prompt, budget) in enumerate(zip(*JOBS))]
    DecodeEngine(algorithm.target, strategy, rows=ROWS).run(lambda: queue.pop(0) if queue else None, lambda e: None)
    assert max(len(step) for step in widths) == ROWS and min(len(step) for step in widths) == 1
    forward_s = algorithm.adapter.costs.target_forward_s
    for row in algorithm.adapter.log.rows:
        key = int(row["request"])
        charges = [2.0 * step[key] / sum(step.values()) for step in widths if key in step]
        assert row["iter_ratio"] == pytest.approx(sum(charges) / len(charges) / forward_s, rel=1e-12), key
    assert len(algorithm.adapter.log.rows) == ROWS


JOBS = ([[7, 1, 8, 2, 8], [3, 14, 15, 9, 2, 6], [5, 3, 5, 8, 9]], [6, 12, 24])


def test_a_decision_is_fed_back_by_the_first_request_that_started_after_it(tiny):
    """x and y start together; the adapter updates after x (decision 0), z starts, y ends (decision 1), z ends
    (decision 2), w starts and ends. y ended after decision 0 but started before it served, so it feeds nothing
    back; z feeds back decision 0 only, w decisions 1 and 2. Served one at a time, each request would feed back the
    one before it."""
    _, drafter = tiny
    adapter, _ = adapter_for(drafter, min_gap=1)
    width, vocab = 3 * drafter.config.target_hidden_size, drafter.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def begin(query):
        features = torch.randn(5, width, generator=generator)
        adapter.begin_query(query, [1, 2, 3, 4, 5], features, torch.randn(vocab, generator=generator), max_accept=4)

    def round_of(query):
        features, logits = torch.randn(2, width, generator=generator), torch.randn(2, vocab, generator=generator)
        adapter.observe_round(query, [1, 2], features, logits, 1, None, 0.1)

    begin("x"), begin("y")
    round_of("x"), round_of("y")
    decided = [adapter.end_query("x", 3)]
    begin("z")
    round_of("y"), round_of("z")
    decided.append(adapter.end_query("y", 3))
    assert [row["arm"] for row in decided] == ["head", "head"] and adapter.bandit.pooled("head").count == 0
    assert "prev_arm" not in decided[1]  # y ran on the weights before decision 0
    round_of("z")
    after_z = adapter.end_query("z", 3)
    assert after_z["prev_arm"] == "head" and adapter.bandit.pooled("head").count == 1  # decision 0's feedback
    begin("w")
    round_of("w")
    adapter.end_query("w", 3)
    assert after_z["arm"] == "head" and adapter.bandit.pooled("head").count == 3  # decisions 1 and 2
    assert [row["request"] for row in adapter.log.rows] == ["x", "y", "z", "w"]
