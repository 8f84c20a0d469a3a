"""Throughput-oriented autoregressive generation: many prompts at once, with continuous batching, on the engine loop
(``inference.engine.loop`` with the AR strategy): the job-queue interface ``data_prep.regenerate`` drives.

Regenerating training data is a throughput job, not a latency one: on a CPU a decode step over 16 rows costs
little more than over one (the weight matmuls are memory-bound), so answering 16 prompts side by side gives
several times the tokens/s of one-prompt AR. Rows are ragged (each holds its own prompt and answer in the
runner's per-row cache); a finished row is refilled with the next job as soon as enough rows are free.

A refill prefills only the new prompts: on a runner with spare rows (``ModelRunner`` built with
``max_batch_size >= 2 * batch_size``) they run in a block of spare rows (``row_block``) and are copied into
place (``copy_rows``); otherwise each new prompt runs in its own row alone. A runner without row views (the
``transformers`` fallback) answers one job at a time.

In exact mode (``ModelRunner`` on a CPU, fp32 or bf16: ``inference.exactness``) a row's logits are bitwise those
of the same prompt run alone, whoever its neighbours are, so each answer, greedy or seeded, is one-prompt AR's
token for token (``tests/inference/test_exact_batch.py``). Elsewhere (a GPU, the transformers backend, the approximate path)
a padded batch computes the same math in another summation order, and a near-tie in the logits may resolve
differently; ``benchmarks/regenerate_throughput.py`` counts the answers equal to AR's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from inference.engine.loop import DecodeEngine
from inference.engine.state import Failed, RowRequest
from inference.engine.strategy import Strategy
from inference.sampling import SamplingParams


@dataclass
class Job:
    """One answer to generate: ``ids`` is the rendered prompt, ``max_new_tokens`` its budget; ``key`` names it
    to the caller, and ``seed`` fixes its sampling stream (so a job samples the same tokens in any batch);
    ``sampling`` replaces the batcher's settings for this job (a server's requests each bring their own)."""

    key: Hashable
    ids: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    sampling: SamplingParams | None = None


class ContinuousBatcher:
    """Answers jobs ``batch_size`` at a time. ``next_job()`` returns the next ready job or None (none ready now;
    a multi-turn caller makes a turn ready when the previous one finishes); ``on_done(job, tokens)`` gets each
    answer (EOS included if it ended there); the optional ``on_token(job, token)`` sees each token as it is
    sampled and ends that job there by returning False (its row is free for the next job at once).

    ``on_error(job, exc)``, if given, makes a failure end only the jobs it touches: a job that does not fit, or
    whose seed, sampling, ``on_token`` or ``on_done`` raises, is handed to it and its row freed, while the other
    rows go on (a server must not fail its neighbours for one bad request); a failing forward hands every job in
    flight to it. Without it the first error ends the run."""

    def __init__(self, runner, *, batch_size: int, eos_ids: Sequence[int], sampling: SamplingParams):
        if not 1 <= batch_size <= runner.max_batch_size:
            raise ValueError(
                f"batch_size={batch_size} but the runner holds {runner.max_batch_size} rows; build it "
                "with max_batch_size >= batch_size"
            )
        self.engine = DecodeEngine(runner, Strategy(), rows=batch_size, eos_ids=eos_ids)
        self.batch_size = batch_size
        self.sampling = sampling
        self.new_tokens = 0

    @torch.no_grad()
    def run(
        self,
        next_job: Callable[[], Job | None],
        on_done: Callable[[Job, list[int]], None],
        on_token: Callable[[Job, int], bool | None] | None = None,
        on_error: Callable[[Job, Exception], None] | None = None,
    ) -> None:
        def fail(job: Job, exc: Exception) -> None:
            if on_error is None:
                raise exc
            on_error(job, exc)

        def next_request() -> RowRequest | None:
            while (job := next_job()) is not None:
                sampling = job.sampling or self.sampling
                try:
                    generator = None if sampling.greedy else torch.Generator().manual_seed(job.seed)
                except Exception as exc:  # noqa: BLE001 - a seed torch cannot take: this job fails alone
                    fail(job, exc)
                    continue
                return RowRequest(
                    job,
                    job.ids,
                    job.max_new_tokens,
                    sampling,
                    generator,
                    lambda new, job=job: self._tokens(job, new, on_token),
                )
            return None

        def on_event(event) -> None:
            if isinstance(event, Failed):
                fail(event.key, event.error)
                return
            try:
                on_done(event.key, event.result.tokens)
            except Exception as exc:  # noqa: BLE001 - handed on, or raised without on_error
                fail(event.key, exc)

        self.engine.run(next_request, on_event)

    @property
    def forwards(self) -> int:
        """Target forwards so far (prefills and decode steps)."""
        return self.engine.forwards

    def _tokens(self, job: Job, new: list[int], on_token: Callable[[Job, int], bool | None] | None) -> bool:
        self.new_tokens += len(new)
        if on_token is None:
            return True
        return all(on_token(job, token) is not False for token in new)
