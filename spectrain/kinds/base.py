"""What every drafter's LightningModule shares: the recipe, the target's frozen lm_head as the teacher's
projection, the optimiser and schedule, the DataModule, and helpers several subclasses' ``__init__`` call (building
the drafter, the mask-token checks). Drafter-specific code lives in the subclasses."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import lightning as L
import torch
from omegaconf import OmegaConf

from core.assets import target_record
from core.overrides import RecipeError

from spectrain.data import build_feature_datamodule
from spectrain.strategies import shard_drafter
from spectrain.targets import loaded_target, trained_template


def cosine_with_warmup(step: int, warmup: int, total: int, kind: str) -> float:
    """LR multiplier: linear warm-up, then cosine decay to 10 % of the peak (or constant)."""
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


# DFlash's and P-EAGLE's drafter attention: block_sparse (chunked) | dense (the reference mask)
MASK_ATTENTION_KINDS = ("block_sparse", "dense")

DrafterT = TypeVar("DrafterT", bound=torch.nn.Module)


def check_mask_token_and_attention(model: Any) -> None:
    """The recipe checks of the drafters whose later slots read a mask token (DFlash, P-EAGLE)."""
    if model.mask_token_id is None:
        raise RecipeError(
            "model.mask_token_id is not set: give the id of a special token the training data never "
            "holds (SmolLM2: 16, <empty_output>; Llama-3: 128002, <|reserved_special_token_0|>)"
        )
    if model.attention not in MASK_ATTENTION_KINDS:
        raise RecipeError(f"model.attention={model.attention} is not one of {', '.join(MASK_ATTENTION_KINDS)}")


def build_drafter(
    cfg: Any, make: Callable[[], DrafterT], vocab_map: tuple[torch.Tensor, torch.Tensor] | None
) -> DrafterT:
    """``make()``'s drafter, its vocabulary map set (not on a dry run). A dry run (fit builds the target on the meta
    device) builds the drafter there too: shapes, no memory."""
    with torch.device("meta" if cfg.dry_run else "cpu"):
        drafter = make()
    if vocab_map is not None and not cfg.dry_run:
        drafter.set_vocab_map(*vocab_map)
    return drafter


def chain_hits(
    shape: torch.Size,
    right: torch.Tensor,
    position: torch.Tensor,
    rows: torch.Tensor,
    anchors: torch.Tensor,
    positions: range,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per chain position p in ``positions`` (a depth or a block slot): the [B, T] map of whether the row drafted at
    p from (batch row, anchor) was right, and the mask of the anchors that have such a row — what
    :class:`spectrain.metrics.SimulatedAcceptance` takes. ``right``, ``position``, ``rows``, ``anchors``: one entry per
    scored drafted row."""
    alphas, masks = [], []
    for p in positions:
        here = position == p
        alpha = torch.zeros(shape, device=right.device)
        alpha[rows[here], anchors[here]] = right[here].float()
        mask = torch.zeros(shape, dtype=torch.bool, device=right.device)
        mask[rows[here], anchors[here]] = True
        alphas.append(alpha)
        masks.append(mask)
    return alphas, masks


class DrafterModule(L.LightningModule):
    """Subclasses set ``self.drafter`` (the nn.Module that is exported) in their ``__init__``."""

    def __init__(self, cfg: Any):
        super().__init__()

        self.save_hyperparameters({"recipe": OmegaConf.to_container(cfg, resolve=True)})
        self.cfg = cfg
        target = self.target_model()
        # The teacher's projection: frozen and not saved (the target provides it again at load time).
        self.register_buffer("teacher_lm_head", target.lm_head.weight.detach().float().clone(), persistent=False)
        self.last_val_metrics: dict[str, float] = {}

    def log_simulated_acceptance(self, metric: Any) -> dict[str, float]:
        """Log a :class:`~spectrain.metrics.SimulatedAcceptance`'s ``val/tau_sim`` (on the progress bar),
        ``val/top1_agreement`` and ``val/acc_k``, reset it, and return its figures."""
        figures = metric.compute()
        self.log("val/tau_sim", figures["tau_sim"], prog_bar=True)
        self.log("val/top1_agreement", figures["acc_1"])
        for key, value in figures.items():
            if key.startswith("acc_"):
                self.log(f"val/{key}", value)
        metric.reset()
        return {key: float(value) for key, value in figures.items()}

    def target_model(self):
        """The target (loaded once per process; NOT a submodule, so it is neither trained nor checkpointed)."""
        return loaded_target(
            self.cfg.target, self.cfg.data.max_len, self.cfg.data.batch_size, chat_template=self.cfg.data.chat_template
        ).model

    def teacher_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits recomputed from its final (normed) hidden state."""
        return last_hidden.float() @ self.teacher_lm_head.T

    def checkpoint_block(self, kind: str) -> dict[str, Any]:
        """The ``spectrain`` block a checkpoint carries for export: kind, the drafter's config, the target record
        (its weights hashed once per run), the recipe and the last validation metrics."""
        if getattr(self, "_target_record", None) is None:
            self._target_record = {**target_record(self.cfg.target), **trained_template(self.cfg)}
        return {
            "kind": kind,
            "config": self.drafter.config.to_dict(),
            "target": self._target_record,
            "recipe": dict(self.hparams["recipe"]),
            "metrics": {f"val/{k}": v for k, v in self.last_val_metrics.items()},
        }

    FSDP_FORWARD_METHODS: tuple[str, ...] = ()  # drafter methods besides forward that training_step calls

    def configure_model(self) -> None:
        """Under ``trainer.strategy=fsdp`` (Lightning's ModelParallelStrategy gives the mesh): shard the drafter."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not getattr(self, "_sharded", False):
            shard_drafter(self.drafter, mesh["data_parallel"], self.FSDP_FORWARD_METHODS)
            self._sharded = True

    def on_validation_start(self) -> None:
        if getattr(self, "_sharded", False):  # validation calls drafter methods FSDP does not hook: gather first
            self.drafter.unshard()

    def on_validation_end(self) -> None:
        if getattr(self, "_sharded", False):
            self.drafter.reshard()

    def configure_optimizers(self):
        optim = self.cfg.optim
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        total = self.cfg.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: cosine_with_warmup(step, optim.warmup_steps, total, optim.scheduler)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build_datamodule(cfg: Any):
    return build_feature_datamodule(cfg)
