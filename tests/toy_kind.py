"""A drafter kind defined outside the library, as docs/drafter_kinds.md describes: a linear head over one target
layer's hidden state that drafts one token per round. Both halves register themselves when this module is imported
(the test puts this module in ``core.drafters.kinds.KIND_MODULES``, the one line a new kind adds): the engine half
(config, native layout, loader) serves it as an EAGLE-3 drafter (``serves_as``: ``eagle3_tree`` runs it), the
training half trains it with ``spectrain.fit`` and exports it with ``spectrain.export``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from core.assets import target_record
from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.native_export import read_export_dir, write_export_dir
from core.drafters.target_checks import check_native_target
from data_prep.datamodules import resumable_loader
from spectrain.checkpoint_reading import read_trained_drafter
from spectrain.registry import DrafterKind, register_kind

KIND = "toy_head"


@dataclass
class ToyHeadConfig:
    vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # one layer: the head reads its output

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ToyHeadConfig:
        return cls(**values)


class ToyCache:
    """How many rows each engine row's drafter holds (the head keeps no state: only the lengths the tree reads)."""

    def __init__(self, batch: int):
        self.held = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.held)

    @property
    def longest(self) -> int:
        return max(self.held, default=0)

    def truncate(self, lengths: list[int]) -> None:
        self.held = [int(n) for n in lengths]


class ToyHeadDrafter(nn.Module):
    """logits = W · h, h the target's hidden state at the aux layer: the interface ``eagle3_tree`` calls."""

    def __init__(self, config: ToyHeadConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.target_hidden_size, config.vocab_size, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def new_cache(self, max_len: int, batch_size: int = 1) -> ToyCache:
        return ToyCache(batch_size)

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ToyCache,
        attention_mask: torch.Tensor | None = None,
        counts: list[int] | None = None,
    ) -> SimpleNamespace:
        counts = counts if counts is not None else [tokens.shape[1]] * cache.batch
        cache.held = [held + n for held, n in zip(cache.held, counts)]
        return SimpleNamespace(logits=self.fc(hidden), hidden=hidden)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


# ---------------------------------------------------------------------------------------------- engine half


def save_toy_head(
    drafter: ToyHeadDrafter, out: str | Path, target: dict[str, Any], metrics: dict[str, Any] | None = None
) -> Path:
    block = {"kind": KIND, "target": target, "architecture": drafter.config.to_dict()}
    return write_export_dir(out, {"fc.weight": drafter.fc.weight.detach().contiguous()}, block, metrics=metrics)


def load_toy_head(path: str, target: Any) -> ToyHeadDrafter:
    config, tensors, block = read_export_dir(
        path, kind=KIND, title="toy head", loader="the toy head's loader", config_cls=ToyHeadConfig
    )
    check_native_target(path, config, block.get("target"), target)
    drafter = ToyHeadDrafter(config)
    drafter.load_state_dict(tensors)
    return drafter.to(device=target.runner.device, dtype=target.runner.dtype).eval()


ENGINE_KIND = register_engine_kind(
    EngineKind(
        name=KIND,
        title="toy head",
        needs="a toy head export of python -m spectrain.export for this target",
        config_class=ToyHeadConfig,
        load=load_toy_head,
        serves_as="eagle3",
    )
)


# -------------------------------------------------------------------------------------------- training half


@dataclass
class ToyHeadSchema:
    sequences: int = 32  # random token sequences the target is run on
    length: int = 16


class ToyHeadModule(pl.LightningModule):
    """Trains the head to predict the target's greedy next token from the aux layer's hidden state (the target runs
    frozen beside it, computing the features online)."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.frozen = {"target": AutoModelForCausalLM.from_pretrained(cfg.target).eval()}  # not a submodule
        model_config = self.frozen["target"].config
        self.drafter = ToyHeadDrafter(
            ToyHeadConfig(model_config.vocab_size, model_config.hidden_size, [model_config.num_hidden_layers - 2])
        )

    def training_step(self, batch, _):
        (tokens,) = batch
        with torch.no_grad():
            out = self.frozen["target"](tokens, output_hidden_states=True)
        hidden = out.hidden_states[self.drafter.config.aux_layer_ids[0] + 1]
        loss = nn.functional.cross_entropy(self.drafter.fc(hidden).flatten(0, 1), out.logits.argmax(-1).flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.drafter.parameters(), lr=self.cfg.optim.lr)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["spectrain"] = {
            "kind": KIND,
            "config": self.drafter.config.to_dict(),
            "target": target_record(self.cfg.target),
        }


class ToyHeadData(pl.LightningDataModule):
    def __init__(self, cfg: Any):
        super().__init__()
        tokens = torch.randint(
            0, 1000, (cfg.model.sequences, cfg.model.length), generator=torch.Generator().manual_seed(cfg.seed)
        )
        self.dataset, self.batch_size = torch.utils.data.TensorDataset(tokens), cfg.data.batch_size

    def train_dataloader(self):
        return resumable_loader(self.dataset, batch_size=self.batch_size, shuffle=True, seed=0)


def export_toy_head(path: Path, cfg: Any) -> Path:
    trained = read_trained_drafter(path, cfg.target)
    drafter = ToyHeadDrafter(ToyHeadConfig.from_dict(trained.meta["config"]))
    drafter.load_state_dict(trained.tensors)
    return save_toy_head(drafter, cfg.out, trained.target, trained.metrics)


TRAINING_KIND = register_kind(
    DrafterKind(
        name=KIND,
        build_module=ToyHeadModule,
        build_datamodule=ToyHeadData,
        model_schema=ToyHeadSchema,
        export_checkpoint=export_toy_head,
    )
)
