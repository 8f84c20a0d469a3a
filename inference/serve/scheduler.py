"""The bounded request queue and the worker thread that runs the engine.

One worker thread owns the engine (its runners and KV caches are not thread-safe). Requests wait in a queue of
at most ``max_queue``; one more is refused (the app answers 429). An algorithm that runs on the engine loop (AR,
SpS/HSD, DFlash, P-EAGLE, EAGLE-3 trees) with ``batch_size`` > 1 decodes up to that many requests side by side
(``inference.engine.loop``: a finished or cancelled row is refilled from the queue at once); every other algorithm
serves one request at a time. A
cancelled request (its client went away, or a stop string was met) leaves the queue at once, or its row at its next
tokens: the engine's token callback returns False, so the request ends through its normal path. A batched row that
fails ends alone, with its error; the other rows go on.

Each request ends exactly once (finished, failed, cancelled, or refused at shutdown), decided under the
scheduler's lock: a request that finished is never also counted as cancelled. ``close()`` ends the requests in
flight and in the queue (503) and stops the worker within a bound.

The server stays answerable when its engine cannot serve: a request that waited ``max_queue_wait_s`` in the queue
is answered 503 (a timer thread ends it; nothing polls); if the worker's loop itself dies, every queued and running
request is answered 503 and ``submit`` refuses; ``health()`` says why, and reports an engine that has made no
progress (no token, no request started or ended) for ``stall_s`` while it has work. Every refusal carries a
Retry-After estimate: the requests ahead times the mean time a request took.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.errors import UserError
from inference.algorithms.base import GenerationStats
from inference.engine.loop import DecodeEngine
from inference.engine.state import Failed as RowFailed
from inference.engine.state import Finished as RowFinished
from inference.engine.state import RowRequest
from inference.sampling import SamplingParams
from inference.serve.engine import ServedModel
from inference.serve.metrics import ServeMetrics
from inference.serve.schemas import new_id
from inference.serve.text import TextAssembler

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The request queue holds ``max_queue`` requests already."""

    def __init__(self, retry_after: int):
        super().__init__(retry_after)
        self.retry_after = retry_after


class Closed(Exception):
    """The scheduler takes no new request: it is shutting down, or its engine stopped (the message says which)."""

    def __init__(self, message: str, retry_after: int, code: str):
        super().__init__(message)
        self.message, self.retry_after, self.code = message, retry_after, code


def failure_message(exc: BaseException, request_id: str) -> str:
    """What a client hears of a failure: a UserError's own line (written for users); for anything else, a bug, only
    its type and the request's id: its text (paths, shapes) stays in the server's log under that id."""
    if isinstance(exc, UserError):
        return str(exc)
    return f"the engine failed on this request ({type(exc).__name__}; {request_id}: the server's log has the details)"


def seeded_generator(seed: int) -> torch.Generator:
    """A request's sampling stream; a seed torch cannot take is the request's own error, told to its client."""
    try:
        return torch.Generator().manual_seed(seed)
    except (ValueError, RuntimeError) as exc:
        raise UserError(f"seed {seed}: torch's generator refuses it ({exc}); use a seed in 0..2**63-1") from None


SHUTTING_DOWN = "the server is shutting down; retry the request"
RESTART_RETRY_S = 30  # Retry-After once the engine stopped: about what a restart of the server takes


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
    code: str | None = None  # OpenAI's error code, where one applies (queue_timeout, engine_stopped)
    retry_after: int | None = None  # seconds, for a 503's Retry-After


class Generation:
    """One request on its way through the queue and the engine. The worker calls ``accept`` with each batch of
    new tokens and ``finish`` at its end; ``send`` delivers the events to the client's handler
    (thread-safe)."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        seed: int,
        text: TextAssembler,
        send: Callable[[object], None],
        eos_ids: list[int],
        *,
        stream: bool = True,
        request_id: str | None = None,
    ):
        self.prompt_ids, self.max_tokens, self.sampling, self.seed = prompt_ids, max_tokens, sampling, seed
        self.request_id = request_id or new_id("req")  # the answer's id: failures are logged under it
        self.text, self.send, self.eos_ids = text, send, set(eos_ids)
        # A non-streaming client needs its text only at the end: one event instead of one per token spares the
        # event loop a wake-up (and the engine's thread a GIL hand-over) per token.
        self.stream = stream
        self._held: list[Chunk] = []
        self.cancelled = threading.Event()  # the engine stops generating it at its next token
        self.ended = False  # finished, failed or cancelled (set once, under the scheduler's lock)
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when the engine took it from the queue
        self.first_token_s: float | None = None

    def __str__(self) -> str:
        """Its answer's id: how logs (the adapter's decisions) name the request, whose engine key it is."""
        return self.request_id

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


class Scheduler:
    def __init__(
        self,
        model: ServedModel,
        metrics: ServeMetrics,
        *,
        max_queue: int,
        max_queue_wait_s: float = math.inf,
        stall_s: float = math.inf,
    ):
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self.max_queue_wait_s, self.stall_s = max_queue_wait_s, stall_s
        self._queue: deque[Generation] = deque()
        self._running: set[Generation] = set()  # taken from the queue, not ended yet
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the worker waits on it for work
        self._timer = threading.Condition(lock)  # the queue's timer waits on it for the head's deadline
        self._closing = False
        self._stopped: str | None = None  # why the worker's loop died, once it has
        self._progress_at = time.perf_counter()  # the engine's last token, or request taken or ended
        self._service_s = 1.0  # mean seconds a request held the engine (moving average), for Retry-After
        self._thread = threading.Thread(target=self._loop, name="spectrain-engine", daemon=True)
        self._thread.start()
        if math.isfinite(max_queue_wait_s):
            threading.Thread(target=self._expire, name="spectrain-queue-timer", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._stopped is None

    def health(self) -> tuple[bool, dict]:
        """(serving, what /health shows): why not, if not; the seconds since the engine last made progress."""
        with self._cond:
            age, busy, waiting = time.perf_counter() - self._progress_at, bool(self._running), len(self._queue)
        if self._stopped is not None:
            status = self._stopped
        elif self._closing:
            status = SHUTTING_DOWN
        elif not self._thread.is_alive():
            status = "engine stopped; restart the server"
        elif busy and age > self.stall_s:
            status = (
                f"stalled: the engine has made no progress for {age:.1f} s (stall_s={self.stall_s:g}); a "
                "draft process or kernel may hang"
            )
        else:
            status = "ok"
        return status == "ok", {"status": status, "last_progress_s": round(age, 3), "queue": waiting}

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the requests ahead of it, served ``batch_size`` at a time."""
        if not self.alive:
            return RESTART_RETRY_S
        with self._cond:
            ahead = len(self._queue) + len(self._running)
        return max(1, min(3600, math.ceil(self._service_s * ahead / max(1, self.model.batch_size))))

    def submit(self, gen: Generation) -> None:
        with self._cond:
            if self._closing or not self._thread.is_alive():
                raise Closed(
                    self._stopped or SHUTTING_DOWN,
                    self.retry_after(),
                    "engine_stopped" if self._stopped else "shutting_down",
                )
            if len(self._queue) >= self.max_queue:
                raise QueueFull(self.retry_after())
            self._queue.append(gen)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()
            if len(self._queue) == 1:  # a new head: the timer's deadline changed
                self._timer.notify()

    def _expire(self) -> None:
        """The queue's timer: answers 503 to each request that waited ``max_queue_wait_s``. The queue is in
        submission order, so the head has the earliest deadline; the timer sleeps until it (or a new head)."""
        with self._cond:
            while not self._closing:
                now = time.perf_counter()
                late = [gen for gen in self._queue if now - gen.submitted >= self.max_queue_wait_s]
                for gen in late:
                    if self._end(gen):
                        gen.cancelled.set()
                        gen.send(
                            Failed(
                                f"the request waited {self.max_queue_wait_s:g} s in the queue "
                                "(max_queue_wait_s) without being served; retry later",
                                status=503,
                                code="queue_timeout",
                                retry_after=self.retry_after(),
                            )
                        )
                head = self._queue[0].submitted + self.max_queue_wait_s - now if self._queue else None
                self._timer.wait(head)

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
        self._refuse_all(Failed(SHUTTING_DOWN, status=503, code="shutting_down", retry_after=RESTART_RETRY_S))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _refuse_all(self, answer: Failed) -> None:
        """Take no new request and answer every queued and running one with ``answer``."""
        with self._cond:
            self._closing = True
            ending = list(self._queue) + list(self._running)
            self._cond.notify_all()
            self._timer.notify_all()
        for gen in ending:
            if self._end(gen):
                gen.cancelled.set()
                gen.send(answer)

    def _take(self, block: bool) -> Generation | None:
        with self._cond:
            while block and not self._queue and not self._closing:
                self._cond.wait()
            if self._closing or not self._queue:
                return None
            gen = self._queue.popleft()
            self._running.add(gen)
            gen.started = self._progress_at = time.perf_counter()
            self.metrics.queue_depth.set(len(self._queue))
            self._timer.notify()  # a new head, or none
            return gen

    def _loop(self) -> None:
        try:
            while True:
                gen = self._take(block=True)
                if gen is None:
                    return
                if self.model.batched:
                    self._serve_batch(gen)
                else:
                    self._serve_one(gen)
        except BaseException as exc:  # noqa: BLE001 - the loop itself died: nobody would answer the waiting clients
            incident = new_id("incident")
            log.critical("the engine's worker stopped (%s)", incident, exc_info=exc)
            # The exception's text (paths, shapes) stays in the log; clients and /health get its type and an id.
            self._stopped = (
                f"engine stopped ({type(exc).__name__}; {incident}: the server's log has the details); "
                "restart the server"
            )
            self._refuse_all(Failed(self._stopped, status=503, code="engine_stopped", retry_after=RESTART_RETRY_S))

    def _accept(self, gen: Generation, new: list[int]) -> bool:
        """``gen.accept``, noting the engine's progress for ``health()``."""
        self._progress_at = time.perf_counter()
        return gen.accept(new)

    def _done(self, gen: Generation, stats: GenerationStats) -> None:
        chunks, done = gen.finish(stats)  # first: if it raises, the request is still open and fails instead
        self._progress_at = now = time.perf_counter()
        if gen.started is not None:
            self._service_s += 0.2 * (now - gen.started - self._service_s)
        if not self._end(gen):  # cancelled (or refused at shutdown) meanwhile: its client is gone or answered
            return
        # Counted before the client hears of the end: a /metrics read after a response includes that response.
        self.metrics.finished(len(gen.prompt_ids), done.completion_tokens, stats, gen.submitted, gen.first_token_s)
        for event in (*chunks, done):
            gen.send(event)

    def _fail(self, gen: Generation, exc: BaseException) -> None:
        log.error("generation %s failed", gen.request_id, exc_info=exc)
        self._progress_at = time.perf_counter()
        if not self._end(gen):
            return
        self.metrics.failed.inc()
        gen.send(Failed(failure_message(exc, gen.request_id)))

    def _serve_one(self, gen: Generation) -> None:
        model = self.model
        self.metrics.running.set(1)
        try:
            result = model.algorithm.generate(
                gen.prompt_ids,
                max_new_tokens=gen.max_tokens,
                sampling=gen.sampling,
                generator=seeded_generator(gen.seed),
                eos_ids=model.eos_ids,
                on_tokens=lambda new: self._accept(gen, new),
            )
            self._done(gen, result.stats)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the server
            self._fail(gen, exc)
        finally:
            self.metrics.running.set(0)

    def _serve_batch(self, first: Generation) -> None:
        """Decode ``first`` and whatever else arrives, ``batch_size`` rows at a time on the engine loop, until the
        queue is empty. A row that fails ends alone; a failing batched call fails every row in flight."""
        model, waiting, started = self.model, [first], set()
        engine = DecodeEngine(
            model.algorithm.target,
            model.algorithm.strategy(),
            rows=model.batch_size,
            eos_ids=model.eos_ids,
            max_seq_len=model.max_seq_len,
            width_policy=model.widths,
        )

        def next_request() -> RowRequest | None:
            while True:
                gen = waiting.pop() if waiting else self._take(block=False)
                if gen is None:
                    return None
                if gen.cancelled.is_set():
                    continue
                try:
                    generator = seeded_generator(gen.seed)
                except Exception as exc:  # noqa: BLE001 - a seed torch cannot take: this request fails alone
                    self._fail(gen, exc)
                    continue
                started.add(gen)
                self.metrics.running.set(len(started))
                return RowRequest(
                    gen,
                    gen.prompt_ids,
                    gen.max_tokens,
                    gen.sampling,
                    generator,
                    lambda new, gen=gen: self._accept(gen, new),
                )

        def on_event(event: RowFinished | RowFailed) -> None:
            gen = event.key
            started.discard(gen)
            self.metrics.running.set(len(started))
            if isinstance(event, RowFailed):
                self._fail(gen, event.error)
                return
            try:
                self._done(gen, event.result.stats)
            except Exception as exc:  # noqa: BLE001 - finishing this answer failed: it fails alone
                self._fail(gen, exc)

        try:
            engine.run(next_request, on_event)
        except Exception as exc:  # noqa: BLE001 - the engine itself failed: fail the rows in flight, serve the next
            for gen in list(started):
                self._fail(gen, exc)
            started.clear()
        finally:
            engine.close()
        self.metrics.running.set(0)
