"""The per-process share of every global batch (``data_prep.rank_sampler``), without starting processes: the
processes' batches, side by side, are one process's batches of twice the size, and a mid-epoch state resumes."""

from __future__ import annotations

import pytest
import torch

from data_prep.datamodules import _shuffle_generator
from data_prep.rank_sampler import RankSlicedSampler


def batches(sampler: RankSlicedSampler, size: int) -> list[list[int]]:
    order = list(sampler)
    return [order[i:i + size] for i in range(0, len(order), size)]


def test_two_processes_take_halves_of_the_single_process_batches():
    n, b = 22, 3  # 22 rows: 3 global batches of 6, the partial fourth dropped when several processes train
    one = batches(RankSlicedSampler(n, 2 * b, shuffle=True, generator=_shuffle_generator(7)), 2 * b)
    ranks = [batches(RankSlicedSampler(n, b, shuffle=True, generator=_shuffle_generator(7), rank=r, world=2), b)
             for r in range(2)]
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
    assert str(info.value) == ("5 training samples do not fill one global batch of 2 processes x batch_size 3 = 6, so "
                               "nothing would train; give more samples, a smaller data.batch_size or fewer processes")
    assert len(list(RankSlicedSampler(6, 3, shuffle=False, rank=1, world=2))) == 3  # exactly one global batch
    assert len(list(RankSlicedSampler(2, 3, shuffle=False))) == 2  # one process trains on a partial batch
