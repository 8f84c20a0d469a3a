"""SpecBlock checkpoint layouts beside our native one (``core.drafters.specblock``): the reference release's
tensor names and config, and the warm start from an EAGLE-3 checkpoint of the same target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.drafters.checkpoint_files import config_or_none
from core.drafters.eagle3 import EAGLE31_FLAGS
from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter
from core.errors import UserError
from core.layer_ids import eagle3_layers

# The reference release (SpecForge-based SpecBlock): its tensor names -> ours. Its config.json is a LlamaConfig with
# num_hidden_layers = drafter layers, draft_vocab_size, diffspec_draft_token_num (K) and rank_classes.
REFERENCE_NAMES = {
    "input_layer.condition_proj.weight": "fc.weight",
    "input_layer.condition_norm.weight": "cond_norm.weight",
    "input_layer.token_norm.weight": "embed_norm.weight",
    "input_layer.position_queries.weight": "position_queries",
    "input_layer.query_norm.weight": "query_norm.weight",
    "input_layer.fuse.weight": "fuse.weight",
}
REFERENCE_SKIPPED = ("input_layer.embed_tokens.weight",)  # the target's embedding (frozen, shared): not stored


def layout_of(path: str | Path) -> str | None:
    """``reference`` when the directory ``path`` holds a checkpoint of the reference release (its config.json sets
    ``diffspec_draft_token_num``), else None (our native exports are read by ``core.drafters.specblock``)."""
    raw = config_or_none(path)
    return "reference" if raw is not None and "diffspec_draft_token_num" in raw else None


def reference_config(raw: dict[str, Any], target: dict[str, Any]) -> SpecBlockConfig:
    """Our config from the release's config.json fields that map (K = ``diffspec_draft_token_num``, buckets =
    ``rank_classes``, layers = ``num_hidden_layers``); aux layers = the EAGLE-3 triple of the target (what the
    release captures); RoPE base 10 000 unless the file sets one (docs/algorithms/specblock.md §3)."""
    hidden = raw["hidden_size"]
    try:
        return SpecBlockConfig(
            block_size=int(raw["diffspec_draft_token_num"]),
            num_layers=int(raw.get("num_hidden_layers", 1)),
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=hidden // raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size", 32000),
            target_hidden_size=raw.get("target_hidden_size", hidden),
            aux_layer_ids=eagle3_layers(int(target["num_hidden_layers"])),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=float(raw.get("rope_theta") or 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            hidden_act=raw.get("hidden_act", "silu"),
            rank_buckets=int(raw.get("rank_classes", 4)),
        )
    except KeyError as exc:
        raise ValueError(f"reference SpecBlock config.json lacks {exc}; it is not a complete release config") from None


def reference_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release's tensors under our names (the target's embedding, which it stores, is left out)."""
    tensors = {}
    for name, tensor in weights.items():
        if name in REFERENCE_SKIPPED:
            continue
        ours = REFERENCE_NAMES.get(name) or (
            name.replace("shift_proj.", "shift.", 1) if name.startswith("shift_proj.") else name
        )
        tensors[ours] = tensor
    return tensors


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
    flags = [flag for flag in EAGLE31_FLAGS if getattr(e_cfg, flag, False)]
    if flags:  # its fc was trained on normed aux layers, and SpecBlock has no per-layer norms to carry them
        raise UserError(
            f"warm start: the EAGLE-3 checkpoint is an EAGLE-3.1 drafter ({', '.join(flags)}), whose fc "
            "reads per-layer normed features SpecBlock does not compute; warm-start from a plain EAGLE-3 "
            "export or drop warm_start"
        )
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "target_hidden_size",
        "draft_vocab_size",
        "aux_layer_ids",
    ):
        if getattr(e_cfg, name) != getattr(cfg, name):
            raise ValueError(
                f"warm start: the EAGLE-3 checkpoint has {name}={getattr(e_cfg, name)} but this "
                f"SpecBlock drafter has {getattr(cfg, name)}; warm-start from a drafter of this target"
            )
    hidden = cfg.hidden_size
    mapping = {
        "fc.weight": src["fc.weight"],
        "lm_head.weight": src["lm_head.weight"],
        "norm.weight": src["norm.weight"],
        "cond_norm.weight": src["midlayer.hidden_norm.weight"],
        "embed_norm.weight": src["midlayer.input_layernorm.weight"],
    }
    for proj in ("q_proj", "k_proj", "v_proj"):
        mapping[f"layers.0.self_attn.{proj}.weight"] = src[f"midlayer.self_attn.{proj}.weight"][:, hidden:]
    mapping["layers.0.self_attn.o_proj.weight"] = src["midlayer.self_attn.o_proj.weight"]
    for name in (
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "post_attention_layernorm.weight",
    ):
        mapping[f"layers.0.{name}"] = src[f"midlayer.{name}"]
    fuse = drafter.fuse.weight.detach().clone()
    fuse[:, :hidden] = torch.eye(hidden, dtype=fuse.dtype)
    mapping["fuse.weight"] = fuse
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, tensor in mapping.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return sorted(mapping)
