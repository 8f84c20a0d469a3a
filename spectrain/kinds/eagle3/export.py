"""EAGLE-3 drafters out of training or another tool, in any of its layouts (:mod:`core.drafters.eagle3.layouts`:
native, sglang, speculators):

* ``python -m spectrain.export ckpt=<eagle3 .ckpt or export dir> format=native|sglang|speculators out=DIR``;
* ``python -m spectrain.export import=<SGLang or speculators EAGLE-3 dir> target=NAME_OR_DIR out=DIR`` (a foreign
  checkpoint records no target, so ``target=`` names it).

The export CLI also hands this exporter any directory no kind recognises: its reader says what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import check_model_reference, target_record
from core.atomic import atomic_directory
from core.drafters.checkpoint_files import CheckpointError, check_against_target, same_target
from core.drafters.eagle3 import Eagle3Config
from core.drafters.eagle3.layouts import LAYOUTS, Eagle3Checkpoint, drafter_tensors, read_checkpoint, write_layout
from core.drafters.kinds import engine_kinds
from spectrain.checkpoint_contract import DRAFTER_PREFIX, DTYPES
from spectrain.checkpoint_reading import read_lightning_checkpoint
from spectrain.resume import is_sharded_checkpoint


@dataclass
class Loaded:
    checkpoint: Eagle3Checkpoint
    recipe: dict[str, Any] | None
    metrics: dict[str, Any]


def load_lightning_checkpoint(path: Path) -> Loaded:
    raw = read_lightning_checkpoint(path)
    meta = raw.get("spectrain")
    if not meta:
        raise CheckpointError(
            f"{path} has no 'spectrain' metadata: the LightningModule must add "
            "spectrain.checkpoint_contract.checkpoint_metadata(...) in on_save_checkpoint"
        )
    if meta.get("kind") != "eagle3":
        raise CheckpointError(f"{path} holds a '{meta.get('kind')}' drafter; this exporter handles eagle3")
    state = raw.get("state_dict") or {}
    drafter_state = {k.removeprefix(DRAFTER_PREFIX): v for k, v in state.items() if k.startswith(DRAFTER_PREFIX)}
    if not drafter_state:
        raise CheckpointError(
            f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule must "
            "keep the drafter as self.drafter)"
        )
    config = Eagle3Config.from_dict(meta["config"])
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "epoch": raw.get("epoch")}
    # save_hyperparameters({"recipe": ...}) is where our LightningModules keep the resolved recipe
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    return Loaded(
        Eagle3Checkpoint(config, drafter_tensors(drafter_state, config), meta.get("target"), "lightning"),
        recipe,
        metrics,
    )


def load_source(path: str, target: dict[str, Any] | None) -> Loaded:
    """A Lightning checkpoint or an export dir; ``target`` (a target record) fills in a missing target record
    and must match a recorded one."""
    source = Path(path)
    if source.is_dir() and not is_sharded_checkpoint(source):
        loaded = Loaded(read_checkpoint(source, target), None, {})
        if (source / "metrics.json").is_file():
            loaded.metrics = json.loads((source / "metrics.json").read_text())
        if (source / "recipe.yaml").is_file():
            loaded.recipe = OmegaConf.to_container(OmegaConf.load(source / "recipe.yaml"))
        return loaded
    if not source.exists():
        raise CheckpointError(
            f"{path} does not exist; give runs/<run>/checkpoints/last.ckpt of python -m "
            "spectrain.fit, or an export directory"
        )
    loaded = load_lightning_checkpoint(source)
    if target is not None:
        recorded = loaded.checkpoint.target
        if recorded is not None and not same_target(recorded, target):
            raise CheckpointError(
                f"{path} was trained for target '{recorded.get('name')}', not "
                f"'{target.get('name')}'; use the target it was trained for"
            )
        check_against_target(loaded.checkpoint.config, target)
        loaded.checkpoint.target = recorded or target
    return loaded


def write_export(
    ckpt: Eagle3Checkpoint,
    out: str | Path,
    *,
    layout: str = "native",
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> Path:
    """Write ``ckpt`` as an export directory, atomically (also what a LightningModule's ``export`` calls).
    Refuses a drafter without a target record: an export must say which target it runs with."""
    out = Path(out)
    if any(out.iterdir()) if out.is_dir() else out.exists():
        raise CheckpointError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    if ckpt.target is None:
        raise CheckpointError(
            "this checkpoint does not record its target: give target=NAME_OR_DIR (the model it "
            "drafts for) so the export can be checked and loaded safely"
        )
    ckpt.check_shapes()  # every tensor must fit the module before anything is written
    for name, tensor in ckpt.tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"the drafter's tensor '{name}' holds NaN/inf (training diverged?): export an "
                "earlier checkpoint (runs/<run>/checkpoints/stepN.ckpt) or retrain"
            )
    with atomic_directory(out) as tmp:
        write_layout(ckpt, layout, tmp, dtype=dtype, speculative_tokens=speculative_tokens, verifier=verifier)
        (tmp / "metrics.json").write_text(json.dumps(metrics or {}, indent=2, default=str) + "\n")
        if recipe is not None:
            (tmp / "recipe.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(recipe)))
    return out


def export_eagle3_checkpoint(path: Path, cfg: Any) -> Path:
    """An eagle3 Lightning checkpoint, FSDP checkpoint directory or EAGLE-3 directory (any layout) -> the export dir
    ``cfg.out`` in layout ``cfg.format``."""
    if cfg.format not in LAYOUTS:
        owners = " or ".join(kind.title for kind in engine_kinds().values() if cfg.format in kind.layouts)
        raise CheckpointError(
            f"format={cfg.format} is a {owners} layout; an EAGLE-3 drafter exports as format="
            f"{', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}"
        )
    verifier = check_model_reference(cfg.verifier) if cfg.verifier else None
    loaded = load_source(str(path), target_record(cfg.target) if cfg.target else None)
    metrics = {**loaded.metrics, "source": str(path), "source_layout": loaded.checkpoint.layout}
    return write_export(
        loaded.checkpoint,
        cfg.out,
        layout=cfg.format,
        recipe=loaded.recipe,
        metrics=metrics,
        dtype=DTYPES[cfg.dtype],
        speculative_tokens=cfg.speculative_tokens,
        verifier=verifier,
    )
