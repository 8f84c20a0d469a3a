"""Executors for algorithms that overlap drafting with verification (docs/architecture.md §6.6; SpecBranch, SSD).

An algorithm splits each round into a *target job* (a closure run in this process) and a *draft job*: a method
call on a **draft side** object that owns the drafter and its caches. Draft work is a method call on an object,
never a closure, so the same algorithm code runs with the draft side in this process or in another one:

- ``sequential``: target job, then draft job, in this thread. The exactness reference. It also reports the
  *simulated overlapped latency* Σ max(t_target, t_draft) per round, the ideal a parallel backend could reach.
- ``cuda_streams``: the draft job runs in a worker thread on its own CUDA stream while this thread launches the
  target job (most torch ops release the GIL, so Python launch overhead overlaps too). Without CUDA it is the same
  worker thread on CPU, which keeps its ordering logic testable here.
- ``multiprocess``: the draft side lives in a second process (its own device) and requests/results travel over a
  two-rank ``torch.distributed`` group: gloo on CPU, NCCL between two GPUs. With ``call_timeout_s`` (a server
  sets its ``draft_timeout_s``), a call the draft process does not answer in time fails, and the process is
  stopped: the executor is then ``broken`` and its owner starts a new one for the next call.

All backends run the same calls in the same order on the same objects, so at temperature 0 they emit the same
tokens, and at T > 0 too as long as each side draws from its own seeded generator (never a shared one).
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import socket
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch

EXECUTORS = ("sequential", "cuda_streams", "multiprocess")

DraftFactory = Callable[[], Any]  # builds the draft side; for multiprocess it must pickle (a partial of a def)


@dataclass
class OverlapStats:
    """Time split of the overlapped rounds (seconds). ``simulated_s`` is what perfect overlap would cost."""

    rounds: int = 0  # overlap() calls
    target_s: float = 0.0
    draft_s: float = 0.0  # draft-side compute, overlapped and not
    simulated_s: float = 0.0  # Σ max(t_target, t_draft) over overlapped rounds + serial draft calls
    wall_s: float = 0.0  # real time spent inside overlap() and call()

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class Executor(ABC):
    """Runs draft-side method calls, alone (``call``) or overlapped with a target job (``overlap``)."""

    name: str

    def __init__(self) -> None:
        self.stats = OverlapStats()
        self.broken = False  # the draft side is gone (its process died): the owner builds a new executor

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A draft-side call nothing overlaps with (e.g. prefill); counted as serial time."""
        start = time.perf_counter()
        result, draft_s = self._draft_call(method, args, kwargs)
        self.stats.draft_s += draft_s
        self.stats.simulated_s += draft_s
        self.stats.wall_s += time.perf_counter() - start
        return result

    def overlap(self, target_job: Callable[[], Any], method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Run ``target_job()`` here and ``draft_side.method(*args, **kwargs)`` concurrently; both results."""
        start = time.perf_counter()
        target_result, target_s, draft_result, draft_s = self._overlap(target_job, method, args, kwargs)
        self.stats.rounds += 1
        self.stats.target_s += target_s
        self.stats.draft_s += draft_s
        self.stats.simulated_s += max(target_s, draft_s)
        self.stats.wall_s += time.perf_counter() - start
        return target_result, draft_result

    @abstractmethod
    def _draft_call(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, float]: ...

    @abstractmethod
    def _overlap(
        self, target_job: Callable[[], Any], method: str, args: tuple, kwargs: dict
    ) -> tuple[Any, float, Any, float]: ...

    def close(self) -> None:  # noqa: B027 - only backends holding threads or processes need it
        """Release threads / the draft process (no-op for in-process backends)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


class SequentialExecutor(Executor):
    name = "sequential"

    def __init__(self, draft_factory: DraftFactory):
        super().__init__()
        self.draft_side = draft_factory()

    def _draft_call(self, method, args, kwargs):
        return _timed(lambda: getattr(self.draft_side, method)(*args, **kwargs), _device_of(self.draft_side))

    def _overlap(self, target_job, method, args, kwargs):
        target_result, target_s = _timed(target_job, _cuda_current())
        draft_result, draft_s = self._draft_call(method, args, kwargs)
        return target_result, target_s, draft_result, draft_s


class CudaStreamsExecutor(Executor):
    """Draft job in a worker thread on a side stream; target job on this thread's current stream."""

    name = "cuda_streams"

    def __init__(self, draft_factory: DraftFactory):
        super().__init__()
        self.draft_side = draft_factory()
        device = _device_of(self.draft_side)
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectrain-draft")

    def _on_stream(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, float]:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            start = time.perf_counter()
            result = getattr(self.draft_side, method)(*args, **kwargs)
            if self.stream is not None:
                self.stream.synchronize()
            return result, time.perf_counter() - start

    def _draft_call(self, method, args, kwargs):
        return self.pool.submit(self._on_stream, method, args, kwargs).result()

    def _overlap(self, target_job, method, args, kwargs):
        if self.stream is not None:  # the draft stream must see everything already queued on ours
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        future = self.pool.submit(self._on_stream, method, args, kwargs)
        try:
            target_result, target_s = _timed(target_job, _cuda_current())
        except BaseException:
            wait([future])  # the target's error is the one to raise; the draft side must be idle before it
            raise
        draft_result, draft_s = future.result()
        return target_result, target_s, draft_result, draft_s

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class MultiprocessExecutor(Executor):
    """The draft side in a child process; one request and one reply per call over a 2-rank process group."""

    name = "multiprocess"

    def __init__(
        self,
        draft_factory: DraftFactory,
        *,
        backend: str | None = None,
        threads: int | None = None,
        timeout_s: float = 600.0,
        call_timeout_s: float | None = None,
    ):
        """``timeout_s`` bounds the start (the child builds its draft side) and every exchange of the process
        group; ``call_timeout_s``, when set, bounds the wait for each call's reply."""
        super().__init__()
        self.call_timeout_s = call_timeout_s

        import torch.distributed as dist  # torch: a heavy import, deferred to first use

        if dist.is_initialized():
            raise RuntimeError(
                "executor=multiprocess needs its own process group but torch.distributed is already "
                "initialised in this process (another multiprocess executor still running? close() "
                "its algorithm first); or use executor=sequential or cuda_streams"
            )
        self.backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
        if self.backend == "nccl" and torch.cuda.device_count() < 2:
            raise ValueError("executor=multiprocess with nccl needs two GPUs (one per process); use backend=gloo")
        if self.backend == "gloo":  # gloo resolves the hostname to pick an interface; loopback always works
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = threads or torch.get_num_threads()
        self.process = draft_process_context().Process(
            target=_draft_worker,
            args=(draft_factory, init_method, self.backend, threads, timeout_s, dict(os.environ)),
            daemon=True,
        )
        self.process.start()
        dist.init_process_group(
            self.backend, init_method=init_method, rank=0, world_size=2, timeout=datetime.timedelta(seconds=timeout_s)
        )
        if self.backend == "nccl":
            torch.cuda.set_device(0)
        self._dist = dist
        self._pending = False
        self._check_reply(self._recv())  # the worker's "ready" (or why building the draft side failed)

    def _send(self, message: Any) -> None:
        try:
            self._dist.send_object_list([message], dst=1)
        except Exception as exc:  # noqa: BLE001 - any failure of the group: the draft process is lost
            self._lost(exc)

    def _recv(self, timeout_s: float | None = None) -> Any:
        start = time.monotonic()
        try:
            return _recv_frame(self._dist, src=1, device=_frame_device(self.backend), timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure of the group: the draft process is lost
            if timeout_s is not None and time.monotonic() - start >= 0.99 * timeout_s:  # it timed out
                self._lost(
                    exc,
                    f"the draft process did not answer within {timeout_s:g} s (draft_timeout_s); it "
                    "was stopped, and a new one starts on the next call",
                )
            self._lost(exc)

    def _reply(self) -> Any:
        """A call's reply, waited for at most ``call_timeout_s``."""
        return self._recv(self.call_timeout_s)

    def _lost(self, exc: Exception, message: str | None = None) -> NoReturn:
        """The draft process died (gloo reports "Connection closed by peer" at once) or hangs: release what is
        left and mark this executor broken, so that its owner starts a new draft process for the next call."""
        self.broken = True
        if self.process.is_alive():  # first: a live peer could hold the group's teardown
            self.process.kill()
        self._dist.destroy_process_group()
        raise RuntimeError(
            message or f"the draft process is gone ({type(exc).__name__}: {exc}); a new one starts on the next call"
        ) from exc

    @staticmethod
    def _check_reply(reply: tuple) -> tuple[Any, float]:
        status, payload, draft_s = reply
        if status == "error":
            raise RuntimeError(f"draft process failed: {payload}")
        return payload, draft_s

    def _draft_call(self, method, args, kwargs):
        self._send(("call", method, args, kwargs))
        return self._check_reply(self._reply())

    def _overlap(self, target_job, method, args, kwargs):
        self._send(("call", method, args, kwargs))  # the worker starts at once; we run the target meanwhile
        try:
            target_result, target_s = _timed(target_job, _cuda_current())
        except BaseException:
            self._reply()  # this round's draft reply: left unread, the next call would take it for its own
            raise
        draft_result, draft_s = self._check_reply(self._reply())
        return target_result, target_s, draft_result, draft_s

    def close(self) -> None:
        if getattr(self, "_dist", None) is None or self.broken or not self._dist.is_initialized():
            return
        try:
            self._send(("close", None, (), {}))
            self.process.join(timeout=30)
        finally:
            self._dist.destroy_process_group()
            if self.process.is_alive():
                self.process.kill()


# What the fork server imports once, so that each draft process starts from a copy of it: the executor (torch), the
# draft sides' module (the engine's layers and drafters), and transformers' modelling code, which loading a draft LM
# from a directory needs (the Llama family's module pulls in the shared part: seconds of import per process).
DRAFT_PROCESS_PRELOAD = ("inference.executors", "inference.draft_side", "transformers.models.llama.modeling_llama")


@functools.cache
def draft_process_context() -> Any:
    """The multiprocessing context draft processes start in: ``forkserver`` (Linux), whose server process imports
    DRAFT_PROCESS_PRELOAD once and forks each draft process from that clean, single-threaded, CUDA-free state, so a
    start costs milliseconds instead of an interpreter start and torch's import (seconds, each time ``spawn`` is
    used); ``spawn`` where the platform has no fork server. Both are safe with CUDA and with threads in this
    process, which ``fork`` is not."""
    import torch.multiprocessing as mp  # torch: a heavy import, deferred to first use

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(DRAFT_PROCESS_PRELOAD))
    return context


def _draft_worker(
    draft_factory: DraftFactory,
    init_method: str,
    backend: str,
    threads: int,
    timeout_s: float,
    environment: dict[str, str],
) -> None:
    """Child process: build the draft side, then serve method calls until told to close. ``environment`` is the
    parent's at the start: a forked child has the fork server's, which may be older."""
    os.environ.clear()
    os.environ.update(environment)

    import torch.distributed as dist  # torch: a heavy import, deferred to first use

    torch.set_num_threads(threads)
    dist.init_process_group(
        backend, init_method=init_method, rank=1, world_size=2, timeout=datetime.timedelta(seconds=timeout_s)
    )
    if backend == "nccl":
        torch.cuda.set_device(1)

    def reply(message: tuple) -> None:
        _send_frame(dist, message, dst=0, device=_frame_device(backend))

    try:
        draft_side = draft_factory()
    except Exception as error:  # report why, then stop: the parent raises it
        reply(("error", f"{type(error).__name__}: {error}", 0.0))
        dist.destroy_process_group()
        return
    reply(("ok", None, 0.0))
    device = _device_of(draft_side)
    while True:
        box = [None]
        dist.recv_object_list(box, src=0)
        kind, method, args, kwargs = box[0]
        if kind == "close":
            break
        try:
            result, draft_s = _timed(functools.partial(getattr(draft_side, method), *args, **kwargs), device)
            reply(("ok", result, draft_s))
        except Exception as error:
            reply(("error", f"{type(error).__name__} in {method}: {error}\n{traceback.format_exc(limit=3)}", 0.0))
    dist.destroy_process_group()


def _frame_device(backend: str) -> torch.device:
    """Where a reply's tensors travel from: NCCL sends CUDA tensors only."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _send_frame(dist: Any, message: Any, dst: int, device: torch.device) -> None:
    """``message`` pickled, as its length and then its bytes (what ``_recv_frame`` reads)."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.long, device=device), dst=dst)
    dist.send(data.to(device), dst=dst)


def _recv_frame(dist: Any, src: int, device: torch.device, timeout_s: float | None) -> Any:
    """One ``_send_frame`` message; waits at most ``timeout_s`` for each part (None: the group's timeout). Unlike
    ``recv_object_list``, its wait can be bounded per call."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None

    def receive(tensor: torch.Tensor) -> torch.Tensor:
        work = dist.irecv(tensor, src=src)
        work.wait(timeout) if timeout is not None else work.wait()
        return tensor

    size = int(receive(torch.empty(1, dtype=torch.long, device=device)).item())
    data = receive(torch.empty(size, dtype=torch.uint8, device=device))
    return pickle.loads(data.cpu().numpy().tobytes())


def make_executor(name: str, draft_factory: DraftFactory, **kwargs: Any) -> Executor:
    """``sequential`` | ``cuda_streams`` | ``multiprocess`` (kwargs: backend, threads, call_timeout_s) around a
    draft side. The in-process executors ignore ``call_timeout_s``: a call in this process cannot be stopped."""
    kwargs = dict(kwargs)
    if name != "multiprocess":
        kwargs.pop("call_timeout_s", None)
    if name == "sequential":
        return SequentialExecutor(draft_factory)
    if name == "cuda_streams":
        return CudaStreamsExecutor(draft_factory)
    if name == "multiprocess":
        return MultiprocessExecutor(draft_factory, **kwargs)
    raise ValueError(f"unknown executor '{name}'; choose one of {', '.join(EXECUTORS)}")


def _device_of(draft_side: Any) -> torch.device | None:
    device = getattr(draft_side, "device", None)
    return torch.device(device) if device is not None else None


def _cuda_current() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
