"""How many target rows each running request is scored on in one engine step: its width, 1 + the tokens it drafts.

Speculation pays while a wider step costs little more than a narrow one; under load, on a host whose forward cost
grows with the rows it scores, it stops paying, and drafting then costs throughput. A width policy decides, before
each step, every row's ``state.width`` (the strategy drafts at most ``width - 1`` tokens; 1 is an AR step, still
lossless). Policies:

* :class:`StepBudget` (``max_step_tokens=N``): every row gets an equal share of N rows.
* :class:`CostModelWidths` (``width_policy=cost``): the widths that maximise the step's expected new tokens per
  second, from this host's measured costs (:func:`measure_step_costs`: seconds of a target forward by the rows it
  scores, and of one batched draft forward) and each row's acceptance so far. A row whose drafts position k is
  accepted with probability α emits ``1 + α + ... + α^(w-1)`` tokens in expectation at width w; the policy grows
  widths one token at a time, always the one that raises tokens per second most, and stops when none does.

Widths are chosen from the past only (costs measured before, acceptance of rounds already verified), so each round's
draft length is fixed before it is drafted and the verifier's proof holds: output stays lossless. A row's width then
depends on its neighbours, so its seeded tokens follow the target's law but are not the tokens of its run alone
(greedy tokens still are: they are the target's).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.engine.rows import forward_rows
from inference.engine.state import RowState


class WidthPolicy:
    """No policy: every row drafts what its strategy drafts (width 0 = no cap)."""

    name = "full"

    def prepare(self, target, draft, rows: int, max_width: int) -> None:
        """Before the engine's first step (its caches empty): measure what the policy needs."""

    def assign(self, states: Sequence[RowState], max_width: int) -> None:
        for state in states:
            state.width = 0

    def forget(self, state: RowState) -> None:
        """A row ended."""

    def describe(self) -> dict:
        """What ``/health`` and results report of the policy."""
        return {"width_policy": self.name}


class StepBudget(WidthPolicy):
    """One step scores at most ``tokens`` target rows: each running row gets an equal share (at least 1)."""

    name = "budget"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def assign(self, states: Sequence[RowState], max_width: int) -> None:
        for state in states:
            state.width = max(1, self.tokens // len(states))

    def describe(self) -> dict:
        return {"width_policy": self.name, "max_step_tokens": self.tokens}


@dataclass
class StepCosts:
    """Measured seconds of one target forward that scores ``tokens[i]`` rows in all (``target_s[i]``), and of one
    batched draft forward (``draft_s``, per drafted position; 0 without a draft runner)."""

    tokens: list[int]
    target_s: list[float]
    draft_s: float = 0.0

    def target(self, rows: int) -> float:
        """Seconds to score ``rows`` target rows: linear between the measured points, and past the last one."""
        points, seconds = self.tokens, self.target_s
        if rows <= points[0]:
            return seconds[0]
        i = min(bisect_left(points, rows), len(points) - 1)
        lo, hi = (i - 1, i)
        slope = (seconds[hi] - seconds[lo]) / (points[hi] - points[lo])
        return seconds[lo] + slope * (rows - points[lo])

    def as_dict(self) -> dict:
        return {
            "target_s_by_rows": dict(zip(self.tokens, [round(s, 6) for s in self.target_s])),
            "draft_s": round(self.draft_s, 6),
        }


def expected_tokens(acceptance: float, width: int) -> float:
    """New tokens a row emits in expectation at ``width`` when each drafted position is accepted with probability
    ``acceptance`` (given the ones before it): ``1 + α + ... + α^(width-1)``."""
    return float(sum(acceptance**k for k in range(width)))


class CostModelWidths(WidthPolicy):
    """Widths that maximise expected new tokens per second of a step (module docstring). ``costs`` None: measured
    by :meth:`prepare` on the engine's runners. A row's acceptance is its judged draft positions' rate so far,
    shrunk towards the rate of every row this policy has seen (``prior_weight`` positions' worth)."""

    name = "cost"

    def __init__(
        self, costs: StepCosts | None = None, *, prior_acceptance: float = 0.5, prior_weight: int = 8, context: int = 64
    ):
        self.costs, self.prior_acceptance, self.prior_weight, self.context = (
            costs,
            prior_acceptance,
            prior_weight,
            context,
        )
        self.judged, self.accepted = 0, 0  # over every row that has ended (their counters leave with them)
        self.last_widths: list[int] = []

    def prepare(self, target, draft, rows: int, max_width: int) -> None:
        if self.costs is None:
            self.costs = measure_step_costs(target, draft, rows, max_width, context=self.context)

    def pooled_acceptance(self, states: Sequence[RowState]) -> float:
        judged = self.judged + sum(sum(s.stats.attempted_at) for s in states)
        accepted = self.accepted + sum(sum(s.stats.accepted_at) for s in states)
        return (accepted + self.prior_weight * self.prior_acceptance) / (judged + self.prior_weight)

    def acceptance(self, state: RowState, pooled: float) -> float:
        judged, accepted = sum(state.stats.attempted_at), sum(state.stats.accepted_at)
        return (accepted + self.prior_weight * pooled) / (judged + self.prior_weight)

    def assign(self, states: Sequence[RowState], max_width: int) -> None:
        pooled = self.pooled_acceptance(states)
        rates = [self.acceptance(state, pooled) for state in states]
        caps = [max(1, min(max_width, state.out.remaining + 1)) for state in states]  # drafts <= tokens left
        widths = choose_widths(self.costs, rates, caps)
        for state, width in zip(states, widths):
            state.width = width
        self.last_widths = widths

    def forget(self, state: RowState) -> None:
        """A row ended: its counters join the pooled rate."""
        self.judged += sum(state.stats.attempted_at)
        self.accepted += sum(state.stats.accepted_at)

    def describe(self) -> dict:
        return {"width_policy": self.name, **(self.costs.as_dict() if self.costs else {"costs": "not measured yet"})}


def choose_widths(costs: StepCosts, acceptance: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Greedy: from width 1 everywhere, add one drafted token at a time to the row where it raises the step's
    expected tokens per second most; stop when no addition raises it. A row never exceeds its cap. Each addition
    is scored in O(1) (row i's next token adds ``α_i^w_i`` expected tokens and one target row), so a step of n rows
    costs O(n · added tokens), not a full re-sum per candidate."""
    widths = [1] * len(acceptance)
    expected, rows, widest = float(len(widths)), len(widths), 1  # sum of expected tokens, target rows, max width

    def rate(tokens: float, scored: int, wide: int) -> float:
        seconds = costs.target(scored) + costs.draft_s * (wide - 1)  # a batched draft forward per drafted position
        return tokens / max(seconds, 1e-12)

    best = rate(expected, rows, widest)
    while True:
        choice = None
        for i, (a, w, cap) in enumerate(zip(acceptance, widths, caps)):
            if w < cap:
                value = rate(expected + a**w, rows + 1, max(widest, w + 1))
                if choice is None or value > choice[0]:  # ties go to the earlier row
                    choice = (value, i)
        if choice is None or choice[0] <= best:
            return widths
        best, i = choice
        expected += acceptance[i] ** widths[i]
        widths[i] += 1
        rows, widest = rows + 1, max(widest, widths[i])


def measure_step_costs(target, draft, rows: int, max_width: int, *, context: int = 64, repeats: int = 3) -> StepCosts:
    """Time target forwards that score 1 .. ``rows * max_width`` rows (powers of two and the largest), each over
    ``rows`` rows holding ``context`` tokens, and one batched draft forward of ``rows`` rows (a token each); the
    median of ``repeats`` timings each. Leaves both runners' caches empty."""
    largest = rows * max_width
    points = sorted({1, largest, *(2**k for k in range(largest.bit_length()) if 2**k <= largest)})
    target_s = [_median_forward(target, rows, n, context, repeats) for n in points]
    draft_s = _median_forward(draft, rows, rows, context, repeats) if draft is not None else 0.0
    return StepCosts(points, target_s, draft_s)


def _median_forward(runner, rows: int, scored: int, context: int, repeats: int) -> float:
    """Median seconds of a forward that feeds ``scored`` tokens spread over ``rows`` rows (each holding ``context``
    tokens of cache), every fed row's logits scored; the cache is emptied after."""
    runner.reset(rows)
    context = max(1, min(context, runner.max_seq_len - scored - 1))
    forward_rows(runner, [[1] * context for _ in range(rows)], [[] for _ in range(rows)])
    held = runner.cache_lens.clone()
    share = [scored // rows + (1 if r < scored % rows else 0) for r in range(rows)]
    feeds = [[1] * n if n else [] for n in share]
    wanted = [list(range(n)) if n else [] for n in share]
    timings = []
    for _ in range(repeats + 1):  # the first call warms caches and allocators up; not counted
        started = time.perf_counter()
        forward_rows(runner, feeds, wanted)
        if torch.device(runner.device).type == "cuda":
            torch.cuda.synchronize(runner.device)
        timings.append(time.perf_counter() - started)
        runner.truncate(held)
    runner.reset(rows)
    return sorted(timings[1:])[len(timings[1:]) // 2]
