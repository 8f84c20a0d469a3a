"""The bounded request queue and the worker thread that runs the engine.

One worker thread owns the engine (its runners and KV caches are not thread-safe). Requests wait in a queue of
at most ``max_queue``; one more is refused (the app answers 429). AR with ``batch_size`` > 1 decodes up to that
many requests side by side (``inference.batched_generation.ContinuousBatcher``: a finished or cancelled row is
refilled from the queue at once); every other algorithm serves one request at a time. A cancelled request
(its client went away, or a stop string was met) leaves the queue at once, or its row at the next token: the
engine's token callback returns False, so the algorithm ends the query through its normal path. A batched row
that fails ends alone, with its error; the other rows go on.

Each request ends exactly once (finished, failed, cancelled, or refused at shutdown), decided under the
scheduler's lock: a request that finished is never also counted as cancelled. ``close()`` ends the requests in
flight and in the queue (503) and stops the worker within a bound.
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


class Closed(Exception):
    """The scheduler is shutting down and takes no new request."""


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
    status: int = 500  # the HTTP status a non-streaming answer gets: 500 the engine failed, 503 shutting down


class Generation:
    """One request on its way through the queue and the engine. The worker calls ``accept`` with each batch of
    new tokens and ``finish`` at its end; ``send`` delivers the events to the client's handler
    (thread-safe)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, seed: int,
                 text: TextAssembler, send: Callable[[object], None], eos_ids: list[int], *, stream: bool = True):
        self.prompt_ids, self.max_tokens, self.sampling, self.seed = prompt_ids, max_tokens, sampling, seed
        self.text, self.send, self.eos_ids = text, send, set(eos_ids)
        # A non-streaming client needs its text only at the end: one event instead of one per token spares the
        # event loop a wake-up (and the engine's thread a GIL hand-over) per token.
        self.stream = stream
        self._held: list[Chunk] = []
        self.cancelled = threading.Event()  # the engine stops generating it at its next token
        self.ended = False  # finished, failed or cancelled (set once, under the scheduler's lock)
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

    def finish(self, stats: GenerationStats) -> tuple[list[Chunk], Finished]:
        """The chunks still to send (the text held back; a non-streaming request's whole answer) and the end
        event; the caller sends them once the request is counted."""
        tail = self.text.flush()
        chunks = self._held + ([Chunk(tail, [])] if tail else [])
        if not self.stream and chunks:
            chunks = [Chunk("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids])]
        tokens = self.text.tokens
        ended = self.text.stopped or bool(tokens and tokens[-1] in self.eos_ids)
        return chunks, Finished("stop" if ended else "length", stats, len(tokens))


def batched_stats(tokens: list[int], wall_s: float) -> GenerationStats:
    """A batched AR row's counters: one target forward (its prefill, then one decode step) per token."""
    return GenerationStats(new_tokens=len(tokens), target_forwards=len(tokens), wall_s=wall_s)


class Scheduler:
    def __init__(self, model: ServedModel, metrics: ServeMetrics, *, max_queue: int):
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self._queue: deque[Generation] = deque()
        self._running: set[Generation] = set()  # taken from the queue, not ended yet
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="spectrain-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, gen: Generation) -> None:
        with self._cond:
            if self._closing:
                raise Closed
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(gen)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def _end(self, gen: Generation) -> bool:
        """Mark ``gen`` ended; False if it already was, so that each request ends (and is counted) once."""
        with self._cond:
            if gen.ended:
                return False
            gen.ended = True
            self._running.discard(gen)
            if gen in self._queue:
                self._queue.remove(gen)
                self.metrics.queue_depth.set(len(self._queue))
            return True

    def cancel(self, gen: Generation) -> bool:
        """Drop ``gen`` (its client went away): out of the queue now if it still waits, else out of its row at its
        next token. False, and nothing counted, when it had ended already."""
        if not self._end(gen):
            return False
        gen.cancelled.set()
        self.metrics.cancelled.inc()
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Take no new request, end every queued and running one (its client is answered 503), and wait up to
        ``timeout`` seconds for the worker: a running request stops at its next token. True when it stopped."""
        with self._cond:
            self._closing = True
            ending = list(self._queue) + list(self._running)
            self._cond.notify_all()
        for gen in ending:
            if self._end(gen):
                gen.cancelled.set()
                gen.send(Failed("the server is shutting down; retry the request", status=503))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take(self, block: bool) -> Generation | None:
        with self._cond:
            while block and not self._queue and not self._closing:
                self._cond.wait()
            if self._closing or not self._queue:
                return None
            gen = self._queue.popleft()
            self._running.add(gen)
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
        chunks, done = gen.finish(stats)  # first: if it raises, the request is still open and fails instead
        if not self._end(gen):  # cancelled (or refused at shutdown) meanwhile: its client is gone or answered
            return
        # Counted before the client hears of the end: a /metrics read after a response includes that response.
        self.metrics.finished(len(gen.prompt_ids), done.completion_tokens, stats, gen.submitted, gen.first_token_s)
        for event in (*chunks, done):
            gen.send(event)

    def _fail(self, gen: Generation, exc: BaseException) -> None:
        log.error("generation failed", exc_info=exc)
        if not self._end(gen):
            return
        self.metrics.failed.inc()
        gen.send(Failed(f"the engine failed on this request: {type(exc).__name__}: {exc}"))

    def _serve_one(self, gen: Generation) -> None:
        model = self.model
        self.metrics.running.set(1)
        try:
            result = model.algorithm.generate(gen.prompt_ids, max_new_tokens=gen.max_tokens, sampling=gen.sampling,
                                              generator=torch.Generator().manual_seed(gen.seed),
                                              eos_ids=model.eos_ids, on_tokens=gen.accept)
            self._done(gen, result.stats)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
            self._fail(gen, exc)
        finally:
            self.metrics.running.set(0)

    def _serve_batch(self, first: Generation) -> None:
        """Decode ``first`` and whatever else arrives, ``batch_size`` rows at a time, until the queue is empty. A
        row that fails ends alone (``on_error``); a failing forward fails every row in flight."""
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

        def leave(gen: Generation) -> float:
            wall = time.perf_counter() - started.pop(gen)
            self.metrics.running.set(len(started))
            return wall

        def on_done(job: Job, tokens: list[int]) -> None:
            self._done(job.key, batched_stats(tokens, time.perf_counter() - started[job.key]))
            leave(job.key)

        def on_error(job: Job, exc: Exception) -> None:
            if job.key in started:
                leave(job.key)
            self._fail(job.key, exc)

        try:
            batcher.run(next_job, on_done, on_token=lambda job, token: job.key.accept([token]), on_error=on_error)
        except Exception as exc:  # noqa: BLE001 - a forward failed: fail the rows in flight, serve the next ones
            for gen in list(started):
                self._fail(gen, exc)
            started.clear()
        self.metrics.running.set(0)
