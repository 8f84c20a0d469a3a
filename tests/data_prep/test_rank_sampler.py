"""The per-process share of every global batch (``data_prep.rank_sampler``), without starting processes: the
processes' batches, side by side, are one process's batches of twice the size, and a mid-epoch state resumes."""

from __future__ import annotations

import pytest
import torch

from data_prep.datamodules import _shuffle_generator
from data_prep.rank_sampler import RankSlicedSampler


def batches(sampler: RankSlicedSampler, size: int) -> list[list[int]]:
    order = list(sampler)
    return [order[i : i + size] for i in range(0, len(order), size)]


def test_two_processes_take_halves_of_the_single_process_batches():
    n, b = 22, 3  # 22 rows: 3 global batches of 6, the partial fourth dropped when several processes train
    one = batches(RankSlicedSampler(n, 2 * b, shuffle=True, generator=_shuffle_generator(7)), 2 * b)
    ranks = [
        batches(RankSlicedSampler(n, b, shuffle=True, generator=_shuffle_generator(7), rank=r, world=2), b)
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) == 3 and len(one) == 4
    assert [a + c for a, c in zip(*ranks)] == one[:3]
    # One process: exactly torch's seeded permutation, as the loaders drew it before they were split.
    assert sum(one, []) == torch.randperm(n, generator=_shuffle_generator(7)).tolist()


def test_a_mid_epoch_state_resumes_the_same_indices_in_a_later_epoch():
    sampler = RankSlicedSampler(10, 2, shuffle=True, generator=_shuffle_generator(0), rank=1, world=2)
    list(sampler)  # epoch 1 advances the generator
    epoch = iter(sampler)
    seen = [next(epoch) for _ in range(3)]
    state = epoch.state_dict()
    rest = list(epoch)
    fresh = RankSlicedSampler(10, 2, shuffle=True, generator=_shuffle_generator(123), rank=1, world=2)
    resumed = iter(fresh)
    resumed.load_state_dict(state)
    assert list(resumed) == rest and len(seen + rest) == len(fresh)


def test_fewer_samples_than_one_global_batch_are_refused_rather_than_training_nothing():
    with pytest.raises(ValueError) as info:
        RankSlicedSampler(5, 3, shuffle=False, rank=1, world=2)
    assert str(info.value) == (
        "5 training samples do not fill one global batch of 2 processes x batch_size 3 = 6, so "
        "nothing would train; give more samples, a smaller data.batch_size or fewer processes"
    )
    assert len(list(RankSlicedSampler(6, 3, shuffle=False, rank=1, world=2))) == 3  # exactly one global batch
    assert len(list(RankSlicedSampler(2, 3, shuffle=False))) == 2  # one process trains on a partial batch


def test_length_bucketed_batches_split_across_processes_as_one_process_batches_them(monkeypatch):
    """bucket_by_length: 2 processes with batch b take the halves of the batches 1 process with batch 2b takes."""
    from data_prep import datamodules
    from data_prep.samples import TokenSample

    def rows(loader) -> list[list[int]]:  # each batch's first tokens: the sample indices below
        return [batch["input_ids"][:, 0].tolist() for batch in loader]

    def loader(batch_size: int, rank: int = 0, world: int = 1):
        monkeypatch.setattr(datamodules, "process_rank", lambda: (rank, world))
        module = datamodules.OnlineFeatureDataModule(
            "unused",
            source="unused",
            n_samples=22,
            max_len=64,
            batch_size=batch_size,
            features=False,
            bucket_by_length=True,
        )
        module.samples = [TokenSample(i, [i] * (1 + (7 * i) % 13), [1] * (1 + (7 * i) % 13)) for i in range(22)]
        return module.train_dataloader()

    one = rows(loader(6))
    ranks = [rows(loader(3, rank, 2)) for rank in range(2)]
    full = [batch for batch in one if len(batch) == 6]
    assert len(ranks[0]) == len(ranks[1]) == len(full) == 3 and len(one) == 4  # 2 processes skip the partial one
    assert [a + b for a, b in zip(*ranks)] == full
    with pytest.raises(ValueError, match="22 training samples do not fill one global batch of 2 processes"):
        loader(12, 0, 2)
