"""SpecBlock checkpoints out of training and in from the reference release: ``python -m spectrain.export`` for
``kind=specblock`` (the native export dir that ``core.drafters.specblock.load_native`` reads), and for a directory
of the reference release (``core.drafters.specblock.layouts.layout_of`` recognises it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.assets import load_safetensors, target_record
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.specblock import SpecBlockConfig, build_drafter, save_native
from core.drafters.specblock.layouts import layout_of, reference_config, reference_tensors
from spectrain.checkpoint_contract import DTYPES
from spectrain.checkpoint_reading import read_trained_drafter


def export_specblock_checkpoint(path: Any, cfg: Any) -> Any:
    """``python -m spectrain.export ckpt=<specblock .ckpt> out=DIR``: the native export dir (K, layers, rank
    buckets, widths and vocab map in ``config.json``; ``core.drafters.specblock.load_native`` reads it). A
    directory of the reference release is imported (:func:`import_specblock_reference`)."""
    if layout_of(path) == "reference":
        return import_specblock_reference(path, cfg)
    if cfg.format != "native":
        raise CheckpointError(
            f"a specblock drafter exports only as format=native; '{cfg.format}' is an EAGLE-3 engine layout"
        )
    trained = read_trained_drafter(path, cfg.target, frozen=("embed_tokens.weight",))
    drafter = build_drafter(SpecBlockConfig.from_dict(trained.meta["config"]), trained.tensors)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    training = {
        key: (trained.recipe or {}).get("model", {}).get(key)
        for key in ("train_blocks", "slot_weight", "rank_mask", "rank_freq_budget", "warm_start")
    }
    return save_native(
        drafter,
        cfg.out,
        target=trained.target,
        recipe=trained.recipe,
        metrics=trained.metrics,
        extra={"training": training},
    )


def import_specblock_reference(path: Any, cfg: Any) -> Any:
    """``python -m spectrain.export import=<release dir> target=NAME_OR_DIR out=DIR``: a checkpoint of the
    reference release (config.json + model.safetensors) -> our native export dir."""

    directory = Path(path)
    if not cfg.target:
        raise CheckpointError(
            f"{directory} is a reference SpecBlock checkpoint without a target record: give "
            "target=NAME_OR_DIR (the model it drafts for)"
        )
    if cfg.format != "native":
        raise CheckpointError(f"a specblock drafter exports only as format=native, not '{cfg.format}'")
    target = target_record(cfg.target)
    raw = json.loads((directory / "config.json").read_text())
    config = reference_config(raw, target)
    if config.target_hidden_size != target["hidden_size"]:
        raise CheckpointError(
            f"{directory} drafts for hidden size {config.target_hidden_size} but target "
            f"'{cfg.target}' has {target['hidden_size']}; use the target it was trained for"
        )
    weights = load_safetensors(directory / "model.safetensors", fix="re-download the reference checkpoint")
    tensors = reference_tensors(weights)
    drafter = build_drafter(config, tensors)  # strict: unknown or missing tensors fail in one line
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    return save_native(
        drafter,
        cfg.out,
        target=target,
        metrics={"source": str(directory), "source_layout": "specblock_reference"},
        extra={"imported_from": "specblock_reference"},
    )
