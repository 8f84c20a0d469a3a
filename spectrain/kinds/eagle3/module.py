"""``kind=eagle3``: train the EAGLE-3 drafter with the training-time test (recipe ``eagle3_smollm2``).

Per step j = 0..ttt_steps-1 the drafter reads its own hidden states of step j-1 and predicts token t+2+j; the
loss is the soft cross-entropy against the target's distribution restricted to the draft vocabulary, weighted
0.8^j, on assistant tokens whose target argmax lies in the draft vocabulary (EAGLE-3's position mask). The
teacher comes from the stored final hidden state through the target's lm_head (no stored logits).
``model.objective=accept`` adds ``accept_weight`` × −log(E/γ), E the expected accepted length of a γ-token chain,
Σ_k Π_{j≤k} Σ_v min(p_j, q_j) over the first γ steps (docs/algorithms/eagle3.md §9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import target_record
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.errors import UserError
from core.layer_ids import resolve_layers
from core.vocab import build_vocab_map, load_vocab_map
from data_prep.vocab import source_token_counts
from spectrain.checkpoint_contract import checkpoint_metadata
from spectrain.kinds.base import DrafterModule, build_datamodule
from spectrain.kinds.eagle3.export import export_eagle3_checkpoint
from spectrain.kinds.eagle3.losses import (
    OBJECTIVES,
    acceptance_term,
    expected_accepted_length,
    scored_rows,
    teacher_rows,
    ttt_loss,
)
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance, token_acceptance
from spectrain.registry import DrafterKind, register_kind
from spectrain.targets import loaded_target, trained_template


@dataclass
class Eagle3Schema:
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    vocab_map: str | None = None  # data_prep.vocab output; None + draft_vocab_size > 0: counted from data.source
    ttt_steps: int = 7  # training-time-test steps
    step_weight: float = 0.8  # loss weight of step j is step_weight ** j
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: drafted rows read the final norm's output (core.drafters.eagle3)
    attention_window: int = 0  # sliding-window drafter attention: a row reads its last positions (0: all)
    gamma: int = 4  # draft length the simulated acceptance assumes (<= ttt_steps)
    objective: str = (
        "kl"  # kl: soft cross-entropy only; accept: + accept_weight x -log(expected accepted length / gamma)
    )
    accept_weight: float = 1.0  # weight of the expected-acceptance term (objective=accept)


def vocab_map_for(cfg: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d2t, t2d) from ``model.vocab_map``, or counted over the recipe's training source; None = full vocab."""
    model = cfg.model
    if model.vocab_map:
        d2t, t2d, _ = load_vocab_map(model.vocab_map)
        if t2d.numel() != vocab_size:
            raise UserError(
                f"model.vocab_map={model.vocab_map} maps a {t2d.numel()}-token vocabulary but target "
                f"'{cfg.target}' has {vocab_size} tokens (built for another tokenizer); rebuild it with "
                f"python -m data_prep.vocab target={cfg.target} ..."
            )
        if model.draft_vocab_size and d2t.numel() != model.draft_vocab_size:
            raise UserError(
                f"model.vocab_map={model.vocab_map} has {d2t.numel()} draft ids but "
                f"model.draft_vocab_size={model.draft_vocab_size}; set model.draft_vocab_size="
                f"{d2t.numel()} (or 0: the map's size) or rebuild the map with that size"
            )
        return d2t, t2d
    if not model.draft_vocab_size or model.draft_vocab_size >= vocab_size:
        return None
    counting = OmegaConf.create(
        {
            "source": cfg.data.source,
            "n_samples": cfg.data.n_samples,
            "max_len": cfg.data.max_len,
            "split": "train",
            "seed": cfg.seed,
        }
    )
    # the target's tokenizer as loaded for this run (same chat template): no second load
    tokenizer = loaded_target(
        cfg.target, cfg.data.max_len, cfg.data.batch_size, chat_template=cfg.data.chat_template
    ).tokenizer
    counts = source_token_counts(counting, tokenizer, vocab_size)
    return build_vocab_map(counts, model.draft_vocab_size)


def draft_vocab_size(model: Any, vocab_map: tuple[torch.Tensor, torch.Tensor] | None, vocab_size: int) -> int:
    """The map's draft vocabulary size; without a map ``model.draft_vocab_size`` (0: the target's ``vocab_size``)."""
    return (model.draft_vocab_size or vocab_size) if vocab_map is None else int(vocab_map[0].numel())


def draft_vocabulary(cfg: Any, vocab_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int]:
    """(:func:`vocab_map_for`'s map, :func:`draft_vocab_size`). Counting the vocabulary reads the whole source: a dry
    run leaves it to the real run (no map)."""
    vocab_map = None if cfg.dry_run else vocab_map_for(cfg, vocab_size)
    return vocab_map, draft_vocab_size(cfg.model, vocab_map, vocab_size)


def check_objective(model: Any) -> None:
    """Refuse, in one line, an objective this kind does not train or a weight that is not a positive number."""
    if model.objective not in OBJECTIVES:
        raise UserError(
            f"model.objective={model.objective} is not one of {', '.join(OBJECTIVES)} (kl: soft cross-entropy; "
            "accept: also maximise the expected accepted length)"
        )
    weight = model.accept_weight
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        raise UserError(
            f"model.accept_weight={weight} must be a finite number > 0 (the expected-acceptance term's weight, "
            "e.g. 1.0)"
        )


class Eagle3Module(DrafterModule):
    def __init__(self, cfg: Any):
        check_objective(cfg.model)  # before the target loads
        super().__init__(cfg)

        target = self.target_model()
        model_cfg = cfg.model
        if model_cfg.gamma > model_cfg.ttt_steps:
            raise UserError(
                f"model.gamma={model_cfg.gamma} exceeds model.ttt_steps={model_cfg.ttt_steps}: the "
                f"draft steps simulated must be trained; set model.ttt_steps >= {model_cfg.gamma} or a "
                "smaller model.gamma"
            )
        layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
        vocab_map = vocab_map_for(cfg, target.config.vocab_size)
        draft_vocab = target.config.vocab_size if vocab_map is None else int(vocab_map[0].numel())
        config = Eagle3Config.for_target(
            target.config,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=list(layers),
            norm_before_residual=model_cfg.norm_before_residual,
            fc_norm=model_cfg.fc_norm,
            norm_output=model_cfg.norm_output,
            attention_window=model_cfg.attention_window,
        )
        self.drafter = Eagle3Drafter(config, embed_weight=target.get_input_embeddings().weight.detach())
        if vocab_map is not None:
            self.drafter.set_vocab_map(*vocab_map)
        self.val_greedy = SimulatedAcceptance(model_cfg.gamma)
        self.val_sampled = SimulatedAcceptance(model_cfg.gamma)  # at T = 1: what objective=accept maximises

    def _steps(self, batch: dict[str, torch.Tensor]):
        """Per TTT step: (student logits [N_j, Vd], teacher probs [N_j, Vd], their rows (batch, row)), over the
        rows that carry a loss only (``scored_rows``): the same rows and values as ``ttt_targets``' masks."""
        out = self.drafter(
            batch["input_ids"],
            batch["aux_hidden"].to(self.drafter.fc.weight.dtype),
            steps=self.cfg.model.ttt_steps,
            attention_mask=batch["attention_mask"],
            heads=False,
        )
        supervised = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        index, probs = teacher_rows(self.teacher_logits, batch["last_hidden"], supervised, self.drafter.t2d)
        for j, hidden in enumerate(out.hidden):
            b, i, n = scored_rows(index, j)
            yield self.drafter.head(hidden[b, i]), probs[n], (b, i)

    def training_step(self, batch, batch_idx):
        model_cfg = self.cfg.model
        students, teachers, rows = zip(*self._steps(batch))
        masks = [torch.ones(len(s), dtype=torch.bool, device=s.device) for s in students]
        loss, losses = ttt_loss(students, teachers, masks, step_weight=model_cfg.step_weight)
        self.log("train/loss_step0", losses[0])
        if model_cfg.objective == "accept":
            gamma = model_cfg.gamma
            accepted = expected_accepted_length(
                students[:gamma], teachers[:gamma], rows[:gamma], batch["input_ids"].shape
            )
            loss = loss + model_cfg.accept_weight * acceptance_term(accepted, gamma)
            self.log("train/accepted_length", accepted)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        # A chain from row t drafts with step k at position k+1 (its own hidden states, as when serving).
        alphas, sampled, masks = [], [], []
        shape = batch["input_ids"].shape
        for k, (student, teacher, (b, i)) in enumerate(self._steps(batch)):
            if k == 0:
                every = torch.ones(len(student), dtype=torch.bool, device=student.device)
                self.log("val/loss_step0", soft_cross_entropy(student, teacher, every), batch_size=shape[0])
            if k < self.cfg.model.gamma:
                alpha = torch.zeros(shape, device=student.device)
                alpha[b, i] = token_acceptance(student, teacher, greedy=True)
                sampled.append(
                    torch.zeros(shape, device=student.device).index_put(
                        (b, i), token_acceptance(student, teacher, greedy=False)
                    )
                )
                mask = torch.zeros(shape, dtype=torch.bool, device=student.device)
                mask[b, i] = True
                alphas.append(alpha)
                masks.append(mask)
        self.val_greedy.update(alphas, masks)
        self.val_sampled.update(sampled, masks)

    def on_validation_epoch_end(self):
        self.last_val_metrics = self.log_simulated_acceptance(self.val_greedy)
        tau_t1 = self.val_sampled.compute()["tau_sim"]
        self.val_sampled.reset()
        self.log("val/tau_sim_t1", tau_t1)
        self.last_val_metrics["tau_sim_t1"] = float(tau_t1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        target = {**target_record(self.cfg.target), **trained_template(self.cfg)}
        checkpoint["spectrain"] = checkpoint_metadata(
            self.drafter,
            target,
            recipe=dict(self.hparams["recipe"]),
            metrics={f"val/{k}": v for k, v in self.last_val_metrics.items()},
        )


register_kind(
    DrafterKind(
        name="eagle3",
        build_module=Eagle3Module,
        build_datamodule=build_datamodule,
        model_schema=Eagle3Schema,
        export_checkpoint=export_eagle3_checkpoint,
    )
)
