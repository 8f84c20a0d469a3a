"""``kind=specblock``: train the SpecBlock drafter (docs/algorithms/specblock.md §5; recipes ``specblock_*``).

Per step: block 1 reads the target's features; each block boundary draws one cut ``M ~ U{1..K}`` for the whole
batch (seeded by (seed, step), so a resumed run draws the same cuts) and the next block starts from the drafter's
own hidden state of slot ``M − 1`` (cross-block training, :func:`spectrain.kinds.specblock.losses.unroll_blocks`).
Loss = Σ_k 0.8^k Σ_b valid-prefix draft CE + λ_rank Σ_b rank loss; before ``rank_start_step`` one block and no
rank loss. ``slot_weight=0 rank_weight=0 train_blocks=1`` trains slot 0's draft loss alone; ``model.init`` and
``model.valid_prefix`` select the identity-style start and the draft loss's row normalisation (defaults: the
reference's initialisation; ``slot0_norm``, every slot's loss over slot 0's row count, which raised τ_sim over
the reference's ``chain``). The teacher comes from the stored final hidden state through the target's lm_head, restricted to the
draft vocabulary (docs/algorithms/eagle3.md §3's position mask). Validation: per-slot acceptance of block 1 under the
valid-prefix rule and ``tau_sim`` (γ = K), the 2-block chain (cut at K), rank-head accuracy and confusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.drafters.eagle3 import shift_left
from core.drafters.eagle3.layouts import read_checkpoint
from core.drafters.specblock import INITS, SpecBlockConfig, SpecBlockDrafter
from core.drafters.specblock.attention import ATTENTION_KINDS
from core.drafters.specblock.layouts import warm_start_from_eagle3
from core.layer_ids import resolve_layers
from core.overrides import RecipeError
from spectrain.kinds.base import DrafterModule, build_datamodule
from spectrain.kinds.eagle3.losses import teacher_in_draft_vocab
from spectrain.kinds.eagle3.module import draft_vocab_size, vocab_map_for
from spectrain.kinds.specblock.export import export_specblock_checkpoint
from spectrain.kinds.specblock.losses import RANK_MASKS, VALID_PREFIX, total_loss, unroll_blocks
from spectrain.metrics import SimulatedAcceptance
from spectrain.registry import DrafterKind, register_kind


@dataclass
class SpecBlockSchema:
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    vocab_map: str | None = None  # data_prep.vocab output; None + draft_vocab_size > 0: counted from data.source
    block_size: int = 4  # K, slots per block
    num_layers: int = 2  # L_d
    train_blocks: int = 3  # blocks unrolled per step (cross-block training)
    slot_weight: float = 0.8  # draft loss of slot k weighted slot_weight ** k
    rank_weight: float = 1.0  # λ_rank once step >= rank_start_step
    rank_start_step: int = 0  # before it: one block, no rank loss
    rank_mask: str = "rank_chain"  # rank_chain (the release's code) | draft_chain (the paper)
    rank_freq_budget: float = 10.0  # class weight min(1, budget / count); <= 0 disables
    widths: list[int] | None = None  # serving TOPK[bucket] table recorded in the export; None = [2, 4, 6, 4]
    train_block2_sees_other_anchors: bool = False  # release quirk (§4 item 3); off = inference-consistent
    warm_start: str | None = None  # an EAGLE-3 export dir (any layout): copies what maps (warm_start_from_eagle3)
    attention: str = "block_sparse"  # block_sparse (skips masked entries) | dense (the reference masks; same loss)
    init: str = "random"  # random (the modules' own) | identity (shift [I | 0], fusion's condition block I)
    # draft-loss rows (specblock_losses): chain (the reference) | slot0_norm | valid. slot0_norm by default: at the
    # GSM setting's 60-step budget it gave val/tau_sim 1.46 against chain's 1.29 (BENCHMARKS, SpecBlock experiments)
    valid_prefix: str = "slot0_norm"


def _check_schema(model: Any) -> None:
    if model.rank_mask not in RANK_MASKS:
        raise RecipeError(f"model.rank_mask={model.rank_mask} is not one of {', '.join(RANK_MASKS)}")
    if model.attention not in ATTENTION_KINDS:
        raise RecipeError(f"model.attention={model.attention} is not one of {', '.join(ATTENTION_KINDS)}")
    if model.init not in INITS:
        raise RecipeError(f"model.init={model.init} is not one of {', '.join(INITS)}")
    if model.valid_prefix not in VALID_PREFIX:
        raise RecipeError(f"model.valid_prefix={model.valid_prefix} is not one of {', '.join(VALID_PREFIX)}")
    if model.slot_weight < 0 or model.rank_weight < 0:
        raise RecipeError(
            f"model.slot_weight and rank_weight must be >= 0 (0 = slot 0's draft loss only / no rank "
            f"loss), got {model.slot_weight}, {model.rank_weight}"
        )
    if model.block_size < 1 or model.num_layers < 1 or model.train_blocks < 1:
        raise RecipeError(
            f"model.block_size, num_layers and train_blocks must be >= 1, got {model.block_size}, "
            f"{model.num_layers}, {model.train_blocks}"
        )


class SpecBlockModule(DrafterModule):
    FSDP_FORWARD_METHODS = ("forward_block",)  # unroll_blocks calls it, not forward

    def __init__(self, cfg: Any):
        _check_schema(cfg.model)
        super().__init__(cfg)

        target = self.target_model()
        model_cfg = cfg.model
        layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
        eagle = None
        if model_cfg.warm_start:
            eagle = read_checkpoint(model_cfg.warm_start)
        vocab_map = self._vocab_map(eagle, target.config.vocab_size)
        draft_vocab = draft_vocab_size(model_cfg, vocab_map, target.config.vocab_size)
        overrides = {"train_block2_sees_other_anchors": model_cfg.train_block2_sees_other_anchors}
        if model_cfg.widths is not None:
            overrides["widths"] = list(model_cfg.widths)
        config = SpecBlockConfig.for_target(
            target.config,
            draft_vocab_size=draft_vocab,
            aux_layer_ids=list(layers),
            block_size=model_cfg.block_size,
            num_layers=model_cfg.num_layers,
            **overrides,
        )
        embed = target.get_input_embeddings().weight.detach()
        # A dry run (fit builds the target on the meta device) builds the drafter there too: shapes, no memory.
        with torch.device("meta" if cfg.dry_run else "cpu"):
            self.drafter = SpecBlockDrafter(config, embed_weight=embed)
            self.drafter.init_weights_(model_cfg.init)  # before a warm start, which overwrites what maps
        if vocab_map is not None and not cfg.dry_run:
            self.drafter.set_vocab_map(*vocab_map)
        if eagle is not None and not cfg.dry_run:
            warm_start_from_eagle3(self.drafter, eagle)
        K = config.block_size
        self.val_block1 = SimulatedAcceptance(K)
        self.val_two_blocks = SimulatedAcceptance(2 * K)
        # torchmetrics: a heavy import, deferred to first use
        from torchmetrics.classification import MulticlassConfusionMatrix

        self.val_rank_confusion = MulticlassConfusionMatrix(num_classes=config.rank_buckets)

    def _vocab_map(self, eagle, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        model_cfg = self.cfg.model
        if eagle is not None:  # the warm-started lm_head only makes sense with its own vocabulary map
            draft = eagle.config.draft_vocab_size
            if model_cfg.draft_vocab_size and model_cfg.draft_vocab_size != draft:
                raise ValueError(
                    f"model.warm_start={model_cfg.warm_start} has draft_vocab_size={draft} but "
                    f"model.draft_vocab_size={model_cfg.draft_vocab_size}; set it to {draft} or 0"
                )
            return eagle.tensors["d2t"], eagle.tensors["t2d"]
        if self.cfg.dry_run:  # counting the vocabulary reads the whole source: left to the real run
            return None
        return vocab_map_for(self.cfg, vocab_size)

    # -- batches ---------------------------------------------------------------------------------------------

    def _rows(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row inputs (docs/algorithms/eagle3.md §1): features unshifted, tokens x_{i+1}, teacher P̃_i (target at i+1 over the
        draft vocab) and the position mask (x_{i+2} supervised and the target's argmax at i+1 in the draft vocab)."""
        restricted, in_vocab = teacher_in_draft_vocab(self.teacher_logits(batch["last_hidden"]), self.drafter.t2d)
        teacher = shift_left(restricted, 1).softmax(-1)
        supervised = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        pm = shift_left(supervised, 2, fill=False) & shift_left(in_vocab, 1, fill=False)
        aux = batch["aux_hidden"].to(self.drafter.fc.weight.dtype)
        return aux, shift_left(batch["input_ids"], 1), teacher, pm

    def cuts_for_step(self, step: int, n_blocks: int) -> list[int]:
        """One cut per block boundary, shared by the batch, reproducible from (seed, step) (resume-safe)."""
        generator = torch.Generator().manual_seed(int(self.cfg.seed) * 1_000_003 + int(step))
        return torch.randint(1, self.drafter.config.block_size + 1, (n_blocks - 1,), generator=generator).tolist()

    # -- steps -----------------------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        model_cfg = self.cfg.model
        ranked = self.global_step >= model_cfg.rank_start_step
        cuts = self.cuts_for_step(self.global_step, model_cfg.train_blocks if ranked else 1)
        aux, tokens, teacher, pm = self._rows(batch)
        out = unroll_blocks(
            self.drafter,
            aux,
            tokens,
            teacher,
            pm,
            cuts,
            rank_mask=model_cfg.rank_mask,
            freq_budget=model_cfg.rank_freq_budget,
            attention=model_cfg.attention,
            valid_prefix=model_cfg.valid_prefix,
        )
        loss = total_loss(out, slot_weight=model_cfg.slot_weight, rank_weight=model_cfg.rank_weight if ranked else 0.0)
        size = len(batch["input_ids"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/draft_loss_b1_s0", out.blocks[0].draft[0], batch_size=size)
        self.log("train/rank_loss", torch.stack([b.rank for b in out.blocks]).sum(), batch_size=size)
        for b, block in enumerate(out.blocks):
            valid = block.slot_valid[..., 0]
            self.log(
                f"train/acc_b{b + 1}_s1",
                block.correct[..., 0][valid].float().mean() if valid.any() else torch.zeros(()),
                batch_size=size,
            )
        return loss

    def validation_step(self, batch, batch_idx):
        model_cfg = self.cfg.model
        K = self.drafter.config.block_size
        aux, tokens, teacher, pm = self._rows(batch)
        # The serving chain: block 1 from target features, then block 2 from its last slot (cut M = K).
        cuts = [K] if model_cfg.train_blocks > 1 else []
        out = unroll_blocks(
            self.drafter,
            aux,
            tokens,
            teacher,
            pm,
            cuts,
            rank_mask=model_cfg.rank_mask,
            freq_budget=model_cfg.rank_freq_budget,
            attention=model_cfg.attention,
            valid_prefix=model_cfg.valid_prefix,
        )
        first = out.blocks[0]
        self.log(
            "val/loss",
            total_loss(out, slot_weight=model_cfg.slot_weight, rank_weight=model_cfg.rank_weight),
            batch_size=len(batch["input_ids"]),
        )
        alphas = [first.correct[..., k].float() for k in range(K)]
        valid = [first.slot_valid[..., k] for k in range(K)]
        self.val_block1.update(alphas, valid)
        if len(out.blocks) > 1:
            second = out.blocks[1]
            self.val_two_blocks.update(
                alphas + [second.correct[..., k].float() for k in range(K)],
                valid + [second.slot_valid[..., k] for k in range(K)],
            )
        mask = first.slot_valid
        self.val_rank_confusion.update(first.rank_pred[mask], first.labels[mask])

    def on_validation_epoch_end(self):
        metrics = self.log_simulated_acceptance(self.val_block1)
        if self.val_two_blocks.starts > 0:
            two = self.val_two_blocks.compute()
            self.log("val/tau_sim_2blocks", two["tau_sim"])
            metrics["tau_sim_2blocks"] = float(two["tau_sim"])
        confusion = self.val_rank_confusion.compute()  # rows: true bucket, columns: predicted bucket
        total = confusion.sum()
        accuracy = confusion.diagonal().sum() / total.clamp(min=1)
        self.log("val/rank_acc", accuracy)
        metrics["rank_acc"] = float(accuracy)
        metrics["rank_confusion"] = confusion.tolist()
        self.last_val_metrics = metrics
        self.val_two_blocks.reset()
        self.val_rank_confusion.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["spectrain"] = self.checkpoint_block("specblock")


register_kind(
    DrafterKind(
        name="specblock",
        build_module=SpecBlockModule,
        build_datamodule=build_datamodule,
        model_schema=SpecBlockSchema,
        export_checkpoint=export_specblock_checkpoint,
    )
)
