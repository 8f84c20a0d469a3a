"""Lightning DataModules for drafter training: offline (stored features) and online (target run in-process).

Both yield the batch format of ``data_prep.features.collate_features``. Given the same samples, order and
batch size, they yield identical batches: the online module runs the same capture (``data_prep.capture``) over
the same sample stream (``data_prep.samples``) that extraction used, then the same collation.

The online module computes features inside the DataLoader's collate function, so it needs ``num_workers=0``
(the target lives in the main process, on its own device); use it for targets too big to store features for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from core.distributed import process_rank
from core.errors import UserError
from core.layer_ids import resolve_layers
from data_prep.capture import FP8, HiddenCapture, storage_dtype
from data_prep.features import FeatureDataset, collate_features
from data_prep.rank_sampler import RankSlicedSampler, check_fills_global_batch
from data_prep.samples import SampleBuilder, TokenSample, load_source, require_answers
from inference.drafters import LoadedModel, load_lm


def _shuffle_generator(seed: int) -> torch.Generator:
    """The sampler's own generator. torchdata restores a shuffling generator to its state before the epoch's
    permutation, but a loader also draws a worker base seed from its generator when an epoch starts, so sharing
    one generator makes every epoch after a resume differ from the uninterrupted run. The one draw made here is
    the base seed a plain ``DataLoader(generator=manual_seed(seed))`` drew before its first permutation, so the
    first epoch keeps the order runs had before loaders became resumable."""
    generator = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return generator


def resumable_loader(
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    collate_fn: Any = None,
    per_rank: bool = False,
    skip: frozenset[int] = frozenset(),
) -> StatefulDataLoader:
    """A DataLoader whose position inside an epoch (shuffle order + batches yielded) is in its ``state_dict``.

    Lightning stores the train loader's ``state_dict`` in every checkpoint and loads it on resume, so a run resumed
    mid-epoch continues with the very next batch. The own seeded generator keeps the order independent of the
    global RNG (which the model's dropout consumes).

    ``per_rank`` (training loaders): under an initialised process group each process takes its ``batch_size`` rows
    of every global batch (``data_prep.rank_sampler``); one process sees the same batches either way. ``skip``:
    items never yielded, though drawn in the shuffle (``RankSlicedSampler``).
    """
    rank, world = process_rank() if per_rank else (0, 1)
    sampler = None
    if shuffle or world > 1 or skip:
        sampler = RankSlicedSampler(
            len(dataset),
            batch_size,
            shuffle=shuffle,
            rank=rank,
            world=world,
            generator=_shuffle_generator(seed) if shuffle else None,
            skip=skip,
        )
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed + 1),
        collate_fn=collate_fn,
    )


def length_buckets(lengths: list[int], batch_size: int, seed: int, window: int = 64) -> list[list[int]]:
    """Sample indices grouped into batches of similar length, so a batch pads little: a seeded shuffle, then each
    run of ``window`` batches' worth of samples is sorted by length and cut into batches. Every sample appears once;
    which samples share a batch stays random beyond the window."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    span = window * batch_size
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: lengths[i])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    return batches


class FeatureDataModule(L.LightningDataModule):
    """Offline features from a ``data_prep.extract`` directory; ``expect`` holds ``check_features`` keywords
    (target, layers, tokenizer, dtype, max_len) so a dataset made for another recipe is refused at setup."""

    def __init__(
        self,
        directory: str | Path,
        *,
        batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        val_directory: str | Path | None = None,
        **expect: Any,
    ):
        super().__init__()
        self.directory, self.val_directory = directory, val_directory
        self.batch_size, self.shuffle, self.seed, self.num_workers = batch_size, shuffle, seed, num_workers
        self.expect = expect
        self.train_set: FeatureDataset | None = None
        self.val_set: FeatureDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = FeatureDataset(self.directory, **self.expect)
        if self.val_directory is not None and self.val_set is None:
            self.val_set = FeatureDataset(self.val_directory, **self.expect)

    def train_dataloader(self) -> StatefulDataLoader:
        self.setup()
        return resumable_loader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            num_workers=self.num_workers,
            collate_fn=collate_features,
            per_rank=True,
        )

    def val_dataloader(self) -> StatefulDataLoader | list:
        self.setup()
        if self.val_set is None:
            return []
        return resumable_loader(
            self.val_set,
            batch_size=self.batch_size,
            seed=self.seed,
            num_workers=self.num_workers,
            collate_fn=collate_features,
        )


class OnlineFeatureDataModule(L.LightningDataModule):
    """Features computed on the fly: samples from ``source`` (as ``data_prep.extract`` builds them) are run
    through the target when each batch is collated. Nothing touches disk.

    ``target`` is a name/dir (loaded here) or an ``inference.drafters.LoadedModel`` whose runner holds at least
    ``batch_size`` rows of ``max_len`` tokens. ``regenerate`` is not offered online: generating answers per
    batch would dominate training time; regenerate once with ``data_prep.regenerate`` instead.

    ``features=False`` yields token batches only (``input_ids``, ``loss_mask``, ``attention_mask``) and never
    runs the target: for a drafter trained on the target's own greedy answers, the next token IS the target's
    argmax, so the hidden states (a full target forward per batch) are not needed.

    ``dtype=fp8`` is refused: it is a storage format, and online features are never stored, so it would only add
    e4m3 rounding to tensors that live for one step.
    """

    def __init__(
        self,
        target: Any,
        *,
        source: str,
        n_samples: int,
        max_len: int,
        layers: Any = "eagle3",
        dtype: str = "bf16",
        batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        split: str = "all",
        device: str = "auto",
        window: str = "start",
        features: bool = True,
        bucket_by_length: bool = False,
    ):
        super().__init__()
        if dtype == FP8:
            raise UserError(
                "data.dtype=fp8 stores extracted features (python -m data_prep.extract ... dtype=fp8, then "
                "data.dataset_dir=DIR); online features are never stored: use data.dtype=bf16"
            )
        storage_dtype(dtype)
        self.target_arg = target
        self.features, self.bucket_by_length = features, bucket_by_length
        self.source, self.n_samples, self.max_len, self.split = source, n_samples, max_len, split
        self.window = window
        self.layers_spec, self.dtype = layers, dtype
        self.batch_size, self.shuffle, self.seed, self.device = batch_size, shuffle, seed, device
        self.samples: list[TokenSample] | None = None
        self.capture: HiddenCapture | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.samples is not None:
            return

        target = self.target_arg
        if not isinstance(target, LoadedModel):
            target = load_lm(str(target), device=self.device, max_seq_len=self.max_len, max_batch_size=self.batch_size)
        if self.features:
            layers = resolve_layers(self.layers_spec, target.runner.config.num_hidden_layers)
            self.capture = HiddenCapture(target.runner, layers, self.dtype)
        conversations = load_source(self.source, self.n_samples, self.seed, self.split)
        require_answers(conversations, False, self.source)
        build = SampleBuilder(target.tokenizer, self.max_len, window=self.window)
        self.samples = [s for i, c in enumerate(conversations) if (s := build(i, c)) is not None]
        if len(self.samples) < len(conversations):  # say what the data really is: steps x batch may exceed it
            print(
                f"[data] {self.source} ({self.split}): {len(self.samples)} of {len(conversations)} conversations "
                f"have answer tokens within their max_len={self.max_len} window (window={self.window}); the rest "
                "are skipped" + ("" if self.window == "answer" else " (window=answer keeps long prompts)"),
                file=sys.stderr,
            )

    def _collate(self, samples: list[TokenSample]) -> dict[str, torch.Tensor]:
        if not self.features:
            return collate_features(
                [{"input_ids": torch.tensor(s.input_ids), "loss_mask": torch.tensor(s.loss_mask)} for s in samples]
            )
        return collate_features(self.capture(samples))

    def train_dataloader(self, per_rank: bool = True) -> StatefulDataLoader:
        """``per_rank=False``: every process gets all batches (what validation wants)."""
        self.setup()
        if self.bucket_by_length:  # the loader shuffles whole batches of similar-length samples
            # Buckets of the global batch, each process taking its rows of every one (as RankSlicedSampler does),
            # so N processes with batch b train on the batches one process with batch N*b trains on.
            rank, world = process_rank() if per_rank else (0, 1)
            check_fills_global_batch(len(self.samples), self.batch_size, world)
            size = world * self.batch_size
            batches = length_buckets([len(s) for s in self.samples], size, self.seed)
            # A partial last bucket would leave a process without rows in the gradient all-reduce: skipped, but
            # still shuffled, so the full ones come in one process's order.
            partial = frozenset(i for i, batch in enumerate(batches) if len(batch) < size and world > 1)
            mine = [
                [self.samples[i] for i in batch[rank * self.batch_size : (rank + 1) * self.batch_size]]
                for batch in batches
            ]
            return resumable_loader(
                mine,
                batch_size=1,
                shuffle=self.shuffle,
                seed=self.seed,
                collate_fn=lambda items: self._collate(items[0]),
                skip=partial,
            )
        return resumable_loader(
            self.samples,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            collate_fn=self._collate,
            per_rank=per_rank,
        )
