"""The recipe CLI: composition, one-line errors, run directory, resume=auto."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

from spectrain import fit as fit_cli
from spectrain.overrides import OverrideError, resolve_key
from spectrain.registry import DrafterKind, register_kind

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ToyModelSchema:
    hidden: int = 8


class ToyRegression(pl.LightningModule):
    """A real (tiny) model so the trainer, checkpoints and resume are exercised end to end."""

    def __init__(self, hidden: int, lr: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
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
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size)


register_kind(DrafterKind(
    name="toy_regression",
    build_module=lambda cfg: ToyRegression(cfg.model.hidden, cfg.optim.lr),
    build_datamodule=lambda cfg: ToyData(cfg.data.batch_size),
    model_schema=ToyModelSchema,
))

TOY_RECIPE = """# @package _global_
kind: toy_regression
run_name: toy
model:
  hidden: 8
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


@pytest.fixture()
def recipes(tmp_path: Path) -> Path:
    directory = tmp_path / "recipes"
    (directory / "recipe").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "config.yaml", directory / "config.yaml")
    (directory / "recipe" / "toy.yaml").write_text(TOY_RECIPE)
    return directory


def compose(recipes: Path, *args: str):
    return fit_cli.compose_recipe(list(args), directory=recipes)


def test_compose_applies_overrides_by_path_and_by_unique_leaf(recipes, tmp_path):
    cfg = compose(recipes, "recipe=toy", "trainer.max_steps=3", "lr=0.5", "model.hidden=4", f"runs_dir={tmp_path}")
    assert cfg.trainer.max_steps == 3 and cfg.optim.lr == 0.5 and cfg.model.hidden == 4
    assert cfg.kind == "toy_regression" and cfg.data.batch_size == 16


@pytest.mark.parametrize("args, needle", [
    (("recipe=toy", "max_stepz=3"), "unknown key 'max_stepz' (did you mean 'max_steps'?); valid keys:"),
    (("recipe=toy", "model.width=3"), "unknown key 'model.width'"),
    (("recipe=nope",), "unknown recipe 'nope'; available: toy"),
    (("max_steps=1",), "no recipe given"),
    (("recipe=toy", "logger=neptune"), "logger=neptune is not one of csv, wandb, tensorboard"),
    (("recipe=toy", "strategy=horovod"), "trainer.strategy=horovod is not one of"),
    (("recipe=toy", "kind=nope"), "unknown kind 'nope'"),
    (("recipe=toy", "trainer.max_steps=abc"), "bad override"),
    (("recipe=toy", "oops"), "is not key=value"),
])
def test_bad_input_fails_with_one_line(recipes, args, needle):
    with pytest.raises(OverrideError) as info:
        compose(recipes, *args)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_ambiguous_leaf_key_is_refused(recipes):
    # both data.* and trainer.* would need a qualified name if a leaf repeats; 'lr' is unique, 'hidden' too,
    # so build an ambiguity through the model dict: model.max_steps vs trainer.max_steps.
    with pytest.raises(OverrideError, match="ambiguous"):
        resolve_key("max_steps", ["trainer.max_steps", "model.max_steps"])


def test_fit_saves_run_info_and_resume_auto_continues(recipes, tmp_path):
    runs = tmp_path / "runs"
    cfg = compose(recipes, "recipe=toy", f"runs_dir={runs}")
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 6
    saved = OmegaConf.load(runs / "toy" / "recipe.yaml")
    assert saved.kind == "toy_regression" and saved.trainer.max_steps == 6
    info = json.loads((runs / "toy" / "run_info.json").read_text())
    assert info["git_commit"]
    assert (runs / "toy" / "checkpoints" / "last.ckpt").is_file()
    assert list((runs / "toy" / "logs").glob("version_*/metrics.csv"))

    resumed = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={runs}", "resume=auto", "max_steps=10"))
    assert resumed["global_step"] == 10
    state = torch.load(runs / "toy" / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 10


def test_resume_path_must_exist(recipes, tmp_path):
    cfg = compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "resume=/no/such.ckpt")
    with pytest.raises(fit_cli.RecipeError, match="no such checkpoint"):
        fit_cli.fit(cfg)


def test_dry_run_builds_without_training(recipes, tmp_path):
    result = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "dry_run=true", "logger=tensorboard"))
    assert result == {"run_dir": str(tmp_path / "toy"), "trained": False, "strategy": "SingleDeviceStrategy"}
    assert not (tmp_path / "toy" / "checkpoints").exists()


def test_cli_unknown_recipe_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spectrain.fit", "recipe=definitely_not_a_recipe"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown recipe 'definitely_not_a_recipe'")


def test_wandb_logger_is_offline_without_an_api_key(recipes, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "logger=wandb")
    logger = fit_cli.build_logger(cfg, tmp_path / "toy")
    assert type(logger).__name__ == "WandbLogger" and logger._offline


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_gpu_only_strategies_fail_fast_on_cpu_and_dry_run_builds_the_strategy(recipes, tmp_path):
    cfg = compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "strategy=fsdp")
    with pytest.raises(fit_cli.RecipeError, match="trainer.strategy=fsdp needs CUDA GPUs"):
        fit_cli.fit(cfg)
    result = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "strategy=fsdp", "dry_run=true"))
    assert result["strategy"] == "FSDPStrategy" and not result["trained"]
    assert fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "strategy=ddp", "dry_run=true",
                               "devices=1"))["strategy"] == "DDPStrategy"
