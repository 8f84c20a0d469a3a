"""DFlash checkpoints out of training: ``python -m spectrain.export ckpt=<dflash .ckpt> out=DIR`` writes the native
export dir that ``core.drafters.dflash_layouts.load_native`` (and the engine's ``dflash`` algorithm) reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.drafters.dflash import DFlashConfig
from core.drafters.dflash_layouts import FROM_TARGET, build_drafter, save_native
from core.drafters.eagle3_layouts import CheckpointError
from spectrain.checkpoint_contract import DTYPES
from spectrain.export import read_trained_drafter


def export_dflash_checkpoint(path: Path, cfg: Any) -> Path:
    """A dflash Lightning checkpoint (or FSDP checkpoint directory) -> the native export dir ``cfg.out``."""
    if cfg.format != "native":
        raise CheckpointError(f"a dflash drafter exports as format=native; '{cfg.format}' is not a DFlash layout")
    trained = read_trained_drafter(path, cfg.target, frozen=FROM_TARGET)
    drafter = build_drafter(DFlashConfig.from_dict(trained.meta["config"]), trained.tensors)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    training = {key: (trained.recipe or {}).get("model", {}).get(key)
                for key in ("max_anchors", "loss_decay_gamma")}
    return save_native(drafter, cfg.out, target=trained.target, recipe=trained.recipe, metrics=trained.metrics,
                       extra={"training": training})
