"""DataModules for drafter training: offline (an extracted feature dataset) or online (target in-process).

Both yield ``data_prep.features.collate_features`` batches. Validation comes from ``data.val_dataset_dir``
offline, and from the prompt source's held-out eval split online, so validation prompts never appear in training.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L


@functools.lru_cache(maxsize=2)
def loaded_target(name: str, max_len: int, batch_size: int, device: str = "auto"):
    """The target, loaded once per process and shared by the LightningModule and the online DataModule."""
    from inference.drafters import load_lm

    return load_lm(name, device=device, max_seq_len=max_len, max_batch_size=batch_size)


class TrainValDataModule(L.LightningDataModule):
    """Two online DataModules (train split, eval split) presented as one."""

    def __init__(self, train: L.LightningDataModule, val: L.LightningDataModule):
        super().__init__()
        self.train, self.val = train, val

    def setup(self, stage: str | None = None) -> None:
        self.train.setup(stage)
        self.val.setup(stage)

    def train_dataloader(self):
        return self.train.train_dataloader()

    def val_dataloader(self):
        return self.val.train_dataloader()


def build_feature_datamodule(cfg: Any) -> L.LightningDataModule:
    from data_prep.datamodules import FeatureDataModule, OnlineFeatureDataModule

    data = cfg.data
    if data.dataset_dir:
        return FeatureDataModule(data.dataset_dir, batch_size=data.batch_size, seed=cfg.seed,
                                 num_workers=data.num_workers, val_directory=data.val_dataset_dir,
                                 target=cfg.target, layers=data.layers, max_len=data.max_len)
    target = loaded_target(cfg.target, data.max_len, data.batch_size)
    common = dict(source=data.source, max_len=data.max_len, layers=data.layers, dtype=data.dtype,
                  batch_size=data.batch_size, seed=cfg.seed)
    train = OnlineFeatureDataModule(target, n_samples=data.n_samples, split="train", **common)
    val = OnlineFeatureDataModule(target, n_samples=data.n_val_samples, split="eval", shuffle=False, **common)
    return TrainValDataModule(train, val)
