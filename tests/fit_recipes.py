"""A toy recipe ``spectrain.fit`` trains in seconds, and its kind ``toy_regression``: importing this module
registers it (a child process gets it with ``SPECTRAIN_KIND_MODULES=fit_recipes``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from data_prep.datamodules import resumable_loader
from spectrain.registry import DrafterKind, register_kind

TOY_RECIPE = """# @package _global_
kind: toy_regression
run_name: toy
model:
  hidden: 8
  dropout: 0.0
  step_seconds: 0.0
optim:
  lr: 0.05
data:
  batch_size: 16
trainer:
  max_steps: 6
  val_check_interval: 2
  checkpoint_every_n_steps: 2
  monitor: val/loss
  monitor_mode: min
  accelerator: cpu
  devices: 1
"""


@dataclass
class ToyModelSchema:
    hidden: int = 8
    dropout: float = 0.0  # > 0 makes the training steps consume the global RNG (what resume must restore)
    step_seconds: float = 0.0  # a pause per step, so a test can kill the run between two checkpoints


class ToyRegression(pl.LightningModule):
    """A real (tiny) model so the trainer, checkpoints and resume are exercised end to end."""

    def __init__(self, hidden: int, lr: float, dropout: float = 0.0, step_seconds: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, 1)
        )
        self.lr, self.step_seconds = lr, step_seconds

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        time.sleep(self.step_seconds)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ToyData(pl.LightningDataModule):
    def __init__(self, batch_size: int):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        self.dataset = torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True))
        self.batch_size = batch_size

    def train_dataloader(self):
        return resumable_loader(self.dataset, batch_size=self.batch_size, shuffle=True, seed=0)

    def val_dataloader(self):
        return resumable_loader(self.dataset, batch_size=self.batch_size)


register_kind(
    DrafterKind(
        name="toy_regression",
        build_module=lambda cfg: ToyRegression(
            cfg.model.hidden, cfg.optim.lr, cfg.model.dropout, cfg.model.step_seconds
        ),
        build_datamodule=lambda cfg: ToyData(cfg.data.batch_size),
        model_schema=ToyModelSchema,
    )
)
