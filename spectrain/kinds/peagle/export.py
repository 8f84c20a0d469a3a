"""P-EAGLE drafters out of training or another tool, in either layout (:mod:`core.drafters.peagle.layouts`):

* ``python -m spectrain.export ckpt=<peagle .ckpt or export dir> format=native|speculators out=DIR``;
* ``python -m spectrain.export import=<speculators peagle dir> target=NAME_OR_DIR out=DIR`` (a foreign checkpoint
  records no target, so ``target=`` names it).

What ``core.drafters.peagle.layouts.read_native`` (and the engine's ``peagle`` algorithm) reads back, in both layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.assets import check_model_reference, target_record
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.peagle import PEagleConfig
from core.drafters.peagle.layouts import LAYOUTS, build_drafter, from_target, read_checkpoint, save_layout
from spectrain.checkpoint_contract import DTYPES
from spectrain.checkpoint_reading import directory_target, export_dir_notes, read_trained_drafter
from spectrain.resume import is_sharded_checkpoint


def _from_directory(path: Path, cfg: Any) -> tuple[PEagleConfig, dict, dict | None, dict | None, dict]:
    """(config, tensors, target, recipe, metrics) of a P-EAGLE directory in either layout."""
    given = target_record(cfg.target) if cfg.target else None
    ckpt = read_checkpoint(path, given)
    target = directory_target(path, ckpt, given, "P-EAGLE")
    recipe, metrics = export_dir_notes(path)
    return ckpt.config, ckpt.tensors, target, recipe, {**metrics, "source": str(path), "source_layout": ckpt.layout}


def export_peagle_checkpoint(path: Path, cfg: Any) -> Path:
    """A peagle Lightning checkpoint, FSDP checkpoint directory or P-EAGLE directory (either layout) -> the export
    dir ``cfg.out`` in layout ``cfg.format``."""
    if cfg.format not in LAYOUTS:
        raise CheckpointError(
            f"a peagle drafter exports as format={' or '.join(LAYOUTS)}; '{cfg.format}' is not a P-EAGLE layout"
        )
    if path.is_dir() and not is_sharded_checkpoint(path):
        config, tensors, target, recipe, metrics = _from_directory(path, cfg)
    else:
        trained = read_trained_drafter(path, cfg.target)
        config, target, recipe, metrics = (
            PEagleConfig.from_dict(trained.meta["config"]),
            trained.target,
            trained.recipe,
            trained.metrics,
        )
        tensors = {name: t for name, t in trained.tensors.items() if name not in from_target(config)}
    if target is None:
        raise CheckpointError(f"{path} does not record its target: give target=NAME_OR_DIR")
    verifier = check_model_reference(cfg.verifier) if cfg.verifier else None
    drafter = build_drafter(config, tensors)
    if DTYPES[cfg.dtype] is not None:
        drafter = drafter.to(DTYPES[cfg.dtype])
    return save_layout(
        drafter, cfg.out, target=target, layout=cfg.format, recipe=recipe, metrics=metrics, verifier=verifier
    )
