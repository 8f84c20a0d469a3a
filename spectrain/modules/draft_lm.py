"""``kind=draft_lm``: distil a layer-dropped copy of the target into a draft LM (recipe ``draftlm_smollm2``).

The teacher distribution is recomputed from the stored (or online-captured) final hidden state through the
target's lm_head, so no logits are ever stored. Loss: soft cross-entropy (= forward KL up to a constant) on
assistant tokens. Metrics: simulated acceptance (``spectrain.metrics``) greedy and at T=1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spectrain.drafters.draft_lm import add_lora, evenly_spaced_layers, export_draft_lm, freeze_embeddings, layer_drop_init
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance, token_acceptance
from spectrain.modules.base import DrafterModule, build_datamodule
from spectrain.registry import DrafterKind, register_kind


@dataclass
class DraftLMSchema:
    num_layers: int = 4  # decoder layers kept from the target (evenly spaced, first and last included)
    layers: list[int] | None = None  # explicit layer ids instead of num_layers
    lora_rank: int = 0  # 0 = train the copied layers fully; > 0 = LoRA adapters on them (peft)
    gamma: int = 4  # draft length the simulated acceptance assumes
    freeze_embeddings: bool = True


class DraftLMModule(DrafterModule):
    def __init__(self, cfg: Any):
        super().__init__(cfg)
        target = self.target_model()
        model_cfg = cfg.model
        keep = list(model_cfg.layers) if model_cfg.layers else evenly_spaced_layers(
            target.config.num_hidden_layers, model_cfg.num_layers)
        self.kept_layers = keep
        draft = layer_drop_init(target, keep)
        if model_cfg.freeze_embeddings:
            freeze_embeddings(draft)
        self.drafter = add_lora(draft, model_cfg.lora_rank) if model_cfg.lora_rank else draft
        self.val_greedy = SimulatedAcceptance(model_cfg.gamma)
        self.val_sampled = SimulatedAcceptance(model_cfg.gamma)

    def _step(self, batch: dict[str, torch.Tensor]):
        logits = self.drafter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        teacher = self.teacher_logits(batch["last_hidden"]).softmax(-1)
        # Position t predicts token t+1: it is supervised when token t+1 is an assistant token.
        predicts_answer = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, 1:].bool()
        student, teacher = logits[:, :-1], teacher[:, :-1]
        return soft_cross_entropy(student, teacher, predicts_answer), student, teacher, predicts_answer

    def training_step(self, batch, batch_idx):
        loss, student, teacher, mask = self._step(batch)
        with torch.no_grad():
            top1 = token_acceptance(student, teacher, greedy=True)[mask].mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1_agreement", top1, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, student, teacher, mask = self._step(batch)
        self.val_greedy.update(token_acceptance(student, teacher, greedy=True), mask)
        self.val_sampled.update(token_acceptance(student, teacher, greedy=False), mask)
        self.log("val/loss", loss, batch_size=len(batch["input_ids"]))

    def on_validation_epoch_end(self):
        greedy, sampled = self.val_greedy.compute(), self.val_sampled.compute()
        self.log("val/tau_sim", greedy["tau_sim"], prog_bar=True)
        self.log("val/tau_sim_t1", sampled["tau_sim"])
        for key, value in greedy.items():
            if key.startswith("acc_"):
                self.log(f"val/{key}", value)
        self.log("val/top1_agreement", greedy["acc_1"])
        self.last_val_metrics = {"val/tau_sim": float(greedy["tau_sim"]), "val/tau_sim_t1": float(sampled["tau_sim"]),
                                 **{f"val/{k}": float(v) for k, v in greedy.items() if k.startswith("acc_")}}
        self.val_greedy.reset()
        self.val_sampled.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What spectrain.export reads: the kind, and the metrics the exported model was selected by.
        checkpoint["spectrain"] = {"kind": "draft_lm", "kept_layers": self.kept_layers,
                                   "metrics": self.last_val_metrics}

    def export(self, out_dir, metrics: dict | None = None) -> None:
        """A loadable draft-LM directory: HF weights + tokenizer + the ``spectrain`` block."""
        from spectrain import assets
        from spectrain.data import loaded_target

        tokenizer = loaded_target(self.cfg.target, self.cfg.data.max_len, self.cfg.data.batch_size).tokenizer
        block = {"kind": "draft_lm", "target": assets.model_identity(self.cfg.target), "kept_layers": self.kept_layers,
                 "metrics": metrics or {}}
        export_draft_lm(self.drafter, tokenizer, out_dir, spectrain_block=block)


register_kind(DrafterKind(name="draft_lm", build_module=DraftLMModule, build_datamodule=build_datamodule,
                          model_schema=DraftLMSchema))
