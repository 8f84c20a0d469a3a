"""P-EAGLE export directories in two layouts, read and written: EAGLE-3's layouts (:mod:`core.drafters.eagle3.layouts`)
plus ``mask_hidden`` and the P-EAGLE fields.

* ``native``: ``config.json`` holds the ``spectrain`` block only (kind ``peagle``, the architecture with
  ``mask_token_id`` and ``num_depths``); ``model.safetensors`` the drafter's tensors but the target's embedding.
* ``speculators`` (vLLM): EAGLE-3's speculators layout (``layers.0.*``, input-of-layer aux ids, the target's
  ``embed_tokens.weight`` shipped) with ``speculators_model_type: peagle``, ``architectures: [PEagleSpeculator]``,
  ``mask_token_id`` (vLLM's ``pard_token``), ``speculators_config.algorithm: peagle`` and the proposal's
  ``speculative_tokens`` = K; ``mask_hidden`` [1, 1, 3·H_t] as the library names it.

``norm_before_residual``: written always. vLLM's config conversion defaults it to False for ``peagle`` but to True for
``eagle3`` (``vllm/transformers_utils/configs/speculators/algos.py``: ``update_peagle`` / ``update_eagle3``);
speculators defaults both to False. A foreign peagle config without the field is read as vLLM serves it: False.
Every layout we write carries our ``spectrain`` block, so our engine loads either (:func:`read_native`); a foreign
checkpoint has none and is read with ``import=`` (:func:`read_checkpoint`), which needs the target it drafts for. A
library checkpoint carries its own (trained) token embedding, which is then kept as the drafter's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.assets import AssetError
from core.drafters.checkpoint_files import (
    CheckpointError,
    check_trained_for,
    checked_block,
    config_or_none,
    read_config,
    read_weights,
    vllm_layer_ids,
)
from core.drafters.eagle3.layouts import (
    EMBED,
    Eagle3Checkpoint,
    config_from_engine,
    target_embedding,
    tensors_from_layout,
)
from core.drafters.eagle3.layouts import layout_config as eagle3_layout_config
from core.drafters.eagle3.layouts import layout_tensors as eagle3_layout_tensors
from core.drafters.native_export import assign_strict, read_export_dir, write_export_dir
from core.drafters.peagle import KIND, PEagleConfig, PEagleDrafter
from core.layer_ids import LAYER_CONVENTION

LAYOUTS = ("native", "speculators")
FORMAT_VERSION = 1
ARCHITECTURE = "PEagleSpeculator"  # what speculators' PEagleSpeculatorConfig writes
MASK_HIDDEN = "mask_hidden"
VLLM_NORM_BEFORE_RESIDUAL = False  # vLLM's update_peagle default when the field is absent (update_eagle3: True)


def spectrain_block(
    config: PEagleConfig, target: dict[str, Any], extra: dict[str, Any] | None = None, layout: str = "native"
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "layout": layout,
        "target": target,
        "architecture": config.to_dict(),
        "num_depths": config.num_depths,
        "mask_token_id": config.mask_token_id,
        "layers": {
            "ids": list(config.aux_layer_ids),
            "convention": LAYER_CONVENTION,
            "vllm_input_ids": vllm_layer_ids(config.aux_layer_ids),
        },
        "vocab": {"vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size},
        "embed_tokens": "own" if config.own_embedding else "target",
        **(extra or {}),
    }


def from_target(config: PEagleConfig) -> tuple[str, ...]:
    """Tensors the target gives the drafter (never stored): its token embedding, unless the drafter owns one."""
    return () if config.own_embedding else (EMBED,)


def stored_tensors(drafter: PEagleDrafter) -> dict[str, torch.Tensor]:
    skip = from_target(drafter.config)
    return {name: t.detach().cpu().contiguous() for name, t in drafter.state_dict().items() if name not in skip}


# ----------------------------------------------------------------------------------------------------------
# Writing


def layout_config(
    config: PEagleConfig,
    tensors: dict[str, torch.Tensor],
    layout: str,
    target: dict[str, Any],
    *,
    dtype: torch.dtype,
    verifier: str | None = None,
) -> dict[str, Any]:
    """The engine fields of ``layout``'s ``config.json`` (beside the ``spectrain`` block): EAGLE-3's speculators
    fields with P-EAGLE's on top."""
    if layout == "native":
        return {}
    if layout != "speculators":
        raise CheckpointError(f"unknown P-EAGLE layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    fields = eagle3_layout_config(
        Eagle3Checkpoint(config, tensors, target),
        "speculators",
        dtype=dtype,
        speculative_tokens=config.num_depths,
        verifier=verifier,
    )
    fields.pop("spectrain")
    fields.update(
        speculators_model_type=KIND,
        architectures=[ARCHITECTURE],
        mask_token_id=config.mask_token_id,
        norm_before_residual=bool(config.norm_before_residual),  # explicit: engines' defaults differ
        embed_requires_grad=False,
    )  # we train with the target's embedding frozen
    fields["speculators_config"]["algorithm"] = KIND
    return fields


def layout_tensors(
    config: PEagleConfig,
    tensors: dict[str, torch.Tensor],
    layout: str,
    target: dict[str, Any],
    verifier: str | None = None,
) -> dict[str, torch.Tensor]:
    """What ``layout`` stores: native, our tensors; speculators, EAGLE-3's names plus ``mask_hidden`` and the
    target's embedding (speculators' loader leaves a missing one uninitialised)."""
    if layout == "native":
        return tensors
    out = eagle3_layout_tensors(tensors, "speculators")
    if EMBED not in out:
        embed = target_embedding(Eagle3Checkpoint(config, tensors, target), verifier)
        out[EMBED] = embed.to(tensors["fc.weight"].dtype)
    return out


def save_layout(
    drafter: PEagleDrafter,
    out_dir: str | Path,
    *,
    target: dict[str, Any] | None,
    layout: str = "native",
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    verifier: str | None = None,
) -> Path:
    """Write ``drafter`` as a ``layout`` export dir atomically; refuses an existing non-empty ``out_dir``, a drafter
    without a target record, non-finite weights and an unknown layout."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown P-EAGLE layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    if target is None:
        raise CheckpointError(
            "this P-EAGLE drafter does not record its target: give target=NAME_OR_DIR (the model it drafts for)"
        )
    config = drafter.config
    tensors = stored_tensors(drafter)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"the drafter's tensor '{name}' holds NaN/inf (training diverged?): export an "
                "earlier checkpoint (runs/<run>/checkpoints/stepN.ckpt) or retrain"
            )
    block = spectrain_block(config, target, extra, layout)
    engine = layout_config(config, tensors, layout, target, dtype=drafter.fc.weight.dtype, verifier=verifier)
    return write_export_dir(
        out_dir,
        layout_tensors(config, tensors, layout, target, verifier),
        block,
        recipe=recipe,
        metrics=metrics,
        engine_config=engine,
    )


# ----------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class PEagleCheckpoint:
    """A P-EAGLE drafter read from a directory: its config, tensors under our names (the embedding only when it owns
    one), the ``spectrain`` block (None for a foreign checkpoint) and the layout."""

    config: PEagleConfig
    tensors: dict[str, torch.Tensor]
    block: dict[str, Any] | None
    layout: str

    @property
    def target(self) -> dict[str, Any] | None:
        return (self.block or {}).get("target")


def detect_layout(raw: dict[str, Any]) -> str | None:
    """The P-EAGLE layout of a ``config.json`` (None: not a P-EAGLE checkpoint)."""
    if "speculators_model_type" in raw:
        return "speculators" if raw["speculators_model_type"] == KIND else None
    block = raw.get("spectrain")
    return "native" if isinstance(block, dict) and block.get("kind") == KIND else None


def layout_of(path: str | Path) -> str | None:
    """The P-EAGLE layout of the directory ``path`` (None: no readable config.json of a P-EAGLE checkpoint)."""
    raw = config_or_none(path)
    return None if raw is None else detect_layout(raw)


def _speculators_config(raw: dict[str, Any], target: dict[str, Any] | None, where: str) -> PEagleConfig:
    if raw.get("mask_token_id") is None:
        raise CheckpointError(f"{where} has no 'mask_token_id'; a P-EAGLE checkpoint needs it (vLLM's pard_token)")
    fields = {"norm_before_residual": VLLM_NORM_BEFORE_RESIDUAL, **raw}
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    try:
        base = config_from_engine(fields, "speculators", target)
        return PEagleConfig(
            **base.to_dict(),
            mask_token_id=int(raw["mask_token_id"]),
            num_depths=int(methods[0].get("speculative_tokens") or 8),
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def read_checkpoint(path: str | Path, target: dict[str, Any] | None = None) -> PEagleCheckpoint:
    """Read a P-EAGLE directory in either layout (auto-detected): ours (with its ``spectrain`` block) or a foreign
    speculators one. ``target`` (a target record) is checked against what the checkpoint states; a foreign one gets
    it as its target."""
    directory = Path(path)
    raw = read_config(directory, "P-EAGLE")
    layout = detect_layout(raw)
    if layout is None:
        raise CheckpointError(
            f"{directory}/config.json is not a P-EAGLE checkpoint (expected speculators_model_type "
            f"peagle or a spectrain peagle block; got speculators_model_type "
            f"{raw.get('speculators_model_type')})"
        )
    block = checked_block(raw, directory, KIND, "P-EAGLE")
    if layout == "native":
        try:
            config, tensors, block = read_export_dir(
                directory, kind=KIND, title="P-EAGLE", loader="the peagle algorithm", config_cls=PEagleConfig
            )
        except (AssetError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
    else:
        where = f"{directory}/config.json"
        config = _speculators_config(raw, target, where)
        weights = read_weights(directory)
        if block is not None and block.get("embed_tokens") == "target":
            weights.pop(EMBED, None)  # the target's own, shipped for speculators' loader
        config.own_embedding = EMBED in weights  # a checkpoint that carries an embedding keeps it
        if block is not None and block.get("architecture") != config.to_dict():
            raise CheckpointError(
                f"{where}: its speculators fields disagree with its spectrain block (edited by hand?); re-export it"
            )
        mask_hidden = weights.pop(MASK_HIDDEN, None)
        if mask_hidden is None:
            raise CheckpointError(f"{directory}: a P-EAGLE checkpoint without '{MASK_HIDDEN}'; refusing to invent it")
        tensors = {**tensors_from_layout(weights, "speculators", config, directory), MASK_HIDDEN: mask_hidden}
    ckpt = PEagleCheckpoint(config, tensors, block, layout)
    if target is not None:
        check_trained_for(directory, ckpt.target, ckpt.config, target)
    return ckpt


def read_native(path: str | Path) -> tuple[PEagleConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, spectrain block) of a P-EAGLE export of ours in either layout, for the engine; a foreign
    checkpoint lacks the block and is refused, pointing at ``import=``."""
    ckpt = read_checkpoint(path)
    if ckpt.block is None:
        raise CheckpointError(
            f"drafter '{path}' is a P-EAGLE checkpoint without a spectrain block (another tool's); "
            f"import it first: python -m spectrain.export import={path} target=NAME_OR_DIR out=DIR"
        )
    return ckpt.config, ckpt.tensors, ckpt.block


def build_drafter(
    config: PEagleConfig, tensors: dict[str, torch.Tensor], embed_weight: torch.Tensor | None = None
) -> PEagleDrafter:
    """The module holding ``tensors`` (strict: no missing or unknown tensor, shapes checked) with the target's
    embedding unless it owns one (a zero placeholder when not given: inspection and re-export only, never serving)."""
    with torch.device("meta"):
        drafter = PEagleDrafter(config)
    try:
        assign_strict(drafter, tensors, title="P-EAGLE", frozen=from_target(config))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not config.own_embedding:
        dtype = tensors["fc.weight"].dtype
        placeholder = torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype)
        drafter.use_target_embedding(placeholder if embed_weight is None else embed_weight)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def load_native(path: str | Path, embed_weight: torch.Tensor | None = None) -> PEagleDrafter:
    config, tensors, _ = read_native(path)
    return build_drafter(config, tensors, embed_weight)
