"""DataModules for drafter training: offline (an extracted feature dataset) or online (target in-process).

Both yield ``data_prep.features.collate_features`` batches. Validation comes from ``data.val_dataset_dir``
offline, and online from ``data.val_source`` if given, else the prompt source's held-out eval split, so validation prompts never appear in training.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import lightning as L

from core.assets import chat_template_hash, load_tokenizer, resolve_model_dir
from data_prep.datamodules import FeatureDataModule, OnlineFeatureDataModule
from inference.drafters import LoadedModel, load_lm

_WEIGHTLESS = False  # set by weightless_targets(): dry runs build targets without reading their weights


@contextlib.contextmanager
def weightless_targets() -> Iterator[None]:
    """Inside the block ``loaded_target`` returns the target built on the meta device: its config, tokenizer and
    every tensor shape, but no weights read and no memory used, so a dry run validates an 8B recipe on a CPU."""
    global _WEIGHTLESS
    previous, _WEIGHTLESS = _WEIGHTLESS, True
    try:
        yield
    finally:
        _WEIGHTLESS = previous


def loaded_target(name: str, max_len: int, batch_size: int, device: str = "auto", chat_template: str = "auto"):
    """The target, loaded once per process and shared by the LightningModule and the online DataModule;
    ``chat_template`` (auto|none|PATH) sets how its tokenizer renders conversations."""
    if _WEIGHTLESS:
        return _weightless_target(name, chat_template)
    return _loaded_target(name, max_len, batch_size, device, chat_template)


@functools.lru_cache(maxsize=2)
def _loaded_target(name: str, max_len: int, batch_size: int, device: str, chat_template: str):
    import os

    import torch

    if device == "auto" and torch.cuda.is_available():
        # Multi-GPU launchers start one process per GPU and set LOCAL_RANK: each rank's target on its own GPU.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return load_lm(name, device=device, max_seq_len=max_len, max_batch_size=batch_size, chat_template=chat_template)


@functools.lru_cache(maxsize=2)
def _weightless_target(name: str, chat_template: str):
    """A ``LoadedModel`` whose model lives on the meta device and that has no runner (nothing can run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_dir(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return LoadedModel(str(name), None, load_tokenizer(name, chat_template), model.eval())


def trained_template(cfg: Any) -> dict[str, str]:
    """How a run's conversations were rendered, for its checkpoints' target record (``assets.check_chat_template``
    compares it where the drafter serves)."""
    tokenizer = loaded_target(cfg.target, cfg.data.max_len, cfg.data.batch_size,
                              chat_template=cfg.data.chat_template).tokenizer
    return {"chat_template": cfg.data.chat_template, "chat_template_hash": chat_template_hash(tokenizer)}


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


def build_feature_datamodule(cfg: Any, features: bool = True) -> L.LightningDataModule:
    """``features=False``: online token batches only, no target forward (``OnlineFeatureDataModule``)."""
    data = cfg.data
    if data.dataset_dir:
        if data.bucket_by_length or data.val_source:
            key = "bucket_by_length" if data.bucket_by_length else "val_source"
            raise ValueError(f"data.{key} applies to online features only; drop it with data.dataset_dir "
                             "(validation features: data.val_dataset_dir)")
        if data.window != "start":
            raise ValueError(f"data.window={data.window} applies to online features only: an extracted dataset's "
                             "window was fixed when it was extracted (python -m data_prep.extract ... window=answer)")
        return FeatureDataModule(data.dataset_dir, batch_size=data.batch_size, seed=cfg.seed,
                                 num_workers=data.num_workers, val_directory=data.val_dataset_dir,
                                 target=cfg.target, layers=data.layers, max_len=data.max_len,
                                 tokenizer=load_tokenizer(cfg.target, data.chat_template))
    target = loaded_target(cfg.target, data.max_len, data.batch_size, chat_template=data.chat_template)
    common = dict(source=data.source, max_len=data.max_len, layers=data.layers, dtype=data.dtype,
                  batch_size=data.batch_size, seed=cfg.seed, window=data.window, features=features)
    train = OnlineFeatureDataModule(target, n_samples=data.n_samples, split="train",
                                    bucket_by_length=data.bucket_by_length, **common)
    if data.val_source:  # its own held-out conversations, e.g. the target's answers to the eval split
        common["source"] = data.val_source
    val = OnlineFeatureDataModule(target, n_samples=data.n_val_samples, split="all" if data.val_source else "eval",
                                  shuffle=False, **common)
    return TrainValDataModule(train, val)
