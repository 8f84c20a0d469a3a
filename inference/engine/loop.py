"""The engine loop: every running request of one strategy steps together over one target runner.

A request gets a row (a slot of the target's KV cache and of every drafter cache) when it is admitted and gives it
back when it ends. Admission prefills the new prompts (in spare rows where the runner has them, so the running rows
are not stalled by a padded prefill) and takes each new row's first token (``Strategy.first``); for a
strategy that ``reads_prompt`` (Self-Draft, whose prefill verifies its first drafts) the prompt is the row's
pending tokens, read by its first step. A step asks the strategy for every row's drafts, scores all rows in ONE
target forward (ragged chains right-padded; a draft tree under its row's ancestor mask at positions
``committed + depth``), verifies per row, rolls each row back to what it kept (a chain: truncate; a tree:
``runner.commit`` of the root and the walked path), and reports the rows that ended. A strategy whose draft
work runs beside the target (an executor) runs the target forwards through ``Strategy.beside``.

``run_one`` is a request run alone: what ``Algorithm.generate`` is for every algorithm with a strategy, so a request
served beside others and the same request run alone share one code path. On a CPU in exact mode
(``inference.exactness``) a row's logits do not depend on its neighbours, so a request's tokens, greedy or seeded,
are those of its run alone (``tests/inference/test_engine_loop.py``).

Failures: a failing batched call (the drafter's proposals, the target forward) fails every row in flight, and the
engine serves the next requests; a failing verification or callback ends that row alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from core.errors import UserError
from inference.engine.rows import RowsOutput, forward_rows, prefill_rows
from inference.engine.state import (
    Failed,
    Finished,
    GenerationResult,
    GenerationStats,
    OutputBuffer,
    RowRequest,
    RowState,
    fit_problem,
)
from inference.engine.strategy import Strategy
from inference.engine.widths import StepBudget, WidthPolicy
from inference.row_logits import RowLogits
from inference.tree import DraftTree

Event = Finished | Failed


@dataclass
class _Verdict:
    """A step's verification: the rows that failed (events), each row's result (None: failed), and how each row
    is rolled back: ``keep`` (chains: a length per row) or ``kept`` (trees: indices of the step's feed per row)."""

    events: list[Event]
    results: list
    keep: torch.Tensor
    kept: list[list[int]]


class DecodeEngine:
    """Runs ``strategy`` for up to ``rows`` requests at once over ``target`` (a runner of at least ``rows`` rows;
    twice that lets new prompts prefill apart)."""

    def __init__(
        self,
        target,
        strategy: Strategy,
        *,
        rows: int = 1,
        eos_ids: Sequence[int] = (),
        max_seq_len: int | None = None,
        max_step_tokens: int = 0,
        width_policy: WidthPolicy | None = None,
    ):
        """``max_seq_len``: the context a request must fit in (default the target's; an algorithm's can be less,
        its draft LM's). ``width_policy`` (``inference.engine.widths``) sets each row's width before a step;
        ``max_step_tokens=N`` is short for ``StepBudget(N)``: one step scores at most N target rows, so the more
        requests run, the fewer tokens each drafts, down to none (an AR step, still lossless)."""
        if max_step_tokens < 0:
            raise UserError(f"max_step_tokens must be >= 0 (0 = no cap), got {max_step_tokens}")
        if max_step_tokens and width_policy is not None:
            raise UserError("give max_step_tokens or a width policy, not both")
        if not 1 <= rows <= target.max_batch_size:
            raise UserError(
                f"the engine needs 1..{target.max_batch_size} rows (the target runner's max_batch_size), "
                f"got {rows}; load the target with max_batch_size >= {max(rows, 1)}"
            )
        if rows > 1 and not hasattr(target, "row_block"):
            raise UserError(
                f"{type(target).__name__} serves one request at a time; use batch_size=1 or the native runner"
            )
        self.target, self.strategy, self.rows = target, strategy, rows
        self.eos_ids = tuple(eos_ids)
        self.max_seq_len = min(max_seq_len or target.max_seq_len, target.max_seq_len)
        self.width_policy = width_policy or (StepBudget(max_step_tokens) if max_step_tokens else WidthPolicy())
        self.forwards = 0  # target forwards so far: prefills and steps
        self.slots: list[RowState | None] = [None] * rows
        self._open = False

    # -- admission -------------------------------------------------------------------------------------------

    def free_rows(self) -> int:
        return sum(state is None for state in self.slots)

    @property
    def busy(self) -> bool:
        return any(state is not None for state in self.slots)

    def open(self) -> None:
        """Empty caches, every row free (a running request is dropped)."""
        self.width_policy.prepare(self.target, self.strategy.draft, self.rows, self.strategy.lookahead())
        self.target.reset(self.rows)
        self.strategy.open(self.rows)
        self.slots = [None] * self.rows
        self._open = True

    @torch.no_grad()
    def admit(
        self,
        requests: Sequence[RowRequest],
        *,
        outputs: Sequence[OutputBuffer] | None = None,
        stats: Sequence[GenerationStats] | None = None,
    ) -> list[Event]:
        """Prefill ``requests`` in free rows (at most ``free_rows()``) and take each one's first token. Returns
        the events of those that ended at once (a one-token budget, EOS, an error of their own)."""
        if not self._open:
            self.open()
        free = [row for row, state in enumerate(self.slots) if state is None]
        if len(requests) > len(free):
            raise ValueError(f"{len(requests)} requests but {len(free)} free rows")
        problems = [self._misfit(request) for request in requests]
        if any(problems):  # a request that cannot run fails alone, before it takes a row
            keep = [k for k, problem in enumerate(problems) if not problem]
            refused = [Failed(requests[k].key, UserError(problem)) for k, problem in enumerate(problems) if problem]
            return refused + (
                self.admit(
                    [requests[k] for k in keep],
                    outputs=[outputs[k] for k in keep] if outputs else None,
                    stats=[stats[k] for k in keep] if stats else None,
                )
                if keep
                else []
            )
        now = time.perf_counter()
        states = [
            RowState(
                req,
                row,
                outputs[k] if outputs else OutputBuffer(req.max_new_tokens, self.eos_ids, req.on_tokens),
                stats[k] if stats else GenerationStats(),
                now,
            )
            for k, (req, row) in enumerate(zip(requests, free))
        ]
        for state in states:
            self.slots[state.row] = state
        strategy = self.strategy
        if self.strategy.reads_prompt:
            return self._admit_unread(states)
        try:
            prefill = strategy.beside(
                states,
                lambda: prefill_rows(
                    self.target,
                    [s.row for s in states],
                    [list(s.request.prompt) for s in states],
                    capture_layers=strategy.capture_layers,
                    return_last_hidden=strategy.wants_last_hidden,
                ),
                prefill=True,
            )
        except Exception as exc:  # noqa: BLE001 - the new rows' batched prefill failed: they end, the rest goes on
            return [self._end(state, exc) for state in states]
        self.forwards += prefill.forwards
        events, going = [], []
        for state, logits in zip(states, prefill.logits):
            state.stats.target_forwards += 1
            try:
                state.first_logits = logits
                tokens = strategy.first(state, logits)
                state.out.extend(tokens)
                state.pending = [tokens[-1]]
            except Exception as exc:  # noqa: BLE001 - this request's own failure (sampling, its callback)
                events.append(self._end(state, exc))
                continue
            if state.out.done:
                events.append(self._end(state))
            else:
                going.append(state)
        if going:
            try:  # the drafter's prefill, once the first tokens are known (a feature drafter reads them)
                strategy.admit(going, [prefill.hidden[states.index(s)] for s in going])
            except Exception as exc:  # noqa: BLE001 - a batched drafter call: the new rows end
                events += [self._end(state, exc) for state in going]
        return events

    def _admit_unread(self, states: list[RowState]) -> list[Event]:
        """Admission for a strategy whose first step reads the prompt: the rows are emptied and their pending tokens
        are their prompts (their first step counts as their prefill)."""
        try:
            if hasattr(self.target, "row_block"):
                prefill_rows(self.target, [s.row for s in states], [[] for _ in states])  # empties the rows
            else:  # one row, no row views
                self.target.reset(1)
            for state in states:
                state.pending = list(state.request.prompt)
            self.strategy.admit(states, [{} for _ in states])
        except Exception as exc:  # noqa: BLE001 - a batched drafter call: the new rows end
            return [self._end(state, exc) for state in states]
        return []

    def _misfit(self, request: RowRequest) -> str:
        """Why ``request`` cannot run here ('' when it can)."""
        if not len(request.prompt):
            return "empty prompt: give at least one token"
        if request.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {request.max_new_tokens}"
        return fit_problem(len(request.prompt), request.max_new_tokens, self.strategy.lookahead(), self.max_seq_len)

    # -- one step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One round for every running row; returns the events of the rows that ended."""
        active = [state for state in self.slots if state is not None]
        if not active:
            return []
        strategy = self.strategy
        self.width_policy.assign(active, strategy.lookahead())
        try:
            proposals = strategy.propose(active)
            trees = any(proposal.tree is not None for proposal in proposals)
            span = 1 + max(state.row for state in active)  # rows after the last busy one sit out
            feeds: list[list[int] | None] = [None] * span
            wanted: list[range | None] = [None] * span
            row_trees: list[DraftTree | None] = [None] * span
            lazy = trees and strategy.lazy_tree_rows
            for state, proposal in zip(active, proposals):
                feeds[state.row] = state.pending + proposal.tokens
                wanted[state.row] = range(len(state.pending) - 1, len(feeds[state.row]))
                if proposal.tree is not None:
                    row_trees[state.row] = proposal.tree
                    wanted[state.row] = range(0) if lazy else wanted[state.row]
            verdict: list[_Verdict] = []

            def walk(scored: RowsOutput) -> list[list[int]]:
                """Trees: verify inside the forward's row view, which then commits each row's kept indices."""
                verdict.append(self._verify(active, proposals, scored, span))
                return verdict[0].kept

            scored = strategy.beside(
                active,
                lambda: forward_rows(
                    self.target,
                    feeds,
                    wanted,
                    capture_layers=strategy.capture_layers,
                    return_last_hidden=strategy.wants_last_hidden or lazy,
                    trees=row_trees if trees else None,
                    commit=walk if trees else None,
                ),
            )
            self.forwards += 1
        except Exception as exc:  # noqa: BLE001 - a batched call failed: every row in flight fails
            return [self._end(state, exc) for state in active]
        if not trees:
            verdict.append(self._verify(active, proposals, scored, span))
            self.target.truncate(verdict[0].keep)
        return self._accept(active, proposals, verdict[0])

    def _row_logits(self, state: RowState, proposal, scored: RowsOutput):
        """What ``verify`` reads for ``state``'s row: its logits, or a tree's rows (``RowLogits``)."""
        if proposal.tree is None:
            return scored.logits[state.row]
        width = len(state.pending) + len(proposal.tokens)
        if self.strategy.lazy_tree_rows:
            return RowLogits(
                scored.forward.last_hidden[state.row, len(state.pending) - 1 : width], self.target.logits_from_hidden
            )
        return RowLogits.computed(scored.logits[state.row])

    def _verify(self, active: list[RowState], proposals, scored: RowsOutput, span: int) -> _Verdict:
        """Verify every row and emit its tokens; a row that fails ends alone (its event)."""
        strategy = self.strategy
        verdict = _Verdict([], [], self.target.cache_lens.clone(), [[] for _ in range(span)])
        for state, proposal in zip(active, proposals):
            state.stats.target_forwards += 1
            pending = len(state.pending)
            verdict.kept[state.row] = list(range(pending + len(proposal.tokens)))  # a failed row: freed at release
            try:
                result = strategy.verify(state, proposal, self._row_logits(state, proposal, scored))
                strategy.count_round(state, proposal, result)
                strategy.verified(state, proposal, result, scored.forward, state.row)
                emitted = [int(t) for t in result.tokens]
                # the pending tokens and the accepted drafts stay cached; the last emitted token is pending
                verdict.keep[state.row] -= len(proposal.tokens) - result.num_accepted
                verdict.kept[state.row] = list(range(pending)) + (
                    [pending + node for node in result.path]
                    if proposal.tree is not None
                    else list(range(pending, pending + result.num_accepted))
                )
                state.out.extend(emitted)
                state.pending = [emitted[-1]]
            except Exception as exc:  # noqa: BLE001 - this row's verification or callback: it ends alone
                result = None
                verdict.events.append(Failed(state.request.key, exc))
            verdict.results.append(result)
        return verdict

    def _accept(self, active: list[RowState], proposals, verdict: _Verdict) -> list[Event]:
        """After the target's rows are rolled back: the drafter's rollback, then the rows that ended."""
        events, results = verdict.events, verdict.results
        try:
            self.strategy.accepted(active, proposals, results)
        except Exception as exc:  # noqa: BLE001 - the drafter's rollback failed: its rows cannot go on
            return events + [self._end(state, exc) for state, r in zip(active, results) if r is not None]
        for state, result in zip(active, results):
            if result is None:
                self._release(state)
            elif state.out.done:
                events.append(self._end(state))
        return events

    # -- ends ------------------------------------------------------------------------------------------------

    def _release(self, state: RowState) -> None:
        if self.slots[state.row] is state:
            self.slots[state.row] = None
            self.strategy.release(state)
            self.width_policy.forget(state)

    def _end(self, state: RowState, error: BaseException | None = None) -> Event:
        self._release(state)
        if error is not None:
            return Failed(state.request.key, error)
        state.stats.new_tokens = len(state.out.tokens)
        state.stats.wall_s = time.perf_counter() - state.started
        return Finished(state.request.key, GenerationResult(state.out.tokens, state.stats))

    # -- drivers ---------------------------------------------------------------------------------------------

    def run(self, next_request: Callable[[], RowRequest | None], on_event: Callable[[Event], None]) -> None:
        """Serve requests until ``next_request()`` has none and every row has ended: new requests are admitted
        whenever rows are free (FIFO), between steps; ``on_event`` gets each request's end."""
        while True:
            new: list[RowRequest] = []
            while len(new) < self.free_rows() and (request := next_request()) is not None:
                new.append(request)
            events = self.admit(new) if new else []
            if not new and not self.busy:
                return
            events += self.step()
            for event in events:
                on_event(event)

    def run_one(
        self, request: RowRequest, out: OutputBuffer | None = None, stats: GenerationStats | None = None
    ) -> GenerationResult:
        """``request`` alone, from an empty cache; its error, if any, is raised."""
        self.open()
        try:
            events = self.admit([request], outputs=[out] if out else None, stats=[stats] if stats else None)
            while not events:
                events = self.step()
        finally:
            self.slots = [None] * self.rows
        (event,) = events
        if isinstance(event, Failed):
            raise event.error
        return event.result

    def cancel(self, key: Hashable) -> bool:
        """End the running request ``key`` now (no event); False if it is not running."""
        for state in self.slots:
            if state is not None and state.request.key == key:
                self._release(state)
                return True
        return False

    def close(self) -> None:
        self.slots = [None] * self.rows
        self.strategy.close()
        self._open = False
