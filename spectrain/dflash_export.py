"""DFlash checkpoints out of training: ``python -m spectrain.export ckpt=<dflash .ckpt> out=DIR`` writes the native
export dir that ``core.drafters.dflash_layouts.load_native`` (and the engine's ``dflash`` algorithm) reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.assets import target_record
from core.drafters.dflash import DFlashConfig
from core.drafters.dflash_layouts import FROM_TARGET, build_drafter, save_native
from core.drafters.eagle3_layouts import CheckpointError, same_target
from spectrain.checkpoint_contract import DRAFTER_PREFIX, DTYPES
from spectrain.export import read_lightning_checkpoint


def export_dflash_checkpoint(path: Path, cfg: Any) -> Path:
    """A dflash Lightning checkpoint (or FSDP checkpoint directory) -> the native export dir ``cfg.out``."""
    if cfg.format != "native":
        raise CheckpointError(f"a dflash drafter exports as format=native; '{cfg.format}' is not a DFlash layout")
    raw = read_lightning_checkpoint(path)
    meta = raw["spectrain"]
    recorded = meta.get("target")
    if cfg.target:
        wanted = target_record(cfg.target)
        if recorded is not None and not same_target(recorded, wanted):
            raise CheckpointError(f"{path} was trained for target '{recorded.get('name')}', not '{cfg.target}'; "
                                  "use the target it was trained for")
        recorded = recorded or wanted
    config = DFlashConfig.from_dict(meta["config"])
    skipped = {DRAFTER_PREFIX + name for name in FROM_TARGET}
    tensors = {name.removeprefix(DRAFTER_PREFIX): t for name, t in (raw.get("state_dict") or {}).items()
               if name.startswith(DRAFTER_PREFIX) and name not in skipped}
    if not tensors:
        raise CheckpointError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule keeps the "
                              "drafter as self.drafter)")
    drafter = build_drafter(config, tensors)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "epoch": raw.get("epoch"),
               "source": str(path)}
    training = {key: (recipe or {}).get("model", {}).get(key) for key in ("max_anchors", "loss_decay_gamma")}
    return save_native(drafter, cfg.out, target=recorded, recipe=recipe, metrics=metrics,
                       extra={"training": training})
