"""``kind=draft_lm``: distil a layer-dropped copy of the target into a draft LM (recipe ``draftlm_smollm2``).

The teacher distribution is recomputed from the stored (or online-captured) final hidden state through the
target's lm_head, so no logits are ever stored. Loss: soft cross-entropy (= forward KL up to a constant) on
assistant tokens. Metrics: simulated acceptance (``spectrain.metrics``) greedy and at T=1.

``model.teacher=tokens`` trains on the data's next tokens instead (cross-entropy, no target forward at all).
On data the target answered greedily (``data_prep.regenerate``) the next answer token is the target's argmax,
so this is distillation of exactly what greedy verification accepts, at the cost of the draft model alone
(the online teacher's 30-layer forward is most of a ``teacher=target`` step on a CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from core import assets
from core.distributed import process_mean
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.draft_lm import add_lora, evenly_spaced_layers, export_draft_lm, freeze_embeddings, layer_drop_init
from core.overrides import OverrideError
from spectrain.checkpoint_reading import read_lightning_checkpoint
from spectrain.data import build_feature_datamodule
from spectrain.kinds.base import DrafterModule
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance, token_acceptance
from spectrain.registry import DrafterKind, register_kind
from spectrain.targets import loaded_target, trained_template


@dataclass
class DraftLMSchema:
    num_layers: int = 4  # decoder layers kept from the target (evenly spaced, first and last included)
    layers: list[int] | None = None  # explicit layer ids instead of num_layers
    lora_rank: int = 0  # 0 = train the copied layers fully; > 0 = LoRA adapters on them (peft)
    gamma: int = 4  # draft length the simulated acceptance assumes
    freeze_embeddings: bool = True
    teacher: str = "target"  # target: the target's distribution (soft CE) | tokens: the data's next token (CE)
    # teacher=tokens only: train the logits of the K lowest ids, the ones the engine's draft_vocab=K drafts from
    # (0 = all). On a CPU the 49k-row lm_head is most of a step's cost; K = 8192 cuts it 6x.
    train_vocab: int = 0
    # train_vocab=K only: each training batch also trains the logits of the distinct label ids >= K its supervised
    # positions hold (an in-batch sampled softmax: columns K.. are those ids), so every label carries loss and the
    # rare ids (nouns copied from the prompt) are learnt as positives, and as negatives for the batch's other
    # rows, for a full-head consumer (SSD's fork candidates). false: labels >= K carry no loss. Validation stays
    # over the K lowest ids either way (it models serving with draft_vocab=K).
    train_vocab_labels: bool = False


TEACHERS = ("target", "tokens")


class DraftLMModule(DrafterModule):
    def __init__(self, cfg: Any):
        super().__init__(cfg)
        target = self.target_model()
        model_cfg = cfg.model
        if model_cfg.teacher not in TEACHERS:
            raise ValueError(f"model.teacher must be one of {', '.join(TEACHERS)}, got '{model_cfg.teacher}'")
        self.hard_labels = model_cfg.teacher == "tokens"
        self.train_vocab = int(model_cfg.get("train_vocab", 0) or 0)
        self.train_vocab_labels = bool(model_cfg.get("train_vocab_labels", False))
        if self.train_vocab_labels and not (self.train_vocab > 0 and self.hard_labels):
            raise ValueError(
                "model.train_vocab_labels=true needs model.train_vocab=K > 0 and model.teacher=tokens "
                "(it extends the K trained ids); set both, or model.train_vocab_labels=false"
            )
        if self.train_vocab and not self.hard_labels:
            raise ValueError(
                "model.train_vocab needs model.teacher=tokens (a soft teacher's mass outside the K ids "
                "has nowhere to go); set model.train_vocab=0 or model.teacher=tokens"
            )
        keep = (
            list(model_cfg.layers)
            if model_cfg.layers
            else evenly_spaced_layers(target.config.num_hidden_layers, model_cfg.num_layers)
        )
        self.kept_layers = keep
        draft = layer_drop_init(target, keep)
        if model_cfg.freeze_embeddings:
            freeze_embeddings(draft)
        self.drafter = add_lora(draft, model_cfg.lora_rank) if model_cfg.lora_rank else draft
        if self.train_vocab:
            # A method of the drafter, so FSDP can gather its weights around the call as around forward (the
            # head reads the base model and lm_head directly, which FSDP does not hook).
            self.drafter.train_vocab_logits = functools.partial(train_vocab_logits, self.drafter, self.train_vocab)
            self.FSDP_FORWARD_METHODS = ("train_vocab_logits",)
        self.val_greedy = SimulatedAcceptance(model_cfg.gamma)
        self.val_sampled = SimulatedAcceptance(model_cfg.gamma)

    def _step(self, batch: dict[str, torch.Tensor], batch_labels: bool = False):
        """(loss, greedy acceptance, T=1 acceptance, mask), all per position t predicting token t+1.

        ``batch_labels`` (training with ``train_vocab_labels``): the loss's softmax also spans the batch's
        supervised label ids >= ``train_vocab``; greedy acceptance stays the argmax over the K lowest ids."""
        # Position t predicts token t+1: it is supervised when token t+1 is an assistant token.
        predicts_answer = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, 1:].bool()
        if self.hard_labels:
            labels = batch["input_ids"][:, 1:]
            if batch_labels:
                student, columns = self._batch_label_logits(batch, labels, predicts_answer)
            else:
                student, columns = self._logits(batch)[:, :-1], labels
            log_q = F.log_softmax(student.float(), dim=-1)
            # A label outside the trained ids can never be drafted: α = 0 there, and it carries no loss.
            in_vocab = columns < log_q.shape[-1]
            log_q_label = log_q.gather(-1, columns.clamp(max=log_q.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            log_q_label = log_q_label.masked_fill(~in_vocab, 0.0)
            weights = (predicts_answer & in_vocab).float()
            loss = process_mean(-(log_q_label * weights).sum(), weights.sum())
            with torch.no_grad():  # a one-hot teacher: α = 1[argmax q = label] greedy, q(label) at T=1
                sampled = log_q_label.exp() * in_vocab
                drafted = student[..., : self.train_vocab] if batch_labels else student  # draft_vocab=K's argmax
                return loss, (drafted.argmax(-1) == labels).float(), sampled, predicts_answer
        student = self.drafter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        teacher = self.teacher_logits(batch["last_hidden"]).softmax(-1)[:, :-1]
        with torch.no_grad():
            greedy = token_acceptance(student, teacher, greedy=True)
            sampled = token_acceptance(student, teacher, greedy=False)
        return soft_cross_entropy(student, teacher, predicts_answer), greedy, sampled, predicts_answer

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The drafter's logits, over the first ``train_vocab`` ids only when that is set."""
        if not self.train_vocab:
            return self.drafter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return self.drafter.train_vocab_logits(batch["input_ids"], batch["attention_mask"])

    def _batch_label_logits(
        self, batch: dict[str, torch.Tensor], labels: torch.Tensor, supervised: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits per position t predicting t+1 over the K lowest ids plus the batch's extra ids U, each label's
        column): column K + j stands for id U[j], U the sorted distinct supervised labels >= K. A label >= K at an
        unsupervised position gets column K + len(U), outside the logits (no loss), as without the option."""
        k = self.train_vocab
        extra_ids = torch.unique(labels[supervised & (labels >= k)])  # sorted
        student = self.drafter.train_vocab_logits(batch["input_ids"], batch["attention_mask"], extra_ids)[:, :-1]
        outside = torch.full_like(labels, k + len(extra_ids))
        extra_columns = torch.where(
            torch.isin(labels, extra_ids), k + torch.searchsorted(extra_ids, labels.contiguous()), outside
        )
        return student, torch.where(labels < k, labels, extra_columns)

    def training_step(self, batch, batch_idx):
        loss, greedy, _, mask = self._step(batch, batch_labels=self.train_vocab_labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1_agreement", greedy[mask].mean(), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        # Over the K lowest ids only, whatever train_vocab_labels says: validation models serving with
        # draft_vocab=K, where an id >= K is never drafted (α = 0 there, and val/loss skips it).
        loss, greedy, sampled, mask = self._step(batch)
        self.val_greedy.update(greedy, mask)
        self.val_sampled.update(sampled, mask)
        self.log("val/loss", loss, batch_size=len(batch["input_ids"]))

    def on_validation_epoch_end(self):
        greedy, sampled = self.val_greedy.compute(), self.val_sampled.compute()
        self.log("val/tau_sim", greedy["tau_sim"], prog_bar=True)
        self.log("val/tau_sim_t1", sampled["tau_sim"])
        for key, value in greedy.items():
            if key.startswith("acc_"):
                self.log(f"val/{key}", value)
        self.log("val/top1_agreement", greedy["acc_1"])
        self.last_val_metrics = {
            "val/tau_sim": float(greedy["tau_sim"]),
            "val/tau_sim_t1": float(sampled["tau_sim"]),
            **{f"val/{k}": float(v) for k, v in greedy.items() if k.startswith("acc_")},
        }
        self.val_greedy.reset()
        self.val_sampled.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What spectrain.export reads: the kind, and the metrics the exported model was selected by.
        checkpoint["spectrain"] = {
            "kind": "draft_lm",
            "kept_layers": self.kept_layers,
            "metrics": self.last_val_metrics,
        }

    def export(self, out_dir, metrics: dict | None = None) -> None:
        """A loadable draft-LM directory: HF weights + tokenizer + the ``spectrain`` block."""
        tokenizer = loaded_target(
            self.cfg.target, self.cfg.data.max_len, self.cfg.data.batch_size, chat_template=self.cfg.data.chat_template
        ).tokenizer
        block = {
            "kind": "draft_lm",
            "target": {**assets.model_identity(self.cfg.target), **trained_template(self.cfg)},
            "kept_layers": self.kept_layers,
            "metrics": metrics or {},
        }
        export_draft_lm(self.drafter, tokenizer, out_dir, spectrain_block=block)


def train_vocab_logits(
    drafter: torch.nn.Module,
    k: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    extra_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``drafter``'s logits over its first ``k`` ids only: the final hidden state times ``k`` rows of lm_head;
    with ``extra_ids`` (ids >= k), their rows' logits follow as columns k, k+1, ... (``train_vocab_labels``)."""
    causal_lm = drafter.get_base_model() if hasattr(drafter, "get_base_model") else drafter
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weight = causal_lm.lm_head.weight
    if extra_ids is None or not len(extra_ids):
        return hidden @ weight[:k].T
    return hidden @ torch.cat([weight[:k], weight[extra_ids]]).T


def build_draft_lm_datamodule(cfg: Any):
    # teacher=tokens needs no hidden states: token batches only, the target never runs during training.
    return build_feature_datamodule(cfg, features=cfg.model.get("teacher", "target") != "tokens")


def export_draft_lm_checkpoint(path: Path, cfg: Any) -> Path:
    """A draft LM is a plain causal LM: exported as a loadable HF directory (weights, tokenizer, spectrain block)."""
    if cfg.format != "native":
        raise OverrideError(
            f"a draft_lm exports only as format=native (a Hugging Face directory); '{cfg.format}' is an EAGLE-3 layout"
        )
    out = Path(cfg.out)
    if out.exists():
        raise CheckpointError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    raw = read_lightning_checkpoint(path)
    recipe = OmegaConf.create(raw["hyper_parameters"]["recipe"])
    if cfg.target and cfg.target != recipe.target:
        raise CheckpointError(f"{path} was trained for target '{recipe.target}', not '{cfg.target}'")
    module = DraftLMModule.load_from_checkpoint(path, cfg=recipe, map_location="cpu", weights_only=False)
    metrics = (raw.get("spectrain") or {}).get("metrics") or {}
    module.export(out, metrics={**metrics, "global_step": raw.get("global_step"), "source": str(path)})
    return out


register_kind(
    DrafterKind(
        name="draft_lm",
        build_module=DraftLMModule,
        build_datamodule=build_draft_lm_datamodule,
        model_schema=DraftLMSchema,
        export_checkpoint=export_draft_lm_checkpoint,
    )
)
