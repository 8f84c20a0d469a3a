"""Throughput-oriented autoregressive generation: many prompts at once, with continuous batching.

Regenerating training data is a throughput job, not a latency one: on a CPU a decode step over 16 rows costs
little more than over one (the weight matmuls are memory-bound), so answering 16 prompts side by side gives
several times the tokens/s of one-prompt AR. Rows are ragged (each holds its own prompt and answer in the
runner's per-row cache); a finished row is refilled with the next job as soon as enough rows are free.

A refill prefills only the new prompts: on a runner with spare rows (``ModelRunner`` built with
``max_batch_size >= 2 * batch_size``) they run in a block of spare rows (``row_block``) and are copied into
place (``copy_rows``). Otherwise one padded forward appends the active rows' next token and the new rows'
prompts together, which costs the whole batch times the widest prompt: on a CPU that made refills most of the
work (24 rows, 100-token prompts, 130-token answers).

In exact mode (``ModelRunner`` on a CPU, fp32 or bf16: ``inference.exactness``) a row's logits are bitwise those
of the same prompt run alone, whoever its neighbours are, so each answer, greedy or seeded, is one-prompt AR's
token for token (``tests/test_exact_batch.py``). Elsewhere (a GPU, the transformers backend, the approximate path)
a padded batch computes the same math in another summation order, and a near-tie in the logits may resolve
differently; ``benchmarks/regenerate_throughput.py`` counts the answers equal to AR's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from inference.sampling import SamplingParams, sample

PAD_ID = 0  # any valid id: padded positions are truncated away before anything attends to them


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


@dataclass
class _Row:
    job: Job
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    ended: bool = False  # finished or failed: the row is free for the next job


class ContinuousBatcher:
    """Answers jobs ``batch_size`` at a time. ``next_job()`` returns the next ready job or None (none ready now;
    a multi-turn caller makes a turn ready when the previous one finishes); ``on_done(job, tokens)`` gets each
    answer (EOS included if it ended there); the optional ``on_token(job, token)`` sees each token as it is
    sampled and ends that job there by returning False (its row is free for the next job at once).

    ``on_error(job, exc)``, if given, makes a failure of one job end only that job: a job that does not fit, or
    whose sampling, ``on_token`` or ``on_done`` raises, is handed to it and its row freed, while the other rows
    go on (a server must not fail its neighbours for one bad request). Without it the error ends the run. A
    failing forward fails every row and always ends the run.

    ``refill_at``: refill once this many rows are free (a refill is a wide forward, so batching the refills saves
    work; default a quarter of the batch). A refill writes the widest new prompt's width into every row, so it
    waits while the longest active row lacks that much room: a runner with spare rows prefills new prompts apart
    from the batch and never waits."""

    def __init__(self, runner, *, batch_size: int, eos_ids: Sequence[int], sampling: SamplingParams,
                 refill_at: int | None = None):
        if not 1 <= batch_size <= runner.max_batch_size:
            raise ValueError(f"batch_size={batch_size} but the runner holds {runner.max_batch_size} rows; build it "
                             "with max_batch_size >= batch_size")
        self.runner = runner
        self.batch_size = batch_size
        self.eos_ids = set(eos_ids)
        self.sampling = sampling
        self.refill_at = max(1, refill_at if refill_at is not None else batch_size // 4)
        self.forwards = 0
        self.new_tokens = 0

    @torch.no_grad()
    def run(self, next_job: Callable[[], Job | None], on_done: Callable[[Job, list[int]], None],
            on_token: Callable[[Job, int], bool | None] | None = None,
            on_error: Callable[[Job, Exception], None] | None = None) -> None:
        runner, size = self.runner, self.batch_size
        rows: list[_Row | None] = [None] * size
        runner.reset(size)
        pending = torch.full((size,), PAD_ID, dtype=torch.long)  # each active row's next input token
        held: list[Job] = []  # pulled, but their refill did not fit yet
        while True:
            free = [i for i, row in enumerate(rows) if row is None]
            active = size - len(free)
            fresh: dict[int, Job] = {}
            if free and (len(free) >= self.refill_at or active == 0):
                fresh = dict(zip(free, self._pull(len(free), next_job, held, on_error)))
            separate = fresh and self._can_prefill_apart(len(fresh))
            if fresh and active and not separate and not self._refill_fits(fresh):
                held = list(fresh.values()) + held  # wait until the longest rows finish
                fresh = {}
            if not fresh and active == 0:
                return
            if separate:  # the new rows' first tokens now; the active rows step on the next iteration
                logits = self._prefill_apart(rows, fresh)
                stepping = list(fresh)
            else:
                logits = self._refill(rows, fresh, pending) if fresh else self._step(rows, pending)
                stepping = [i for i, row in enumerate(rows) if row is not None]
            self.forwards += 1
            for i in stepping:
                row = rows[i]
                try:
                    self._advance(row, logits[i], on_done, on_token)
                except Exception as exc:
                    if on_error is None:
                        raise
                    row.ended = True
                    on_error(row.job, exc)
                if row.ended:
                    rows[i] = None
                else:
                    pending[i] = row.tokens[-1]

    def _pull(self, n: int, next_job: Callable[[], Job | None], held: list[Job],
              on_error: Callable[[Job, Exception], None] | None) -> list[Job]:
        """Up to ``n`` jobs that fit (held ones first); one that does not goes to ``on_error`` (or raises)."""
        jobs: list[Job] = []
        while len(jobs) < n:
            job = held.pop(0) if held else next_job()
            if job is None:
                break
            try:
                self._check(job)
            except ValueError as exc:
                if on_error is None:
                    raise
                on_error(job, exc)
                continue
            jobs.append(job)
        return jobs

    def _advance(self, row: _Row, logits: torch.Tensor, on_done: Callable[[Job, list[int]], None],
                 on_token: Callable[[Job, int], bool | None] | None) -> None:
        """Sample the row's next token; at its end (EOS, budget, ``on_token`` False) mark it ended and hand it on."""
        token = self._sample(logits, row)
        row.tokens.append(token)
        self.new_tokens += 1
        stopped = on_token is not None and on_token(row.job, token) is False
        if stopped or token in self.eos_ids or len(row.tokens) >= row.job.max_new_tokens:
            row.ended = True
            on_done(row.job, row.tokens)

    def _check(self, job: Job) -> None:
        if not job.ids or job.max_new_tokens < 1:
            raise ValueError(f"job {job.key!r}: needs a non-empty prompt and max_new_tokens >= 1")
        if len(job.ids) + job.max_new_tokens > self.runner.max_seq_len:
            raise ValueError(f"job {job.key!r}: prompt of {len(job.ids)} + {job.max_new_tokens} new tokens exceeds the "
                             f"runner's max_seq_len={self.runner.max_seq_len}")

    def _can_prefill_apart(self, n: int) -> bool:
        return hasattr(self.runner, "row_block") and self.batch_size + n <= self.runner.max_batch_size

    def _prefill_apart(self, rows: list[_Row | None], fresh: dict[int, Job]) -> dict[int, torch.Tensor]:
        """Prefill the new prompts in spare rows (right-padded, one forward), copy them into their rows; returns
        each new row's last-token logits."""
        runner, size, n = self.runner, self.batch_size, len(fresh)
        lengths = [len(job.ids) for job in fresh.values()]
        ids = torch.full((n, max(lengths)), PAD_ID, dtype=torch.long)
        for k, job in enumerate(fresh.values()):
            ids[k, :lengths[k]] = torch.tensor(list(job.ids))
        with runner.row_block(size, size + n):
            out = runner.forward(ids.to(runner.device), logit_rows=slice(0, 0), return_last_hidden=True)
        last = torch.tensor(lengths, device=runner.device) - 1
        hidden = out.last_hidden[torch.arange(n, device=runner.device), last]
        runner.copy_rows(range(size, size + n), list(fresh), lengths)
        for i, job in fresh.items():
            rows[i] = _Row(job)
        logits = runner.logits_from_hidden(hidden).cpu()
        return {i: logits[k] for k, i in enumerate(fresh)}

    def _refill_fits(self, fresh: dict[int, Job]) -> bool:
        """A refill writes ``width`` slots to every row (the runner's cache is rectangular), so the longest active
        row must have room for the widest new prompt."""
        width = max(len(job.ids) for job in fresh.values())
        return int(self.runner.cache_lens.max()) + width <= self.runner.max_seq_len

    def _sample(self, logits: torch.Tensor, row: _Row) -> int:
        sampling = row.job.sampling or self.sampling
        if sampling.greedy:
            return int(logits.argmax())
        if row.generator is None:
            row.generator = torch.Generator().manual_seed(row.job.seed)
        return int(sample(sampling.warp(logits), row.generator))

    def _step(self, rows: list[_Row | None], pending: torch.Tensor) -> torch.Tensor:
        """One decode step for every row up to the last active one (new jobs take the lowest free rows, so under a
        light load only the first few rows step: stepping all 8 rows for one request made SmolLM2 answers 2.3x slower,
        ``benchmarks/serve_load.py``; a runner without ``first_rows``, such as ``TransformersRunner``, steps every
        row); idle rows among them carry a pad token and are emptied again. Returns the logits of those rows
        (index = row)."""
        runner = self.runner
        idle = [row is None for row in rows]
        if any(idle):  # a full batch (the busy case) builds no mask and waits on no device
            runner.truncate(torch.where(torch.tensor(idle, device=runner.device), 0, runner.cache_lens))
        width = 1 + max(i for i, free in enumerate(idle) if not free)
        if width == len(rows) or not hasattr(runner, "first_rows"):
            return runner.forward(pending.view(-1, 1).to(runner.device)).logits[:, -1].float().cpu()
        with runner.first_rows(width):
            return runner.forward(pending[:width].view(-1, 1).to(runner.device)).logits[:, -1].float().cpu()

    def _refill(self, rows: list[_Row | None], fresh: dict[int, Job], pending: torch.Tensor) -> torch.Tensor:
        """One padded forward: active rows append their next token, fresh rows their whole prompt."""
        runner = self.runner
        lengths = runner.cache_lens.clone()
        width = max(len(job.ids) for job in fresh.values())
        ids = torch.full((self.batch_size, width), PAD_ID, dtype=torch.long)
        keep = torch.ones(self.batch_size, dtype=torch.long)  # new tokens each row keeps
        for i, row in enumerate(rows):
            if i in fresh:
                job = fresh[i]
                ids[i, :len(job.ids)] = torch.tensor(list(job.ids))
                keep[i] = len(job.ids)
                lengths[i] = 0
                rows[i] = _Row(job)
            elif row is None:
                keep[i] = 0
                lengths[i] = 0
            else:
                ids[i, 0] = pending[i]
        runner.truncate(lengths)
        # Logits only for each row's last kept token: an lm_head over every padded prompt row would cost about
        # as much as the decoder on a CPU.
        out = runner.forward(ids.to(runner.device), logit_rows=slice(0, 0), return_last_hidden=True)
        last = (keep - 1).clamp(min=0).to(runner.device)
        hidden = out.last_hidden[torch.arange(self.batch_size, device=runner.device), last]
        runner.truncate(lengths + keep.to(runner.device))
        return runner.logits_from_hidden(hidden).cpu()
