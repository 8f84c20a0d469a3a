"""``kind=dflash``: train the DFlash drafter (arXiv 2602.06036; recipes ``dflash_*``).

Per step, per sequence: anchors sampled among the answer tokens (:func:`spectrain.kinds.dflash.losses.sample_anchors`),
each row with its own generator seeded by (seed, step, the row's index in the GLOBAL batch) and over its own length,
so a resumed run draws the same anchors and N processes with batch b draw, row for row, what one process with batch
N·b draws (a row's anchors depend neither on the process count nor on the other rows' lengths); validation seeds a
row by its sample index. One drafter forward runs every anchor's block at
once with the block-sparse anchor attention (:mod:`core.drafters.dflash.attention`); the loss is the slot-weighted
KL against the target's distribution over the draft vocabulary (:mod:`spectrain.kinds.dflash.losses`). The teacher comes
from the stored (or online) final hidden state through the target's lm_head rows of the draft vocabulary; features
are the target's layers ``data.layers`` (``dflashK``: z-lab's spread), online as for EAGLE-3 or from a dataset.

Validation: per anchor, slot k is right when its argmax equals the target's; ``val/tau_sim`` = 1 + E[the run of
right slots from slot 1], over blocks whose slots are all scored (γ = block_size - 1). For DFlash this is what a
greedy round serves, not a proxy: the block reads only the context, so teacher forcing changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.distributed import process_rank
from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.layer_ids import resolve_layers
from core.overrides import RecipeError
from spectrain.kinds.base import (
    DrafterModule,
    build_datamodule,
    build_drafter,
    chain_hits,
    check_mask_token_and_attention,
)
from spectrain.kinds.dflash.export import export_dflash_checkpoint
from spectrain.kinds.dflash.losses import sample_anchors, scored_slots, slot_weights, weighted_kl
from spectrain.kinds.eagle3.module import draft_vocabulary
from spectrain.metrics import SimulatedAcceptance
from spectrain.registry import DrafterKind, register_kind


@dataclass
class DFlashSchema:
    mask_token_id: int | None = None  # the id every non-anchor slot reads: a special token the data never holds
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    vocab_map: str | None = None  # data_prep.vocab output; None + draft_vocab_size > 0: counted from data.source
    block_size: int = 8  # anchor + drafted tokens per block (speculators' default; the paper: 16 for Qwen3)
    num_layers: int = 3  # draft decoder layers
    max_anchors: int = 64  # blocks per sequence and step (speculators: 512 per packed batch)
    loss_decay_gamma: float = 4.0  # slot k >= 1 weighted exp(-(k - 1) / gamma)
    attention: str = "block_sparse"  # block_sparse (chunked; skips other blocks and later context) | dense (mask)


def _check_schema(model: Any) -> None:
    check_mask_token_and_attention(model)
    if model.block_size < 2 or model.num_layers < 1 or model.max_anchors < 1 or model.loss_decay_gamma <= 0:
        raise RecipeError(
            f"model.block_size must be >= 2, num_layers and max_anchors >= 1 and loss_decay_gamma > 0, "
            f"got {model.block_size}, {model.num_layers}, {model.max_anchors}, "
            f"{model.loss_decay_gamma}"
        )


class DFlashModule(DrafterModule):
    FSDP_FORWARD_METHODS = ("head",)  # the loss applies it to the scored slots only, after forward

    def __init__(self, cfg: Any):
        _check_schema(cfg.model)
        super().__init__(cfg)

        target = self.target_model()
        model_cfg = cfg.model
        layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
        vocab_map, draft_vocab = draft_vocabulary(cfg, target.config.vocab_size)
        config = DFlashConfig.for_target(
            target.config,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=list(layers),
            block_size=model_cfg.block_size,
            num_layers=model_cfg.num_layers,
            mask_token_id=model_cfg.mask_token_id,
        )
        self.drafter = build_drafter(
            cfg,
            lambda: DFlashDrafter(
                config,
                embed_weight=target.get_input_embeddings().weight.detach(),
                head_weight=target.get_output_embeddings().weight.detach(),
            ),
            vocab_map,
        )
        self.register_buffer("weights", slot_weights(config.block_size, model_cfg.loss_decay_gamma), persistent=False)
        self.val_blocks = SimulatedAcceptance(config.block_size - 1)

    # -- one batch -------------------------------------------------------------------------------------------

    def _slots(self, batch: dict[str, torch.Tensor], salt: int, first_row: int):
        """(student logits [N, Vd], teacher probs [N, Vd], slot of each row k [N], (b, a) [N], anchors' shape) over
        the scored slots of this batch's blocks; anchors: :meth:`_anchors`."""
        model_cfg, drafter = self.cfg.model, self.drafter
        supervised = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        anchors, valid = self._anchors(supervised, batch["attention_mask"], salt, first_row)
        hidden = drafter(batch["aux_hidden"], batch["input_ids"], anchors, attention=model_cfg.attention)
        b, a, k, positions = scored_slots(anchors, valid, supervised, drafter.config.block_size)
        # the teacher once per distinct position (overlapping blocks share them), over the draft vocabulary only
        flat = b * supervised.shape[1] + positions - 1
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = batch["last_hidden"].flatten(0, 1)[unique].float()
        head = self.teacher_lm_head[drafter.draft_ids_in_target()]
        teacher = (rows @ head.T).softmax(-1)[inverse]
        return drafter.head(hidden[b, a, k]), teacher, k, (b, a), anchors.shape

    def _anchors(
        self, supervised: torch.Tensor, attention_mask: torch.Tensor, salt: int, first_row: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, A], valid [B, A]) as :func:`sample_anchors` draws them, each row alone: over its own length
        (not the batch's padded width) with a generator of (seed, ``salt``, ``first_row`` + its index), so a row's
        anchors do not depend on which rows share its batch or process. Rows with fewer anchors are padded at the
        front (``valid`` False), as ``sample_anchors`` pads them."""
        block, most = self.drafter.config.block_size, self.cfg.model.max_anchors
        rows = []
        for i, length in enumerate(attention_mask.sum(1).tolist()):  # right-padded rows: the length is the count
            seed = ((int(self.cfg.seed) * 1_000_003 + int(salt)) * 1_000_003 + first_row + i) % (1 << 63)
            rows.append(
                sample_anchors(supervised[i : i + 1, : int(length)], block, most, torch.Generator().manual_seed(seed))
            )
        width = max(int(a.shape[1]) for a, _ in rows)
        anchors = supervised.new_zeros(len(rows), width, dtype=torch.long)
        valid = supervised.new_zeros(len(rows), width, dtype=torch.bool)
        for i, (row, ok) in enumerate(rows):
            anchors[i, width - row.shape[1] :], valid[i, width - row.shape[1] :] = row[0], ok[0]
        return anchors, valid

    def training_step(self, batch, batch_idx):
        # process r holds rows [r·b, (r+1)·b) of each global batch (data_prep.rank_sampler, length buckets alike)
        first_row = process_rank()[0] * len(batch["input_ids"])
        student, teacher, k, _, _ = self._slots(batch, self.global_step, first_row)
        loss = weighted_kl(student, teacher, self.weights[k])
        size = len(batch["input_ids"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        first = k == 1
        right = (student[first].argmax(-1) == teacher[first].argmax(-1)).float()
        self.log("train/acc_slot1", right.mean() if len(right) else torch.zeros(()), batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx):
        # anchors fixed per validation sample (every process reads every batch): each pass scores the same blocks
        student, teacher, k, (b, a), shape = self._slots(batch, -1, batch_idx * int(self.cfg.data.batch_size))
        self.log("val/loss", weighted_kl(student, teacher, self.weights[k]), batch_size=len(batch["input_ids"]))
        right = student.argmax(-1) == teacher.argmax(-1)
        self.val_blocks.update(*chain_hits(shape, right, k, b, a, range(1, self.drafter.config.block_size)))

    def on_validation_epoch_end(self):
        self.last_val_metrics = self.log_simulated_acceptance(self.val_blocks)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["spectrain"] = self.checkpoint_block("dflash")


register_kind(
    DrafterKind(
        name="dflash",
        build_module=DFlashModule,
        build_datamodule=build_datamodule,
        model_schema=DFlashSchema,
        export_checkpoint=export_dflash_checkpoint,
    )
)
