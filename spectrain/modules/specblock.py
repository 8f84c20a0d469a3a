"""``kind=specblock``: train the SpecBlock drafter (``specblock_ssd_eagle3.md`` §1.5; recipes ``specblock_*``).

Per step: block 1 reads the target's features; each block boundary draws one cut ``M ~ U{1..K}`` for the whole
batch (seeded by (seed, step), so a resumed run draws the same cuts) and the next block starts from the drafter's
own hidden state of slot ``M − 1`` (cross-block training, :func:`spectrain.specblock_losses.unroll_blocks`).
Loss = Σ_k 0.8^k Σ_b valid-prefix draft CE + λ_rank Σ_b rank loss; before ``rank_start_step`` one block and no
rank loss. The teacher comes from the stored final hidden state through the target's lm_head, restricted to the
draft vocabulary (EAGLE-3's §0.3 position mask). Validation: per-slot acceptance of block 1 under the
valid-prefix rule and ``tau_sim`` (γ = K), the 2-block chain (cut at K), rank-head accuracy and confusion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.assets import load_safetensors, target_record
from core.drafters.eagle3 import shift_left
from core.drafters.eagle3_layouts import CheckpointError, read_checkpoint, same_target
from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter, build_drafter, save_native
from core.layer_ids import eagle3_layers, resolve_layers
from core.overrides import RecipeError
from spectrain.checkpoint_contract import DRAFTER_PREFIX, DTYPES
from spectrain.eagle3_losses import teacher_in_draft_vocab
from spectrain.export import read_lightning_checkpoint
from spectrain.metrics import SimulatedAcceptance
from spectrain.modules.base import DrafterModule, build_datamodule
from spectrain.modules.eagle3 import vocab_map_for
from spectrain.registry import DrafterKind, register_kind
from spectrain.specblock_losses import RANK_MASKS, total_loss, unroll_blocks
from spectrain.targets import trained_template


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
    train_block2_sees_other_anchors: bool = False  # release quirk (§1.4 item 3); off = inference-consistent
    warm_start: str | None = None  # an EAGLE-3 export dir (any layout): copies what maps (warm_start_from_eagle3)


def _check_schema(model: Any) -> None:
    if model.rank_mask not in RANK_MASKS:
        raise RecipeError(f"model.rank_mask={model.rank_mask} is not one of {', '.join(RANK_MASKS)}")
    if model.block_size < 1 or model.num_layers < 1 or model.train_blocks < 1:
        raise RecipeError(f"model.block_size, num_layers and train_blocks must be >= 1, got {model.block_size}, "
                          f"{model.num_layers}, {model.train_blocks}")


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
        draft_vocab = (model_cfg.draft_vocab_size or target.config.vocab_size) if vocab_map is None \
            else int(vocab_map[0].numel())
        overrides = {"train_block2_sees_other_anchors": model_cfg.train_block2_sees_other_anchors}
        if model_cfg.widths is not None:
            overrides["widths"] = list(model_cfg.widths)
        config = SpecBlockConfig.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=list(layers),
                                            block_size=model_cfg.block_size, num_layers=model_cfg.num_layers,
                                            **overrides)
        embed = target.get_input_embeddings().weight.detach()
        # A dry run (fit builds the target on the meta device) builds the drafter there too: shapes, no memory.
        with torch.device("meta" if cfg.dry_run else "cpu"):
            self.drafter = SpecBlockDrafter(config, embed_weight=embed)
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
                raise ValueError(f"model.warm_start={model_cfg.warm_start} has draft_vocab_size={draft} but "
                                 f"model.draft_vocab_size={model_cfg.draft_vocab_size}; set it to {draft} or 0")
            return eagle.tensors["d2t"], eagle.tensors["t2d"]
        if self.cfg.dry_run:  # counting the vocabulary reads the whole source: left to the real run
            return None
        return vocab_map_for(self.cfg, vocab_size)

    # -- batches ---------------------------------------------------------------------------------------------

    def _rows(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-frame inputs (§0.1): features (unshifted), tokens x_{i+1}, teacher P̃_i (target at i+1 over the
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
        out = unroll_blocks(self.drafter, aux, tokens, teacher, pm, cuts, rank_mask=model_cfg.rank_mask,
                            freq_budget=model_cfg.rank_freq_budget)
        loss = total_loss(out, slot_weight=model_cfg.slot_weight,
                          rank_weight=model_cfg.rank_weight if ranked else 0.0)
        size = len(batch["input_ids"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/draft_loss_b1_s0", out.blocks[0].draft[0], batch_size=size)
        self.log("train/rank_loss", torch.stack([b.rank for b in out.blocks]).sum(), batch_size=size)
        for b, block in enumerate(out.blocks):
            valid = block.slot_valid[..., 0]
            self.log(f"train/acc_b{b + 1}_s1", block.correct[..., 0][valid].float().mean() if valid.any()
                     else torch.zeros(()), batch_size=size)
        return loss

    def validation_step(self, batch, batch_idx):
        model_cfg = self.cfg.model
        K = self.drafter.config.block_size
        aux, tokens, teacher, pm = self._rows(batch)
        # The serving chain: block 1 from target features, then block 2 from its last slot (cut M = K).
        cuts = [K] if model_cfg.train_blocks > 1 else []
        out = unroll_blocks(self.drafter, aux, tokens, teacher, pm, cuts, rank_mask=model_cfg.rank_mask,
                            freq_budget=model_cfg.rank_freq_budget)
        first = out.blocks[0]
        self.log("val/loss", total_loss(out, slot_weight=model_cfg.slot_weight, rank_weight=model_cfg.rank_weight),
                 batch_size=len(batch["input_ids"]))
        alphas = [first.correct[..., k].float() for k in range(K)]
        valid = [first.slot_valid[..., k] for k in range(K)]
        self.val_block1.update(alphas, valid)
        if len(out.blocks) > 1:
            second = out.blocks[1]
            self.val_two_blocks.update(alphas + [second.correct[..., k].float() for k in range(K)],
                                       valid + [second.slot_valid[..., k] for k in range(K)])
        mask = first.slot_valid
        self.val_rank_confusion.update(first.rank_pred[mask], first.labels[mask])

    def on_validation_epoch_end(self):
        block1 = self.val_block1.compute()
        self.log("val/tau_sim", block1["tau_sim"], prog_bar=True)
        self.log("val/top1_agreement", block1["acc_1"])
        metrics = {key: float(value) for key, value in block1.items()}
        for key, value in block1.items():
            if key.startswith("acc_"):
                self.log(f"val/{key}", value)
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
        self.val_block1.reset()
        self.val_two_blocks.reset()
        self.val_rank_confusion.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if getattr(self, "_target_record", None) is None:  # hashes the target's weights: once per run
            self._target_record = {**target_record(self.cfg.target), **trained_template(self.cfg)}
        checkpoint["spectrain"] = {"kind": "specblock", "config": self.drafter.config.to_dict(),
                                   "target": self._target_record, "recipe": dict(self.hparams["recipe"]),
                                   "metrics": {f"val/{k}": v for k, v in self.last_val_metrics.items()}}


def warm_start_from_eagle3(drafter: SpecBlockDrafter, eagle: Any) -> list[str]:
    """Copy what maps from an EAGLE-3 checkpoint (``eagle3_layouts.Eagle3Checkpoint``); returns the names set.

    Maps exactly: ``fc`` (W_c), ``lm_head``, the final ``norm`` (RMSNorm_out) and the vocab map (done by the
    caller); EAGLE-3's ``hidden_norm`` (the norm of g) -> RMSNorm_c and its ``input_layernorm`` (the norm of the
    embedding) -> RMSNorm_e. Decoder layer 0 takes EAGLE-3's single layer: MLP, ``o_proj`` and
    ``post_attention_layernorm`` as they are; q/k/v read a 2H input ``[norm(e) ; norm(g)]`` in EAGLE-3, so only
    their hidden half (columns H..2H) is copied, and W_f's condition block is set to the identity so layer 0
    starts from z ≈ RMSNorm_c(W_c f) plus the (random) embedding/query terms, the input EAGLE-3's hidden half
    saw. Left at init: layers >= 1, the shift projections W_s, the position queries, W_f's embedding and query
    blocks, layer 0's input_layernorm and the rank head."""
    src, cfg = eagle.tensors, drafter.config
    e_cfg = eagle.config
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "target_hidden_size", "draft_vocab_size", "aux_layer_ids"):
        if getattr(e_cfg, name) != getattr(cfg, name):
            raise ValueError(f"warm start: the EAGLE-3 checkpoint has {name}={getattr(e_cfg, name)} but this "
                             f"SpecBlock drafter has {getattr(cfg, name)}; warm-start from a drafter of this target")
    hidden = cfg.hidden_size
    mapping = {"fc.weight": src["fc.weight"], "lm_head.weight": src["lm_head.weight"], "norm.weight": src["norm.weight"],
               "cond_norm.weight": src["midlayer.hidden_norm.weight"],
               "embed_norm.weight": src["midlayer.input_layernorm.weight"]}
    for proj in ("q_proj", "k_proj", "v_proj"):
        mapping[f"layers.0.self_attn.{proj}.weight"] = src[f"midlayer.self_attn.{proj}.weight"][:, hidden:]
    mapping["layers.0.self_attn.o_proj.weight"] = src["midlayer.self_attn.o_proj.weight"]
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight"):
        mapping[f"layers.0.{name}"] = src[f"midlayer.{name}"]
    fuse = drafter.fuse.weight.detach().clone()
    fuse[:, :hidden] = torch.eye(hidden, dtype=fuse.dtype)
    mapping["fuse.weight"] = fuse
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, tensor in mapping.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return sorted(mapping)


def export_specblock_checkpoint(path: Any, cfg: Any) -> Any:
    """``python -m spectrain.export ckpt=<specblock .ckpt> out=DIR``: the native export dir (K, layers, rank
    buckets, widths and vocab map in ``config.json``; ``core.drafters.specblock.load_native`` reads it)."""
    if cfg.format != "native":
        raise CheckpointError(f"a specblock drafter exports only as format=native; '{cfg.format}' is an EAGLE-3 "
                              "engine layout")
    raw = read_lightning_checkpoint(path)  # a .ckpt file or an FSDP checkpoint directory
    meta = raw["spectrain"]
    recorded = meta.get("target")
    if cfg.target:
        wanted = target_record(cfg.target)
        if recorded is not None and not same_target(recorded, wanted):
            raise CheckpointError(f"{path} was trained for target '{recorded.get('name')}', not '{cfg.target}'; "
                                  "use the target it was trained for")
        recorded = recorded or wanted
    config = SpecBlockConfig.from_dict(meta["config"])
    tensors = {name.removeprefix(DRAFTER_PREFIX): t for name, t in (raw.get("state_dict") or {}).items()
               if name.startswith(DRAFTER_PREFIX) and name != DRAFTER_PREFIX + "embed_tokens.weight"}
    if not tensors:
        raise CheckpointError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule keeps the "
                              "drafter as self.drafter)")
    drafter = build_drafter(config, tensors)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "epoch": raw.get("epoch"),
               "source": str(path)}
    training = {key: (recipe or {}).get("model", {}).get(key) for key in
                ("train_blocks", "slot_weight", "rank_mask", "rank_freq_budget", "warm_start")}
    return save_native(drafter, cfg.out, target=recorded, recipe=recipe, metrics=metrics,
                       extra={"training": training})


# The reference release (SpecForge-based SpecBlock): its tensor names -> ours. Its config.json is a LlamaConfig with
# num_hidden_layers = drafter layers, draft_vocab_size, diffspec_draft_token_num (K) and rank_classes.
REFERENCE_NAMES = {
    "input_layer.condition_proj.weight": "fc.weight", "input_layer.condition_norm.weight": "cond_norm.weight",
    "input_layer.token_norm.weight": "embed_norm.weight", "input_layer.position_queries.weight": "position_queries",
    "input_layer.query_norm.weight": "query_norm.weight", "input_layer.fuse.weight": "fuse.weight",
}
REFERENCE_SKIPPED = ("input_layer.embed_tokens.weight",)  # the target's embedding (frozen, shared): not stored


def reference_config(raw: dict[str, Any], target: dict[str, Any]) -> SpecBlockConfig:
    """Our config from the release's config.json fields that map (K = ``diffspec_draft_token_num``, buckets =
    ``rank_classes``, layers = ``num_hidden_layers``); aux layers = the EAGLE-3 triple of the target (what the
    release captures); RoPE base 10 000 unless the file sets one (§1.3)."""
    hidden = raw["hidden_size"]
    try:
        return SpecBlockConfig(
            block_size=int(raw["diffspec_draft_token_num"]), num_layers=int(raw.get("num_hidden_layers", 1)),
            hidden_size=hidden, intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=hidden // raw["num_attention_heads"], vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size", 32000),
            target_hidden_size=raw.get("target_hidden_size", hidden),
            aux_layer_ids=eagle3_layers(int(target["num_hidden_layers"])),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=float(raw.get("rope_theta") or 10000.0),
            rope_scaling=raw.get("rope_scaling"), max_position_embeddings=raw.get("max_position_embeddings", 2048),
            hidden_act=raw.get("hidden_act", "silu"), rank_buckets=int(raw.get("rank_classes", 4)))
    except KeyError as exc:
        raise ValueError(f"reference SpecBlock config.json lacks {exc}; it is not a complete release config") from None


def import_specblock_reference(path: Any, cfg: Any) -> Any:
    """``python -m spectrain.export import=<release dir> target=NAME_OR_DIR out=DIR``: a checkpoint of the
    reference release (config.json + model.safetensors) -> our native export dir."""

    directory = Path(path)
    if not cfg.target:
        raise CheckpointError(f"{directory} is a reference SpecBlock checkpoint without a target record: give "
                              "target=NAME_OR_DIR (the model it drafts for)")
    if cfg.format != "native":
        raise CheckpointError(f"a specblock drafter exports only as format=native, not '{cfg.format}'")
    target = target_record(cfg.target)
    raw = json.loads((directory / "config.json").read_text())
    config = reference_config(raw, target)
    if config.target_hidden_size != target["hidden_size"]:
        raise CheckpointError(f"{directory} drafts for hidden size {config.target_hidden_size} but target "
                              f"'{cfg.target}' has {target['hidden_size']}; use the target it was trained for")
    weights = load_safetensors(directory / "model.safetensors", fix="re-download the reference checkpoint")
    tensors = {}
    for name, tensor in weights.items():
        if name in REFERENCE_SKIPPED:
            continue
        ours = REFERENCE_NAMES.get(name) or (name.replace("shift_proj.", "shift.", 1)
                                             if name.startswith("shift_proj.") else name)
        tensors[ours] = tensor
    drafter = build_drafter(config, tensors)  # strict: unknown or missing tensors fail in one line
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    return save_native(drafter, cfg.out, target=target, metrics={"source": str(directory),
                                                                  "source_layout": "specblock_reference"},
                       extra={"imported_from": "specblock_reference"})


register_kind(DrafterKind(name="specblock", build_module=SpecBlockModule, build_datamodule=build_datamodule,
                          model_schema=SpecBlockSchema, export_checkpoint=export_specblock_checkpoint,
                          import_reference=import_specblock_reference))
