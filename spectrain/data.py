"""DataModules for drafter training: offline (an extracted feature dataset) or online (target in-process).

Both yield ``data_prep.features.collate_features`` batches. Validation comes from ``data.val_dataset_dir``
offline, and online from ``data.val_source`` if given, else the prompt source's held-out eval split, so validation prompts never appear in training.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from core.assets import load_tokenizer
from core.errors import UserError
from data_prep.datamodules import FeatureDataModule, OnlineFeatureDataModule
from spectrain.targets import loaded_target


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
        # Every process validates on all of it: the metrics then agree across processes without a reduction.
        return self.val.train_dataloader(per_rank=False)


def build_feature_datamodule(cfg: Any, features: bool = True) -> L.LightningDataModule:
    """``features=False``: online token batches only, no target forward (``OnlineFeatureDataModule``)."""
    data = cfg.data
    if data.dataset_dir:
        if data.bucket_by_length or data.val_source:
            key = "bucket_by_length" if data.bucket_by_length else "val_source"
            raise UserError(
                f"data.{key} applies to online features only; drop it with data.dataset_dir "
                "(validation features: data.val_dataset_dir)"
            )
        if data.window != "start":
            raise UserError(
                f"data.window={data.window} applies to online features only: an extracted dataset's "
                "window was fixed when it was extracted (python -m data_prep.extract ... window=answer)"
            )
        return FeatureDataModule(
            data.dataset_dir,
            batch_size=data.batch_size,
            seed=cfg.seed,
            num_workers=data.num_workers,
            val_directory=data.val_dataset_dir,
            target=cfg.target,
            layers=data.layers,
            max_len=data.max_len,
            tokenizer=load_tokenizer(cfg.target, data.chat_template),
        )
    target = loaded_target(cfg.target, data.max_len, data.batch_size, chat_template=data.chat_template)
    common = dict(
        source=data.source,
        max_len=data.max_len,
        layers=data.layers,
        dtype=data.dtype,
        batch_size=data.batch_size,
        seed=cfg.seed,
        window=data.window,
        features=features,
    )
    train = OnlineFeatureDataModule(
        target, n_samples=data.n_samples, split="train", bucket_by_length=data.bucket_by_length, **common
    )
    if data.val_source:  # its own held-out conversations, e.g. the target's answers to the eval split
        common["source"] = data.val_source
    val = OnlineFeatureDataModule(
        target, n_samples=data.n_val_samples, split="all" if data.val_source else "eval", shuffle=False, **common
    )
    return TrainValDataModule(train, val)
