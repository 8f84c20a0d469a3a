"""``kind=peagle``: train the P-EAGLE drafter (EAGLE-3 plus a mask token and ``mask_hidden``; recipes ``peagle_*``).

Per step, per sequence: every position's depth-0 row plus chain rows drawn by COD sampling
(:mod:`spectrain.kinds.peagle.losses`), each row of the batch with its own generator seeded by (seed, step, the row's index
in the GLOBAL batch) and over its own length, as DFlash's anchors are (a resumed run, or N processes, draw the same
rows). One drafter forward runs them all with the chunked P-EAGLE attention (:mod:`core.drafters.peagle.attention`);
the loss is the mean KL against the target's distribution over the draft vocabulary over every scored row of every
depth (speculators' loss: depth d weighs its share of the sampled rows, ~r^d). The teacher comes from the stored (or
online) final hidden state through the target's lm_head rows of the draft vocabulary; features are EAGLE-3's triple
(``data.layers``), online as for EAGLE-3 or from a dataset. The token embedding is the target's, frozen (speculators
trains it: ``embed_requires_grad``); ``mask_hidden`` and everything EAGLE-3 trains are trained.

Validation: every chain of every scored anchor (``every_chain``, nothing sampled); per anchor, depth k is right when its
argmax equals the target's; ``val/tau_sim`` = 1 + E[the run of right depths], over anchors whose K depths are all
scored. For P-EAGLE this is what a greedy round serves, not a proxy: deeper rows read the mask, never the drafted
tokens, so teacher forcing changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.distributed import process_rank
from core.drafters.peagle import PEagleConfig, PEagleDrafter
from core.layer_ids import resolve_layers
from core.overrides import RecipeError
from spectrain.kinds.base import (
    DrafterModule,
    build_datamodule,
    build_drafter,
    chain_hits,
    check_mask_token_and_attention,
)
from spectrain.kinds.dflash.losses import weighted_kl
from spectrain.kinds.eagle3.module import draft_vocabulary
from spectrain.kinds.peagle.export import export_peagle_checkpoint
from spectrain.kinds.peagle.losses import batch_chains, cod_sample, scored_rows
from spectrain.kinds.peagle.losses import every_chain as full_chains
from spectrain.metrics import SimulatedAcceptance
from spectrain.registry import DrafterKind, register_kind


@dataclass
class PEagleSchema:
    mask_token_id: int | None = None  # the id every depth >= 1 row reads: a special token the data never holds
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    vocab_map: str | None = None  # data_prep.vocab output; None + draft_vocab_size > 0: counted from data.source
    num_depths: int = 8  # K: tokens one forward drafts (speculators' default)
    down_sample_ratio: float = 0.7  # COD: depth d keeps ~r^d of the rows (speculators' default)
    down_sample_ratio_min: float = 0.2  # COD: ... but at least this share (speculators' default)
    max_anchors: int = 0  # chains seeded per sequence and step; 0 = every scored row
    norm_before_residual: bool = False
    attention: str = "block_sparse"  # block_sparse (chunked) | dense (the reference mask)


def _check_schema(model: Any) -> None:
    check_mask_token_and_attention(model)
    if model.num_depths < 1 or model.max_anchors < 0:
        raise RecipeError(
            f"model.num_depths must be >= 1 and model.max_anchors >= 0, got {model.num_depths}, {model.max_anchors}"
        )
    if not (0 < model.down_sample_ratio <= 1 and 0 <= model.down_sample_ratio_min <= 1):
        raise RecipeError(
            f"model.down_sample_ratio must be in (0, 1] and down_sample_ratio_min in [0, 1], got "
            f"{model.down_sample_ratio}, {model.down_sample_ratio_min}"
        )


class PEagleModule(DrafterModule):
    FSDP_FORWARD_METHODS = ("head",)  # the loss applies it to the scored rows only, after forward

    def __init__(self, cfg: Any):
        _check_schema(cfg.model)
        super().__init__(cfg)

        target = self.target_model()
        model_cfg = cfg.model
        layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
        vocab_map, draft_vocab = draft_vocabulary(cfg, target.config.vocab_size)
        config = PEagleConfig.for_target(
            target.config,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=list(layers),
            mask_token_id=model_cfg.mask_token_id,
            num_depths=model_cfg.num_depths,
            norm_before_residual=model_cfg.norm_before_residual,
        )
        self.drafter = build_drafter(
            cfg, lambda: PEagleDrafter(config, embed_weight=target.get_input_embeddings().weight.detach()), vocab_map
        )
        self.val_chains = SimulatedAcceptance(config.num_depths)

    # -- one batch -------------------------------------------------------------------------------------------

    def _batch_rows(self, batch: dict[str, torch.Tensor], salt: int, first_row: int, every_chain: bool):
        """(student logits [N, Vd], teacher probs [N, Vd], depth [N], batch row [N], anchor [N]) over the scored rows
        of every depth; ``every_chain``: all chains of every scored anchor (validation), else COD's draw."""
        model_cfg, drafter = self.cfg.model, self.drafter
        supervised = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        scored = scored_rows(supervised)
        per_row = self._chains(scored, batch["attention_mask"], salt, first_row, every_chain)
        chains = batch_chains(per_row, scored.device, dense=model_cfg.attention == "dense")
        out = drafter(batch["input_ids"], batch["aux_hidden"], chains)
        b0, q0 = scored.nonzero(as_tuple=True)
        bc, nc = chains.valid.nonzero(as_tuple=True)  # every chain row is a scored row (COD draws only those)
        rows_b = torch.cat([b0, bc])
        anchor = torch.cat([q0, chains.anchors[bc, nc]])
        depth = torch.cat([torch.zeros_like(q0), chains.depths[bc, nc]])
        hidden = torch.cat([out.hidden[b0, q0], out.chain_hidden[bc, nc]])
        # the teacher once per distinct position (rows of several depths share them), over the draft vocabulary
        flat = rows_b * supervised.shape[1] + anchor + depth + 1
        unique, inverse = torch.unique(flat, return_inverse=True)
        head = self.teacher_lm_head[drafter.draft_ids_in_target()]
        teacher = (batch["last_hidden"].flatten(0, 1)[unique].float() @ head.T).softmax(-1)[inverse]
        return drafter.head(hidden), teacher, depth, rows_b, anchor

    def _chains(
        self, scored: torch.Tensor, attention_mask: torch.Tensor, salt: int, first_row: int, every_chain: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per batch row, its chain rows (anchors, depths): COD's draw over its own length (not the batch's padded
        width) with a generator of (seed, ``salt``, ``first_row`` + its index), so a row's draw depends neither on
        the rows sharing its batch nor on the process count; ``every_chain``: all of them (validation)."""
        model_cfg, depths = self.cfg.model, self.drafter.config.num_depths
        per_row = []
        for i, length in enumerate(attention_mask.sum(1).tolist()):  # right-padded: the length is the count
            if every_chain:
                per_row.append(full_chains(scored[i, : int(length)], depths))
                continue
            seed = ((int(self.cfg.seed) * 1_000_003 + int(salt)) * 1_000_003 + first_row + i) % (1 << 63)
            per_row.append(
                cod_sample(
                    scored[i, : int(length)],
                    depths,
                    model_cfg.down_sample_ratio,
                    model_cfg.down_sample_ratio_min,
                    model_cfg.max_anchors or None,
                    torch.Generator().manual_seed(seed),
                )
            )
        return per_row

    def training_step(self, batch, batch_idx):
        # process r holds rows [r·b, (r+1)·b) of each global batch (data_prep.rank_sampler, length buckets alike)
        first_row = process_rank()[0] * len(batch["input_ids"])
        student, teacher, depth, _, _ = self._batch_rows(batch, self.global_step, first_row, every_chain=False)
        loss = weighted_kl(student, teacher, torch.ones(len(student), device=student.device))
        size = len(batch["input_ids"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        deep = depth == 1
        right = (student[deep].argmax(-1) == teacher[deep].argmax(-1)).float()
        self.log("train/acc_depth1", right.mean() if len(right) else torch.zeros(()), batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx):
        student, teacher, depth, b, a = self._batch_rows(
            batch, -1, batch_idx * int(self.cfg.data.batch_size), every_chain=True
        )
        self.log(
            "val/loss",
            weighted_kl(student, teacher, torch.ones(len(student), device=student.device)),
            batch_size=len(batch["input_ids"]),
        )
        right = student.argmax(-1) == teacher.argmax(-1)
        self.val_chains.update(
            *chain_hits(batch["input_ids"].shape, right, depth, b, a, range(self.drafter.config.num_depths))
        )

    def on_validation_epoch_end(self):
        self.last_val_metrics = self.log_simulated_acceptance(self.val_chains)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["spectrain"] = self.checkpoint_block("peagle")


register_kind(
    DrafterKind(
        name="peagle",
        build_module=PEagleModule,
        build_datamodule=build_datamodule,
        model_schema=PEagleSchema,
        export_checkpoint=export_peagle_checkpoint,
    )
)
