"""Each training process's share of every global batch, so N processes with batch b see what one process with
batch N*b sees.

One permutation is drawn per epoch, exactly as a single process draws it (a seeded ``torch.randperm``); it is cut
into global batches of ``world * batch_size`` and process ``rank`` takes rows ``[rank*b, (rank+1)*b)`` of each.
DDP then averages the per-process gradients, which for a per-sample mean loss is the gradient of the global batch.
(torch's ``DistributedSampler`` instead deals the permutation out round-robin, which gives another order than one
process would train on.) A trailing partial global batch is dropped when ``world > 1``: a process with one batch
fewer would leave the others waiting in the gradient all-reduce.

The position inside an epoch is the number of batches this process has taken, which is the same on every process,
so the checkpoint rank 0 writes resumes every rank (``state_dict`` / ``load_state_dict``, torchdata's protocol).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from core.errors import UserError


def check_fills_global_batch(n: int, batch_size: int, world: int) -> None:
    """Refuse (one line) ``n`` samples that fill no global batch of ``world`` processes: each would train 0 steps
    (the trailing partial global batch is dropped), silently."""
    if world > 1 and n < world * batch_size:
        raise UserError(
            f"{n} training samples do not fill one global batch of {world} processes x batch_size "
            f"{batch_size} = {world * batch_size}, so nothing would train; give more samples, a "
            "smaller data.batch_size or fewer processes"
        )


class RankSlicedSampler(Sampler[int]):
    """Sample indices of process ``rank``'s rows of each global batch (see the module docstring)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world: int = 1,
        skip: frozenset[int] = frozenset(),
    ):
        """``skip``: indices drawn in the permutation but never yielded, so the others come in the order a run
        that yields them draws (a length bucket that only one process count fills, ``data_prep.datamodules``)."""
        if shuffle and generator is None:
            raise ValueError("a shuffling RankSlicedSampler needs its own seeded generator")
        check_fills_global_batch(n - len(skip), batch_size, world)
        self.n, self.batch_size, self.shuffle, self.generator = n, batch_size, shuffle, generator
        self.rank, self.world, self.skip = rank, world, skip

    def global_batches(self) -> int:
        span, kept = self.batch_size * self.world, self.n - len(self.skip)
        return kept // span if self.world > 1 else -(-kept // span)

    def __len__(self) -> int:
        return self.n - len(self.skip) if self.world == 1 else self.global_batches() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        return _RankSliceIterator(self)


class _RankSliceIterator(Iterator[int]):
    """One epoch of a ``RankSlicedSampler``; its state is the generator before the permutation plus the count of
    indices yielded (torchdata restores both and fast-forwards)."""

    def __init__(self, sampler: RankSlicedSampler):
        self.sampler = sampler
        self.generator_state = sampler.generator.get_state() if sampler.shuffle else None
        self.yielded = 0
        self.indices = self._indices()

    def _indices(self) -> list[int]:
        s = self.sampler
        order = torch.randperm(s.n, generator=s.generator).tolist() if s.shuffle else list(range(s.n))
        order = [i for i in order if i not in s.skip]
        span = s.batch_size * s.world
        mine: list[int] = []
        for start in range(0, s.global_batches() * span, span):
            mine += order[start + s.rank * s.batch_size : start + (s.rank + 1) * s.batch_size]
        return mine

    def __next__(self) -> int:
        if self.yielded >= len(self.indices):
            raise StopIteration
        self.yielded += 1
        return self.indices[self.yielded - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "generator": self.generator_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["generator"] is not None:
            self.sampler.generator.set_state(state["generator"])
        self.generator_state = state["generator"]
        self.indices = self._indices()
        self.yielded = state["yielded"]
