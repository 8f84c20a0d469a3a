"""Background adaptation (``adapt.background=true``): the adapter's work after a query runs off the serving path.

The adapter trains a private TRAINING copy of the drafter on a worker thread (and, on a GPU, a side CUDA stream)
while the engine serves the next query from the SERVING drafter, which no one else writes. At the end of that next
query the job is collected (waited for, if it is still running: that wait counts in the query's time) and, when it
changed the weights, its result is copied into the serving drafter. So a decision taken after query k serves from
query k+2 on instead of k+1: the policy knows this lag (:class:`~spectrain.adapt.adapter.BanditAdapter` ``lag``)
and so does replay, which publishes at the same points.

Worth it where the serving path leaves compute idle (a second CPU core with ``threads=1``; a GPU whose decode
steps do not fill it); with no spare compute the job takes its time from serving all the same. The cost model
still charges every update its full measured time, so the bandit takes the same decisions as in the foreground.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn


class Publisher:
    """Copies the training drafter's adaptable parameters into the serving drafter (matched by name)."""

    def __init__(self, training: nn.Module, serving: nn.Module, trainable: list[nn.Parameter]):
        serving_params = dict(serving.named_parameters())
        by_id = {id(p) for p in trainable}
        self.pairs = []
        for name, param in training.named_parameters():
            if id(param) in by_id:
                if name not in serving_params or serving_params[name].shape != param.shape:
                    raise ValueError(
                        f"background adaptation: the serving drafter has no parameter '{name}' shaped "
                        f"{tuple(param.shape)}; build it as a copy of the training drafter"
                    )
                self.pairs.append((param, serving_params[name]))
        if len(self.pairs) != len(by_id):
            raise ValueError("background adaptation: some trainable parameters are not in the training drafter")

    @torch.no_grad()
    def publish(self) -> None:
        for source, destination in self.pairs:
            destination.copy_(source)


def changed_weights(row: dict[str, Any]) -> bool:
    """Whether the policy step that logged ``row`` left the drafter's weights different from before it (an update
    it kept, a rollback, a return to the original). An undone update restores the exact snapshot."""
    return bool(row.get("kept")) or bool(row.get("rolled_back")) or bool(row.get("reset"))


class BackgroundRunner:
    """One job at a time on a worker thread; ``collect`` waits for it and publishes what it changed."""

    def __init__(self, publisher: Publisher, device: torch.device):
        self.publisher = publisher
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectrain-adapt")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device
        self.job: Future | None = None

    def submit(self, job: Callable[[], dict[str, Any]]) -> None:
        if self.job is not None:
            raise RuntimeError("background adaptation: collect the running job before submitting the next one")
        threads = torch.get_num_threads()  # a new thread's intra-op pool would otherwise take every core
        stream = self.stream
        if stream is not None:  # the record's tensors were written on the serving stream
            stream.wait_stream(torch.cuda.current_stream(self.device))

        def run() -> dict[str, Any]:
            torch.set_num_threads(threads)
            if stream is None:
                return job()
            with torch.cuda.stream(stream):
                return job()

        self.job = self.pool.submit(run)

    def wait(self) -> None:
        """Block until the running job (if any) has finished; it stays to be collected."""
        if self.job is not None:
            self.job.result()
            if self.stream is not None:
                self.stream.synchronize()

    def collect(self) -> dict[str, Any] | None:
        """The finished job's decision row (None when nothing ran); its weight changes now serve."""
        if self.job is None:
            return None
        job, self.job = self.job, None
        row = job.result()  # re-raises the job's exception here, in the serving thread
        if self.stream is not None:
            self.stream.synchronize()
        if changed_weights(row):
            self.publisher.publish()
        return row

    def close(self) -> dict[str, Any] | None:
        try:
            return self.collect()
        finally:
            self.pool.shutdown(wait=True)
