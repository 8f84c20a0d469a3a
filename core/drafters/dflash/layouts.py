"""DFlash export directories in three layouts, read and written.

* ``native``: ``config.json`` holds the ``spectrain`` block only (docs/architecture.md §5.3); ``model.safetensors`` the body and
  ``d2t``/``t2d``.
* ``speculators`` (vLLM): ``speculators_model_type: dflash``, ``transformer_layer_config`` (a Qwen3 layer config),
  ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``speculators_config``
  (the verifier); the body, and for a reduced draft vocabulary also ``lm_head`` (the target's rows) and the map.
* ``dflash`` (z-lab's release, SGLang): Qwen3 fields, ``architectures: [DFlashDraftModel]``, ``block_size``,
  ``num_target_layers``, ``dflash_config: {block_size, mask_token_id, target_layer_ids}``; the body only.

The body is every tensor of :class:`~core.drafters.dflash.DFlashDrafter` but the two it takes from the target (the
token embedding and the head's draft-vocabulary rows, both frozen); its names are z-lab's and speculators' own.
Every layout we write also carries our ``spectrain`` block (target identity, layer ids and their convention), so
our engine loads any of them (:func:`read_native`); a foreign checkpoint has none and is read with ``import=``
(:func:`read_checkpoint`), which needs the target it drafts for.

Layer ids. Ours and z-lab's ``target_layer_ids`` are OUTPUT-of-layer ids, 0-based (z-lab reads
``hidden_states[i + 1]``). speculators' ``aux_hidden_state_layer_ids`` name the same tensors as transformers'
``hidden_states`` indices, i.e. ours + 1, and never the target's final layer: speculators captures that output
separately (the verifier's last hidden state, its teacher) and its converter drops it from the aux ids, so a
drafter reading the final layer is refused for the speculators layout.
Vocabulary. speculators stores ``d2t`` offsets and the ``t2d`` mask only for a reduced draft vocabulary; the z-lab
layout has no vocabulary map at all (engines draft over the target's whole head), so a drafter with a reduced one
is refused for it. Reading is strict: an unknown or missing tensor, or a feature we do not run (the anchor slot
drafting, sliding-window layers), is a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.assets import AssetError, model_tensor
from core.drafters.checkpoint_files import (
    CheckpointError,
    check_trained_for,
    checked_block,
    config_or_none,
    read_config,
    read_weights,
    verifier_reference,
    vllm_layer_ids,
)
from core.drafters.dflash import KIND, DFlashConfig, DFlashDrafter
from core.drafters.eagle3 import rope_of
from core.drafters.native_export import assign_strict, read_export_dir, write_export_dir
from core.layer_ids import LAYER_CONVENTION

LAYOUTS = ("native", "speculators", "dflash")
FORMAT_VERSION = 1
FROM_TARGET = ("embed_tokens.weight", "lm_head.weight")  # frozen copies of the target's weights: never in the body
ARCHITECTURE = "DFlashDraftModel"  # what z-lab's release and speculators' save_pretrained both write
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose DFlashDraftModel the interop tests load
# Tensors the library always reloads from the verifier, whatever a checkpoint holds (``load_verifier_weights``).
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def spectrain_block(
    config: DFlashConfig, target: dict[str, Any], extra: dict[str, Any] | None = None, layout: str = "native"
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "layout": layout,
        "target": target,
        "architecture": config.to_dict(),
        "block_size": config.block_size,
        "num_layers": config.num_layers,
        "mask_token_id": config.mask_token_id,
        "layers": {
            "ids": list(config.aux_layer_ids),
            "convention": LAYER_CONVENTION,
            "speculators_ids": vllm_layer_ids(config.aux_layer_ids),
        },
        "vocab": {"vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size},
        "embed_tokens": "target",
        "lm_head": "target rows of the draft vocabulary",
        **(extra or {}),
    }


def stored_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().contiguous() for name, t in drafter.state_dict().items() if name not in FROM_TARGET}


def full_vocabulary(config: DFlashConfig) -> bool:
    return config.draft_vocab_size == config.vocab_size


# ----------------------------------------------------------------------------------------------------------
# Writing


def _layer_fields(config: DFlashConfig) -> dict[str, Any]:
    """The draft decoder layers as a transformers Qwen3 config (q/k norms per head, no sliding window): what
    speculators' ``transformer_layer_config`` and z-lab's top-level fields hold."""
    return {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.resolved_head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * config.num_layers,
    }


def layout_config(
    config: DFlashConfig, layout: str, block: dict[str, Any], *, dtype: torch.dtype, verifier: str | None = None
) -> dict[str, Any]:
    """The engine fields of ``layout``'s ``config.json`` (beside the ``spectrain`` block); refuses a drafter the
    layout cannot express. ``verifier``: what the speculators layout names as its verifier (a local HF directory
    or a hub id); default: the target's local directory, as for EAGLE-3 (``verifier_reference``)."""
    target = block.get("target") or {}
    if layout == "native":
        return {}
    if layout == "speculators":
        final = int(target["num_hidden_layers"]) - 1
        if final in config.aux_layer_ids:
            raise CheckpointError(
                f"this drafter reads the target's final layer (output-of-layer id {final}), which "
                "the speculators layout cannot name (speculators keeps that output as the "
                "verifier's last hidden state): export format=dflash (SGLang) or retrain without "
                "that layer (layers=dflashK stops at L - 3)"
            )
        layer = _layer_fields(config)
        scaling = dict(config.rope_scaling) if config.rope_scaling else {"rope_type": "default"}
        layer["rope_parameters"] = {**scaling, "rope_theta": config.rope_theta}  # transformers 5's form, as saved
        return {
            "speculators_model_type": KIND,
            "architectures": [ARCHITECTURE],
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": config.draft_vocab_size,
            "block_size": config.block_size,
            "target_hidden_size": config.target_hidden_size,
            "aux_hidden_state_layer_ids": vllm_layer_ids(config.aux_layer_ids),
            "mask_token_id": config.mask_token_id,  # vLLM refuses a DFlash drafter without it
            "sample_from_anchor": False,  # the anchor is the bonus token; only the mask slots draft
            "sliding_window_non_causal": False,
            "speculators_config": {
                "algorithm": KIND,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.drafted_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier or verifier_reference(target),
                    "architectures": list(target.get("architectures") or []),
                },
            },
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
    if layout == "dflash":
        if not full_vocabulary(config):
            raise CheckpointError(
                f"the dflash (z-lab/SGLang) layout has no draft vocabulary (engines draft over the "
                f"target's whole head) but this drafter drafts {config.draft_vocab_size} of "
                f"{config.vocab_size} ids: export format=speculators, or train with "
                "draft_vocab_size=0"
            )
        layer = _layer_fields(config)
        # transformers 4's RoPE fields, as z-lab's releases write them (transformers 5 reads them too)
        layer.update(
            rope_theta=config.rope_theta, rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None
        )
        return {
            "architectures": [ARCHITECTURE],
            **layer,
            "block_size": config.block_size,
            "num_target_layers": int(target["num_hidden_layers"]),
            "dflash_config": {
                "block_size": config.block_size,
                "mask_token_id": config.mask_token_id,
                "target_layer_ids": list(config.aux_layer_ids),
            },
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
    raise CheckpointError(f"unknown DFlash layout '{layout}'; use one of {', '.join(LAYOUTS)}")


def layout_tensors(drafter: DFlashDrafter, layout: str) -> dict[str, torch.Tensor]:
    """The tensors ``layout`` stores: native, the body + vocabulary map; the engine layouts of the whole vocabulary,
    the body alone (the verifier's head, no identity map: as speculators saves it, and z-lab's release); the
    speculators layout of a reduced one, the body + the frozen head rows + the map."""
    tensors = stored_tensors(drafter)
    if layout == "native":
        return tensors
    if full_vocabulary(drafter.config):
        tensors.pop("d2t")
        tensors.pop("t2d")
    else:
        tensors["lm_head.weight"] = drafter.lm_head.weight.detach().cpu().contiguous()
    return tensors


def save_layout(
    drafter: DFlashDrafter,
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
    without a target record, non-finite weights and what the layout cannot express. The speculators layout of a
    reduced vocabulary stores the drafter's ``lm_head``: build it with the target's head (``build_drafter``)."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown DFlash layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    if target is None:
        raise CheckpointError(
            "this DFlash drafter does not record its target: give target=NAME_OR_DIR (the model it drafts for)"
        )
    block = spectrain_block(drafter.config, target, extra, layout)
    engine = layout_config(drafter.config, layout, block, dtype=drafter.fc.weight.dtype, verifier=verifier)
    tensors = layout_tensors(drafter, layout)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"the drafter's tensor '{name}' holds NaN/inf (training diverged?): export an "
                "earlier checkpoint (runs/<run>/checkpoints/stepN.ckpt) or retrain"
            )
    return write_export_dir(out_dir, tensors, block, recipe=recipe, metrics=metrics, engine_config=engine)


def save_native(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    *,
    target: dict[str, Any] | None,
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """The native layout (:func:`save_layout`)."""
    return save_layout(drafter, out_dir, target=target, recipe=recipe, metrics=metrics, extra=extra)


def target_head(target: dict[str, Any], verifier: str | None = None) -> torch.Tensor:
    """The target's [V, H] head, read alone from its weights (``verifier`` when it is a local directory, else the
    target record's model); a tied target's is its embedding, as speculators takes it."""
    source = verifier if verifier and Path(verifier).is_dir() else target.get("name")
    try:
        try:
            return model_tensor(source, "lm_head.weight")
        except AssetError:  # tied embeddings: no lm_head tensor
            return model_tensor(source, "embed_tokens.weight")
    except AssetError as exc:
        raise CheckpointError(
            f"the target's head could not be read ({exc}); give verifier=DIR, the target's local HF directory"
        ) from None


# ----------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class DFlashCheckpoint:
    """A DFlash drafter read from a directory: its config, the body + ``d2t``/``t2d`` under our names, the
    ``spectrain`` block (None for a foreign checkpoint), the layout, and the head rows a speculators file carries
    (reduced vocabulary; never used, only checked against the target's)."""

    config: DFlashConfig
    tensors: dict[str, torch.Tensor]
    block: dict[str, Any] | None
    layout: str
    head: torch.Tensor | None = None

    @property
    def target(self) -> dict[str, Any] | None:
        return (self.block or {}).get("target")


def detect_layout(raw: dict[str, Any]) -> str | None:
    """The DFlash layout of a ``config.json`` (None: not a DFlash checkpoint)."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        return "speculators" if kind == KIND else None
    if ARCHITECTURE in (raw.get("architectures") or []) or "dflash_config" in raw:
        return "dflash"
    block = raw.get("spectrain")
    return "native" if isinstance(block, dict) and block.get("kind") == KIND else None


def layout_of(path: str | Path) -> str | None:
    """The DFlash layout of the directory ``path`` (None: no readable config.json of a DFlash checkpoint)."""
    raw = config_or_none(path)
    return None if raw is None else detect_layout(raw)


def _need(raw: dict[str, Any], key: str, where: str) -> Any:
    if raw.get(key) is None:
        raise CheckpointError(f"{where} has no '{key}'; a DFlash checkpoint needs it")
    return raw[key]


def _config_from_fields(layer: dict[str, Any], where: str, **dflash: Any) -> DFlashConfig:
    """Our config from a transformers decoder-layer config (Qwen3 defaults where a field is absent, as the library
    builds its layers) and the DFlash fields; refuses sliding-window layers, which we do not run."""
    if layer.get("use_sliding_window") or "sliding_attention" in (layer.get("layer_types") or []):
        raise CheckpointError(f"{where}: sliding-window draft layers, which spectrain's DFlash does not run")
    heads = int(_need(layer, "num_attention_heads", where))
    theta, scaling = rope_of(layer)
    try:
        return DFlashConfig(
            hidden_size=int(_need(layer, "hidden_size", where)),
            intermediate_size=int(_need(layer, "intermediate_size", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=layer.get("head_dim"),
            vocab_size=int(_need(layer, "vocab_size", where)),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(layer.get("max_position_embeddings", 32768)),
            hidden_act=layer.get("hidden_act", "silu"),
            num_layers=int(_need(layer, "num_hidden_layers", where)),
            attention_bias=bool(layer.get("attention_bias", False)),
            **dflash,
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _speculators_config(raw: dict[str, Any], where: str) -> DFlashConfig:
    if raw.get("sample_from_anchor"):
        raise CheckpointError(
            f"{where} sets sample_from_anchor=true (the anchor slot drafts too), which spectrain's DFlash does not run"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or not layer:
        raise CheckpointError(f"{where} has no 'transformer_layer_config'; a DFlash checkpoint needs it")
    ids = [int(i) for i in _need(raw, "aux_hidden_state_layer_ids", where)]
    if min(ids, default=1) < 1:
        raise CheckpointError(
            f"{where}: aux_hidden_state_layer_ids {ids} include 0 (the embeddings), which spectrain "
            "does not capture as a layer"
        )
    return _config_from_fields(
        layer,
        where,
        draft_vocab_size=int(raw.get("draft_vocab_size") or _need(layer, "vocab_size", where)),
        target_hidden_size=int(raw.get("target_hidden_size") or _need(layer, "hidden_size", where)),
        aux_layer_ids=[i - 1 for i in ids],  # speculators' ids are hidden_states indices: ours + 1
        block_size=int(_need(raw, "block_size", where)),
        mask_token_id=int(_need(raw, "mask_token_id", where)),
    )


def _dflash_config(raw: dict[str, Any], where: str) -> DFlashConfig:
    dflash = raw.get("dflash_config") or {}
    block_size = raw.get("block_size") or dflash.get("block_size")  # older releases: top level; newer: nested
    if block_size is None:
        raise CheckpointError(
            f"{where} has no 'block_size' (top level or in dflash_config); a DFlash checkpoint needs it"
        )
    return _config_from_fields(
        raw,
        where,
        draft_vocab_size=int(_need(raw, "vocab_size", where)),
        target_hidden_size=int(raw.get("target_hidden_size") or _need(raw, "hidden_size", where)),
        aux_layer_ids=[int(i) for i in _need(dflash, "target_layer_ids", f"{where} dflash_config")],
        block_size=int(block_size),
        mask_token_id=int(_need(dflash, "mask_token_id", f"{where} dflash_config")),
    )


def _expected_names(config: DFlashConfig) -> set[str]:
    with torch.device("meta"):
        return set(DFlashDrafter(config).state_dict()) - set(FROM_TARGET)


def _body(
    weights: dict[str, torch.Tensor], config: DFlashConfig, layout: str, directory: Path
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A foreign layout's tensors -> (our body + vocab map, the head rows it carries or None); strict."""
    weights = {name: t for name, t in weights.items() if name not in VERIFIER_OWNED}
    head = weights.pop("lm_head.weight", None)
    if full_vocabulary(config):
        head = None  # the verifier's whole head, which the library reloads anyway (and we take from the target)
        weights.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        weights.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    elif head is None:
        raise CheckpointError(
            f"{directory}: a {config.draft_vocab_size}-id draft vocabulary but no lm_head.weight "
            "(the target's rows of it); refusing to invent weights"
        )
    expected = _expected_names(config)
    unknown, missing = sorted(set(weights) - expected), sorted(expected - set(weights))
    if unknown or missing:
        raise CheckpointError(
            f"{directory}: {layout} layout has unknown tensors {unknown[:4]} and lacks "
            f"{missing[:4]}; refusing to skip or invent weights"
        )
    if head is not None and tuple(head.shape) != (config.draft_vocab_size, config.hidden_size):
        raise CheckpointError(
            f"{directory}: lm_head.weight is {tuple(head.shape)} but the config gives "
            f"{(config.draft_vocab_size, config.hidden_size)}"
        )
    weights["d2t"], weights["t2d"] = weights["d2t"].long(), weights["t2d"].bool()
    return weights, head


def read_checkpoint(path: str | Path, target: dict[str, Any] | None = None) -> DFlashCheckpoint:
    """Read a DFlash directory in any layout (auto-detected): ours (any layout, with its ``spectrain`` block) or a
    foreign speculators / z-lab one. ``target`` (a target record) is checked against what the checkpoint
    states; a foreign one gets it as its target."""
    directory = Path(path)
    raw = read_config(directory, "DFlash")
    layout = detect_layout(raw)
    if layout is None:
        raise CheckpointError(
            f"{directory}/config.json is not a DFlash checkpoint (expected speculators_model_type "
            f"dflash, architectures [{ARCHITECTURE}] with dflash_config, or a spectrain dflash "
            f"block; got speculators_model_type {raw.get('speculators_model_type')}, "
            f"architectures {raw.get('architectures')})"
        )
    block = checked_block(raw, directory, KIND, "DFlash")
    if layout == "native":
        try:
            config, tensors, block = read_export_dir(
                directory, kind=KIND, title="DFlash", loader="the dflash algorithm", config_cls=DFlashConfig
            )
        except (AssetError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
        ckpt = DFlashCheckpoint(config, tensors, block, layout)
    else:
        where = f"{directory}/config.json"
        config = _speculators_config(raw, where) if layout == "speculators" else _dflash_config(raw, where)
        if block is not None and block.get("architecture") != config.to_dict():
            raise CheckpointError(
                f"{where}: its {layout} fields disagree with its spectrain block (edited by hand?); re-export it"
            )
        tensors, head = _body(read_weights(directory), config, layout, directory)
        ckpt = DFlashCheckpoint(config, tensors, block, layout, head)
        if (
            layout == "dflash"
            and target is not None
            and raw.get("num_target_layers") is not None
            and int(raw["num_target_layers"]) != int(target["num_hidden_layers"])
        ):
            raise CheckpointError(
                f"{where} drafts for a {raw['num_target_layers']}-layer target, but target "
                f"'{target.get('name')}' has {target['num_hidden_layers']} layers"
            )
    if target is not None:
        check_trained_for(directory, ckpt.target, ckpt.config, target)
    return ckpt


def check_head(ckpt: DFlashCheckpoint, head: torch.Tensor, where: str | Path) -> None:
    """A carried head must be the target's ``head`` [V, H] rows of the draft vocabulary (ours is, frozen): a
    checkpoint whose head was trained would be another drafter once we take the target's rows."""
    if ckpt.head is None:
        return
    ids = torch.arange(ckpt.config.draft_vocab_size) + ckpt.tensors["d2t"]
    if not torch.equal(ckpt.head, head[ids].to(ckpt.head.dtype)):
        raise CheckpointError(
            f"{where}: its lm_head is not the target's head over the draft vocabulary (trained, or "
            "for another target?); spectrain's DFlash keeps the target's rows frozen, so it cannot "
            "run this drafter"
        )


def read_native(path: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, spectrain block) of a DFlash export of ours in any layout (native, speculators or dflash:
    each carries the block), for the engine; a foreign checkpoint lacks the block and is refused, pointing at
    ``import=``; one-line errors for anything else."""
    directory = Path(path)
    if layout_of(directory) in ("speculators", "dflash"):
        ckpt = read_checkpoint(directory)
        if ckpt.block is None:
            raise ValueError(
                f"drafter '{directory}' is a DFlash checkpoint without a spectrain block (another "
                f"tool's); import it first: python -m spectrain.export import={directory} "
                "target=NAME_OR_DIR out=DIR"
            )
        return ckpt.config, ckpt.tensors, ckpt.block
    return read_export_dir(path, kind=KIND, title="DFlash", loader="the dflash algorithm", config_cls=DFlashConfig)


def build_drafter(
    config: DFlashConfig,
    tensors: dict[str, torch.Tensor],
    embed_weight: torch.Tensor | None = None,
    head_weight: torch.Tensor | None = None,
) -> DFlashDrafter:
    """The module holding ``tensors`` (strict: no missing or unknown tensor, shapes checked) with the target's
    embedding and head (zero placeholders when not given: inspection and re-export only, never serving)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    assign_strict(drafter, tensors, title="DFlash", frozen=FROM_TARGET)
    dtype = tensors["fc.weight"].dtype
    placeholder = torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype)
    drafter.use_target_embedding(placeholder if embed_weight is None else embed_weight)
    drafter.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)  # off the meta device
    # detached: the target's head is a Parameter (the engine's runner), which the module would register as its own
    # ``_target_head`` (an extra tensor in its state_dict and parameters)
    drafter.use_target_head(placeholder if head_weight is None else head_weight.detach())
    return drafter


def load_native(
    path: str | Path, embed_weight: torch.Tensor | None = None, head_weight: torch.Tensor | None = None
) -> DFlashDrafter:
    config, tensors, _ = read_native(path)
    return build_drafter(config, tensors, embed_weight, head_weight)
