"""``kind=eagle3``: train the EAGLE-3 drafter with the training-time test (recipe ``eagle3_smollm2``).

Per step j = 0..ttt_steps-1 the drafter reads its own hidden states of step j-1 and predicts token t+2+j; the
loss is the soft cross-entropy against the target's distribution restricted to the draft vocabulary, weighted
0.8^j, on assistant tokens whose target argmax lies in the draft vocabulary (EAGLE-3's position mask). The
teacher comes from the stored final hidden state through the target's lm_head (no stored logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.assets import target_record
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter, shift_left
from core.layer_ids import resolve_layers
from core.vocab import build_vocab_map, load_vocab_map
from data_prep.vocab import counts_from_source
from spectrain.checkpoint_contract import checkpoint_metadata
from spectrain.data import trained_template
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance, token_acceptance
from spectrain.modules.base import DrafterModule, build_datamodule
from spectrain.registry import DrafterKind, register_kind


@dataclass
class Eagle3Schema:
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    vocab_map: str | None = None  # data_prep.vocab output; None + draft_vocab_size > 0: counted from data.source
    ttt_steps: int = 7  # training-time-test steps
    step_weight: float = 0.8  # loss weight of step j is step_weight ** j
    norm_before_residual: bool = False
    gamma: int = 4  # draft length the simulated acceptance assumes (<= ttt_steps)


def vocab_map_for(cfg: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d2t, t2d) from ``model.vocab_map``, or counted over the recipe's training source; None = full vocab."""
    from omegaconf import OmegaConf

    model = cfg.model
    if model.vocab_map:
        d2t, t2d, _ = load_vocab_map(model.vocab_map)
        if t2d.numel() != vocab_size:
            raise ValueError(f"model.vocab_map={model.vocab_map} maps a {t2d.numel()}-token vocabulary but target "
                             f"'{cfg.target}' has {vocab_size} tokens (built for another tokenizer); rebuild it with "
                             f"python -m data_prep.vocab target={cfg.target} ...")
        if model.draft_vocab_size and d2t.numel() != model.draft_vocab_size:
            raise ValueError(f"model.vocab_map={model.vocab_map} has {d2t.numel()} draft ids but "
                             f"model.draft_vocab_size={model.draft_vocab_size}; set model.draft_vocab_size="
                             f"{d2t.numel()} (or 0: the map's size) or rebuild the map with that size")
        return d2t, t2d
    if not model.draft_vocab_size or model.draft_vocab_size >= vocab_size:
        return None
    counting = OmegaConf.create({"target": cfg.target, "source": cfg.data.source, "n_samples": cfg.data.n_samples,
                                 "max_len": cfg.data.max_len, "split": "train", "seed": cfg.seed,
                                 "chat_template": cfg.data.chat_template})
    counts, _ = counts_from_source(counting)
    return build_vocab_map(counts, model.draft_vocab_size)


def teacher_in_draft_vocab(logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [..., V] restricted to the draft vocabulary [..., Vd], and whether the target's argmax is in
    it [...] (EAGLE-3's position mask)."""
    return logits[..., t2d], t2d[logits.argmax(-1)]


def ttt_targets(teacher_logits: torch.Tensor, in_vocab: torch.Tensor, supervised: torch.Tensor,
                steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per TTT step j: (teacher probs [B, T, Vd], mask [B, T]) aligned with the drafter's rows.

    ``teacher_logits`` [B, T, Vd] / ``in_vocab`` [B, T]: the target's distribution at position t (over the draft
    vocabulary) and whether its argmax is drafted; ``supervised`` [B, T]: tokens that carry a loss. Row i at step
    j predicts token i+2+j from the target's distribution at position i+1+j. Shared by training and the online
    adapter (``spectrain.adapt``)."""
    targets = []
    for j in range(steps):
        teacher = shift_left(teacher_logits, j + 1).softmax(-1)
        mask = shift_left(supervised, j + 2, fill=False) & shift_left(in_vocab, j + 1, fill=False)
        targets.append((teacher, mask))
    return targets


def teacher_rows(project: Any, last_hidden: torch.Tensor, supervised: torch.Tensor,
                 t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher at the positions a training-time-test loss reads, computed once for every step.

    Step j's row i is scored against the target's distribution at p = i+1+j when token p+1 is supervised and the
    target's argmax at p is drafted, so the positions needed are the same for every j. Returns ``index`` [B, T]
    (teacher row of position p, -1 where p is never scored) and ``probs`` [N, Vd] (draft-vocabulary softmax).
    ``project`` maps final hidden states [N, H] to the target's logits [N, V]."""
    need = shift_left(supervised, 1, fill=False)
    b, p = need.nonzero(as_tuple=True)
    restricted, in_vocab = teacher_in_draft_vocab(project(last_hidden[b, p]), t2d)
    keep = in_vocab.nonzero(as_tuple=True)[0]
    index = torch.full(supervised.shape, -1, dtype=torch.long, device=supervised.device)
    index[b[keep], p[keep]] = torch.arange(len(keep), device=supervised.device)
    return index, restricted[keep].softmax(-1)


def scored_rows(index: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (batch b, row i) that step ``step`` scores, and their teacher rows n (``teacher_rows``' index): the
    same rows as ``ttt_targets``' mask, as index lists."""
    shifted = shift_left(index, step + 1, fill=-1)
    b, i = (shifted >= 0).nonzero(as_tuple=True)
    return b, i, shifted[b, i]


def ttt_loss(students: Sequence[torch.Tensor], teachers: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
             *, step_weight: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ_j step_weight^j · soft-CE(student_j, teacher_j, mask_j), and the unweighted per-step losses."""
    losses = [soft_cross_entropy(s, t, m) for s, t, m in zip(students, teachers, masks)]
    return torch.stack([step_weight**j * loss for j, loss in enumerate(losses)]).sum(), losses


class Eagle3Module(DrafterModule):
    def __init__(self, cfg: Any):
        super().__init__(cfg)

        target = self.target_model()
        model_cfg = cfg.model
        if model_cfg.gamma > model_cfg.ttt_steps:
            raise ValueError(f"model.gamma={model_cfg.gamma} exceeds model.ttt_steps={model_cfg.ttt_steps}")
        layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
        vocab_map = vocab_map_for(cfg, target.config.vocab_size)
        draft_vocab = target.config.vocab_size if vocab_map is None else int(vocab_map[0].numel())
        config = Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=list(layers),
                                         norm_before_residual=model_cfg.norm_before_residual)
        self.drafter = Eagle3Drafter(config, embed_weight=target.get_input_embeddings().weight.detach())
        if vocab_map is not None:
            self.drafter.set_vocab_map(*vocab_map)
        self.val_greedy = SimulatedAcceptance(model_cfg.gamma)

    def _steps(self, batch: dict[str, torch.Tensor]):
        """Per TTT step: (student logits [N_j, Vd], teacher probs [N_j, Vd], their rows (batch, row)), over the
        rows that carry a loss only (``scored_rows``): the same rows and values as ``ttt_targets``' masks."""
        out = self.drafter(batch["input_ids"], batch["aux_hidden"].to(self.drafter.fc.weight.dtype),
                           steps=self.cfg.model.ttt_steps, attention_mask=batch["attention_mask"], heads=False)
        supervised = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        index, probs = teacher_rows(self.teacher_logits, batch["last_hidden"], supervised, self.drafter.t2d)
        for j, hidden in enumerate(out.hidden):
            b, i, n = scored_rows(index, j)
            yield self.drafter.head(hidden[b, i]), probs[n], (b, i)

    def training_step(self, batch, batch_idx):
        students, teachers, _ = zip(*self._steps(batch))
        masks = [torch.ones(len(s), dtype=torch.bool, device=s.device) for s in students]
        loss, losses = ttt_loss(students, teachers, masks, step_weight=self.cfg.model.step_weight)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/loss_step0", losses[0])
        return loss

    def validation_step(self, batch, batch_idx):
        # A chain from row t drafts with step k at position k+1 (its own hidden states, as when serving).
        alphas, masks = [], []
        shape = batch["input_ids"].shape
        for k, (student, teacher, (b, i)) in enumerate(self._steps(batch)):
            if k == 0:
                every = torch.ones(len(student), dtype=torch.bool, device=student.device)
                self.log("val/loss_step0", soft_cross_entropy(student, teacher, every), batch_size=shape[0])
            if k < self.cfg.model.gamma:
                alpha = torch.zeros(shape, device=student.device)
                alpha[b, i] = token_acceptance(student, teacher, greedy=True)
                mask = torch.zeros(shape, dtype=torch.bool, device=student.device)
                mask[b, i] = True
                alphas.append(alpha)
                masks.append(mask)
        self.val_greedy.update(alphas, masks)

    def on_validation_epoch_end(self):
        greedy = self.val_greedy.compute()
        self.log("val/tau_sim", greedy["tau_sim"], prog_bar=True)
        self.log("val/top1_agreement", greedy["acc_1"])
        for key, value in greedy.items():
            if key.startswith("acc_"):
                self.log(f"val/{key}", value)
        self.last_val_metrics = {key: float(value) for key, value in greedy.items()}
        self.val_greedy.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        target = {**target_record(self.cfg.target), **trained_template(self.cfg)}
        checkpoint["spectrain"] = checkpoint_metadata(self.drafter, target,
                                                      recipe=dict(self.hparams["recipe"]),
                                                      metrics={f"val/{k}": v for k, v in self.last_val_metrics.items()})


register_kind(DrafterKind(name="eagle3", build_module=Eagle3Module, build_datamodule=build_datamodule,
                          model_schema=Eagle3Schema))
