"""H-RAD's exporter: ``python -m spectrain.export ckpt=<hrad .ckpt> out=DIR`` (:mod:`core.drafters.hrad` reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from core.assets import model_identity
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.hrad import HRAD, HRADConfig, save_native
from core.overrides import OverrideError
from spectrain.checkpoint_reading import read_lightning_checkpoint
from spectrain.kinds.hrad.report import confusion_png


def export_hrad_checkpoint(path: Path, cfg: Any) -> Path:
    """``python -m spectrain.export ckpt=PATH out=DIR`` for a kind=hrad Lightning checkpoint (native only)."""
    if cfg.format != "native":
        raise OverrideError(f"an H-RAD exports only as format=native; '{cfg.format}' is an EAGLE-3 layout")
    raw = read_lightning_checkpoint(path)  # a .ckpt file or an FSDP checkpoint directory
    meta = raw.get("spectrain") or {}
    if not meta.get("target"):
        raise CheckpointError(f"{path} has no target record: export a checkpoint saved by kind=hrad training")
    if cfg.target:
        want = model_identity(str(cfg.target))
        if (meta["target"]["config_hash"], meta["target"]["weights_hash"]) != (
            want["config_hash"],
            want["weights_hash"],
        ):
            raise CheckpointError(f"{path} was trained for target '{meta['target']['name']}', not '{cfg.target}'")
    model = HRAD(HRADConfig.from_dict(meta["config"]))
    state = {k.removeprefix("drafter."): v for k, v in raw["state_dict"].items() if k.startswith("drafter.")}
    model.load_state_dict(state, strict=True)
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "source": str(path)}
    png = confusion_png(meta["confusion"]) if meta.get("confusion") else None
    return save_native(
        model, cfg.out, target=meta["target"], recipe=meta.get("recipe"), metrics=metrics, confusion_png=png
    )
