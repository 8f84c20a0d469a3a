"""DFlash drafters out of training or another tool, in any of the three layouts
(:mod:`core.drafters.dflash.layouts`):

* ``python -m spectrain.export ckpt=<dflash .ckpt or export dir> format=native|speculators|dflash out=DIR``;
* ``python -m spectrain.export import=<speculators or z-lab DFlash dir> target=NAME_OR_DIR out=DIR`` (the layout is
  detected; a foreign checkpoint records no target, so ``target=`` names it).

What ``core.drafters.dflash.layouts.read_native`` (and the engine's ``dflash`` algorithm) reads back, in every
layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.assets import check_model_reference, target_record
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.dflash.layouts import (
    FROM_TARGET,
    LAYOUTS,
    build_drafter,
    check_head,
    full_vocabulary,
    read_checkpoint,
    save_layout,
    target_head,
)
from spectrain.checkpoint_contract import DTYPES
from spectrain.checkpoint_reading import directory_target, export_dir_notes, read_trained_drafter
from spectrain.resume import is_sharded_checkpoint


def _from_directory(path: Path, cfg: Any) -> tuple[DFlashConfig, dict, dict | None, dict | None, dict, dict | None]:
    """(config, tensors, target, recipe, metrics, training block) of a DFlash directory in any layout. A foreign
    checkpoint's head (speculators, reduced vocabulary) must be the target's rows, which we take instead."""
    given = target_record(cfg.target) if cfg.target else None
    ckpt = read_checkpoint(path, given)
    target = directory_target(path, ckpt, given, "DFlash")
    if ckpt.block is None:
        check_head(ckpt, target_head(target, cfg.verifier), path)
    recipe, metrics = export_dir_notes(path)
    metrics = {**metrics, "source": str(path), "source_layout": ckpt.layout}
    training = (ckpt.block or {}).get("training")
    return ckpt.config, ckpt.tensors, target, recipe, metrics, training


def export_dflash_checkpoint(path: Path, cfg: Any) -> Path:
    """A dflash Lightning checkpoint, FSDP checkpoint directory or DFlash directory (any layout) -> the export dir
    ``cfg.out`` in layout ``cfg.format``."""
    if cfg.format not in LAYOUTS:
        raise CheckpointError(
            f"a dflash drafter exports as format={', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}; "
            f"'{cfg.format}' is not a DFlash layout"
        )
    if path.is_dir() and not is_sharded_checkpoint(path):
        config, tensors, target, recipe, metrics, training = _from_directory(path, cfg)
    else:
        trained = read_trained_drafter(path, cfg.target, frozen=FROM_TARGET)
        config, tensors, target = DFlashConfig.from_dict(trained.meta["config"]), trained.tensors, trained.target
        recipe, metrics = trained.recipe, trained.metrics
        training = {key: (recipe or {}).get("model", {}).get(key) for key in ("max_anchors", "loss_decay_gamma")}
    if target is None:
        raise CheckpointError(f"{path} does not record its target: give target=NAME_OR_DIR")
    verifier = check_model_reference(cfg.verifier) if cfg.verifier else None
    # The speculators layout of a reduced vocabulary stores the frozen head rows, which only the target holds.
    head = target_head(target, verifier) if cfg.format == "speculators" and not full_vocabulary(config) else None
    drafter: DFlashDrafter = build_drafter(config, tensors, head_weight=head)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    return save_layout(
        drafter,
        cfg.out,
        target=target,
        layout=cfg.format,
        recipe=recipe,
        metrics=metrics,
        extra={"training": training} if training is not None else None,
        verifier=verifier,
    )
