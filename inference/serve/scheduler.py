"""The bounded request queue and the worker thread that runs the engine.

One worker thread owns the engine (its runners and KV caches are not thread-safe). Requests wait in a queue of
at most ``max_queue``; one more is refused (the app answers 429). AR with ``batch_size`` > 1 decodes up to that
many requests side by side (``inference.batched_generation.ContinuousBatcher``: a finished or cancelled row is
refilled from the queue at once); every other algorithm serves one request at a time. A cancelled request
(its client went away, or a stop string was met) leaves the queue at once, or its row at the next token: the
engine's token callback returns False, so the algorithm ends the query through its normal path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference.algorithms.base import GenerationStats
from inference.batched_generation import ContinuousBatcher, Job
from inference.sampling import SamplingParams
from inference.serve.engine import ServedModel
from inference.serve.metrics import ServeMetrics
from inference.serve.text import TextAssembler

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The request queue holds ``max_queue`` requests already."""


@dataclass
class Chunk:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    finish_reason: str  # stop (EOS or a stop string) | length
    stats: GenerationStats  # the engine's counters for this request (tokens past a stop string included)
    completion_tokens: int


@dataclass
class Failed:
    message: str


class Generation:
    """One request on its way through the queue and the engine. The worker calls ``accept`` with each batch of
    new tokens and ``finish`` / ``fail`` at the end; ``send`` delivers the events to the client's handler
    (thread-safe)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, seed: int,
                 text: TextAssembler, send: Callable[[object], None], eos_ids: list[int], *, stream: bool = True):
        self.prompt_ids, self.max_tokens, self.sampling, self.seed = prompt_ids, max_tokens, sampling, seed
        self.text, self.send, self.eos_ids = text, send, set(eos_ids)
        # A non-streaming client needs its text only at the end: one event instead of one per token spares the
        # event loop a wake-up (and the engine's thread a GIL hand-over) per token.
        self.stream = stream
        self._held: list[Chunk] = []
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None

    def accept(self, new: list[int]) -> bool:
        """Hand new tokens to the client; False ends the generation (cancelled, or a stop string was met)."""
        if self.cancelled.is_set():
            return False
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.submitted
        delta, kept = self.text.feed(new)
        if delta or kept:
            self._deliver(Chunk(delta, list(new[:kept])))
        return not self.text.stopped

    def _deliver(self, chunk: Chunk) -> None:
        if self.stream:
            self.send(chunk)
        else:
            self._held.append(chunk)

    def finish(self, stats: GenerationStats) -> Finished:
        """Deliver the rest of the text; returns the end event, which the caller sends once it is counted."""
        tail = self.text.flush()
        if tail:
            self._deliver(Chunk(tail, []))
        if self._held:
            self.send(Chunk("".join(c.text for c in self._held), [t for c in self._held for t in c.token_ids]))
        tokens = self.text.tokens
        ended = self.text.stopped or bool(tokens and tokens[-1] in self.eos_ids)
        return Finished("stop" if ended else "length", stats, len(tokens))


def batched_stats(tokens: list[int], wall_s: float) -> GenerationStats:
    """A batched AR row's counters: one target forward (its prefill, then one decode step) per token."""
    return GenerationStats(new_tokens=len(tokens), target_forwards=len(tokens), wall_s=wall_s)


class Scheduler:
    def __init__(self, model: ServedModel, metrics: ServeMetrics, *, max_queue: int):
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self._queue: deque[Generation] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="spectrain-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, gen: Generation) -> None:
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(gen)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def cancel(self, gen: Generation) -> None:
        """Drop ``gen``: out of the queue now if it still waits, else out of its row at its next token."""
        if gen.cancelled.is_set():
            return
        gen.cancelled.set()
        with self._cond:
            if gen in self._queue:
                self._queue.remove(gen)
                self.metrics.queue_depth.set(len(self._queue))
        self.metrics.cancelled.inc()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            for gen in self._queue:
                gen.cancelled.set()
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _take(self, block: bool) -> Generation | None:
        with self._cond:
            while block and not self._queue and not self._closing:
                self._cond.wait()
            if self._closing or not self._queue:
                return None
            gen = self._queue.popleft()
            self.metrics.queue_depth.set(len(self._queue))
            return gen

    def _loop(self) -> None:
        while True:
            gen = self._take(block=True)
            if gen is None:
                return
            if self.model.batched:
                self._serve_batch(gen)
            else:
                self._serve_one(gen)

    def _done(self, gen: Generation, stats: GenerationStats) -> None:
        done = gen.finish(stats)
        # Counted before the client hears of the end: a /metrics read after a response includes that response.
        self.metrics.finished(len(gen.prompt_ids), done.completion_tokens, stats, gen.submitted, gen.first_token_s)
        gen.send(done)

    def _fail(self, gen: Generation, exc: BaseException) -> None:
        log.exception("generation failed", exc_info=exc)
        gen.send(Failed(f"the engine failed on this request: {type(exc).__name__}: {exc}"))
        self.metrics.failed.inc()

    def _serve_one(self, gen: Generation) -> None:
        model = self.model
        self.metrics.running.set(1)
        try:
            result = model.algorithm.generate(gen.prompt_ids, max_new_tokens=gen.max_tokens, sampling=gen.sampling,
                                              generator=torch.Generator().manual_seed(gen.seed),
                                              eos_ids=model.eos_ids, on_tokens=gen.accept)
            if not gen.cancelled.is_set():
                self._done(gen, result.stats)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
            self._fail(gen, exc)
        finally:
            self.metrics.running.set(0)

    def _serve_batch(self, first: Generation) -> None:
        """Decode ``first`` and whatever else arrives, ``batch_size`` rows at a time, until the queue is empty."""
        model, waiting, started = self.model, [first], {}
        batcher = ContinuousBatcher(model.algorithm.target, batch_size=model.batch_size, eos_ids=model.eos_ids,
                                    sampling=first.sampling, refill_at=1)

        def next_job() -> Job | None:
            gen = waiting.pop() if waiting else self._take(block=False)
            while gen is not None and gen.cancelled.is_set():
                gen = self._take(block=False)
            if gen is None:
                return None
            started[gen] = time.perf_counter()
            self.metrics.running.set(len(started))
            return Job(gen, gen.prompt_ids, gen.max_tokens, seed=gen.seed, sampling=gen.sampling)

        def on_done(job: Job, tokens: list[int]) -> None:
            gen = job.key
            wall = time.perf_counter() - started.pop(gen)
            self.metrics.running.set(len(started))
            if not gen.cancelled.is_set():
                self._done(gen, batched_stats(tokens, wall))

        try:
            batcher.run(next_job, on_done, on_token=lambda job, token: job.key.accept([token]))
        except Exception as exc:  # noqa: BLE001 - fail the rows in flight, keep serving the next ones
            for gen in list(started):
                self._fail(gen, exc)
            started.clear()
        self.metrics.running.set(0)
