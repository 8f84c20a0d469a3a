"""DFlash export directories: our native layout (DESIGN.md §4), read and written.

Native: ``config.json`` with the ``spectrain`` block (kind ``dflash``, target record, architecture, layer ids and
their convention, block size, mask token, vocab sizes), ``model.safetensors`` with every tensor of
:class:`~core.drafters.dflash.DFlashDrafter` except the two it takes from the target at load time (the token
embedding and the head's draft-vocabulary rows, both frozen), ``metrics.json`` and ``recipe.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.drafters.dflash import KIND, DFlashConfig, DFlashDrafter
from core.drafters.native_export import assign_strict, read_export_dir, write_export_dir
from core.layer_ids import LAYER_CONVENTION

FORMAT_VERSION = 1
FROM_TARGET = ("embed_tokens.weight", "lm_head.weight")  # frozen copies of the target's weights: never stored


def spectrain_block(config: DFlashConfig, target: dict[str, Any], extra: dict[str, Any] | None = None) -> dict:
    return {
        "format_version": FORMAT_VERSION, "kind": KIND, "layout": "native", "target": target,
        "architecture": config.to_dict(), "block_size": config.block_size, "num_layers": config.num_layers,
        "mask_token_id": config.mask_token_id,
        "layers": {"ids": list(config.aux_layer_ids), "convention": LAYER_CONVENTION},
        "vocab": {"vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size},
        "embed_tokens": "target", "lm_head": "target rows of the draft vocabulary", **(extra or {}),
    }


def stored_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().contiguous() for name, t in drafter.state_dict().items() if name not in FROM_TARGET}


def save_native(drafter: DFlashDrafter, out_dir: str | Path, *, target: dict[str, Any] | None,
                recipe: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                extra: dict[str, Any] | None = None) -> Path:
    """Write the native export dir atomically; refuses an existing non-empty ``out_dir``, a drafter without a
    target record and non-finite weights."""
    tensors = stored_tensors(drafter)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"the drafter's tensor '{name}' holds NaN/inf (training diverged?): export an earlier "
                             "checkpoint (runs/<run>/checkpoints/stepN.ckpt) or retrain")
    return write_export_dir(out_dir, tensors, spectrain_block(drafter.config, target, extra), recipe=recipe,
                            metrics=metrics)


def read_native(path: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, spectrain block) of a native DFlash export; one-line errors for anything else."""
    return read_export_dir(path, kind=KIND, title="DFlash", loader="the dflash algorithm", config_cls=DFlashConfig)


def build_drafter(config: DFlashConfig, tensors: dict[str, torch.Tensor], embed_weight: torch.Tensor | None = None,
                  head_weight: torch.Tensor | None = None) -> DFlashDrafter:
    """The module holding ``tensors`` (strict: no missing or unknown tensor, shapes checked) with the target's
    embedding and head (zero placeholders when not given: inspection and re-export only, never serving)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    assign_strict(drafter, tensors, title="DFlash", frozen=FROM_TARGET)
    dtype = tensors["fc.weight"].dtype
    placeholder = torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype)
    drafter.use_target_embedding(placeholder if embed_weight is None else embed_weight)
    drafter.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)  # off the meta device
    drafter.use_target_head(placeholder if head_weight is None else head_weight)
    return drafter


def load_native(path: str | Path, embed_weight: torch.Tensor | None = None,
                head_weight: torch.Tensor | None = None) -> DFlashDrafter:
    config, tensors, _ = read_native(path)
    return build_drafter(config, tensors, embed_weight, head_weight)
