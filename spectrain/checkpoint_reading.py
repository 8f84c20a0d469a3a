"""Reading what training wrote, for export: a Lightning checkpoint (or an FSDP checkpoint directory) of any drafter
kind, and the notes an export directory keeps beside its weights. Each kind's exporter
(``spectrain/kinds/<kind>/export.py``) builds on these; ``python -m spectrain.export`` dispatches to them.

What ``ckpt=`` accepts (the training contract): a Lightning ``.ckpt`` whose ``state_dict`` holds the drafter under
the prefix ``drafter.`` (the LightningModule keeps the ``nn.Module`` as ``self.drafter``) and whose top-level
``"spectrain"`` entry is :func:`spectrain.checkpoint_contract.checkpoint_metadata` (the LightningModule adds it in
``on_save_checkpoint``): drafter kind and config, target record, optionally the resolved recipe and metrics.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import target_record
from core.drafters.checkpoint_files import CheckpointError, same_target
from spectrain.checkpoint_contract import DRAFTER_PREFIX
from spectrain.resume import is_sharded_checkpoint


# While reading_once() is active: each checkpoint read so far, by resolved path.
_read: dict[Path, dict[str, Any]] | None = None


@contextmanager
def reading_once() -> Iterator[None]:
    """Inside, :func:`read_lightning_checkpoint` reads each checkpoint from disk once: the export CLI asks a
    checkpoint for its kind, then the kind's exporter reads it for its tensors (a checkpoint holds the optimizer's
    state too; reading it twice doubled an export's time). Outside, nothing is kept."""
    global _read
    outer, _read = _read, {} if _read is None else _read
    try:
        yield
    finally:
        _read = outer


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint's content; a file that is not one (damaged, truncated, another format) is refused
    in one line. It also pickles training state (loops, hyper-parameters): it is the user's own artifact, so
    full unpickling is acceptable here (weights_only would refuse omegaconf objects). A sharded (FSDP) checkpoint
    directory is gathered into one full state dict in this process. Inside :func:`reading_once`, read once."""
    if _read is None:
        return _read_lightning_checkpoint(path)
    key = Path(path).resolve()
    if key not in _read:
        _read[key] = _read_lightning_checkpoint(path)
    return _read[key]


def _read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    if is_sharded_checkpoint(path):
        # Lightning's own reader of the format its ModelParallelStrategy writes (CPU, no process group).
        from lightning.fabric.utilities.load import _load_distributed_checkpoint  # Lightning: heavy, deferred

        return _load_distributed_checkpoint(Path(path))
    try:
        raw = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn zip, a foreign pickle or another format raises any of several types
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f"ckpt={path} is not a readable Lightning checkpoint ({type(exc).__name__}: "
            f"{reason}); give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt) of "
            "python -m spectrain.fit, or an export directory"
        ) from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"ckpt={path} holds a {type(raw).__name__}, not a Lightning checkpoint; give "
            "runs/<run>/checkpoints/last.ckpt of python -m spectrain.fit"
        )
    return raw


@dataclass
class TrainedDrafter:
    """What a drafter kind's checkpoint holds for its native export (:func:`read_trained_drafter`)."""

    meta: dict[str, Any]  # the checkpoint's ``spectrain`` block
    target: dict[str, Any] | None  # the target record it was trained for (or the one ``target=`` names)
    tensors: dict[str, torch.Tensor]  # the drafter's, without its prefix and the frozen ones
    recipe: dict[str, Any] | None
    metrics: dict[str, Any]  # validation metrics, step, epoch and source


def read_trained_drafter(path: Path, target: str | None, frozen: Sequence[str] = ()) -> TrainedDrafter:
    """A kind's Lightning checkpoint (or FSDP checkpoint directory) read for export: a ``target`` other than the
    one it was trained for is refused, and the drafter's tensors but ``frozen`` (names inside the drafter) kept."""
    raw = read_lightning_checkpoint(path)
    meta = raw["spectrain"]
    recorded = meta.get("target")
    if target:
        wanted = target_record(target)
        if recorded is not None and not same_target(recorded, wanted):
            raise CheckpointError(
                f"{path} was trained for target '{recorded.get('name')}', not '{target}'; "
                "use the target it was trained for"
            )
        recorded = recorded or wanted
    skipped = {DRAFTER_PREFIX + name for name in frozen}
    tensors = {
        name.removeprefix(DRAFTER_PREFIX): t
        for name, t in (raw.get("state_dict") or {}).items()
        if name.startswith(DRAFTER_PREFIX) and name not in skipped
    }
    if not tensors:
        raise CheckpointError(
            f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule keeps the "
            "drafter as self.drafter)"
        )
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    metrics = {
        **(meta.get("metrics") or {}),
        "global_step": raw.get("global_step"),
        "epoch": raw.get("epoch"),
        "source": str(path),
    }
    return TrainedDrafter(meta, recorded, tensors, recipe, metrics)


def export_dir_notes(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(recipe, metrics) an export directory keeps beside its weights: ``recipe.yaml`` (None without one) and
    ``metrics.json`` ({} without one)."""
    recipe = OmegaConf.to_container(OmegaConf.load(path / "recipe.yaml")) if (path / "recipe.yaml").is_file() else None
    metrics = json.loads((path / "metrics.json").read_text()) if (path / "metrics.json").is_file() else {}
    return recipe, metrics


def directory_target(path: Path, ckpt: Any, given: dict[str, Any] | None, title: str) -> dict[str, Any]:
    """The target a ``title`` directory ``ckpt`` (read from ``path``) drafts for: the one it records, else ``given``
    (``target=``), which a foreign checkpoint (it records none) needs."""
    target = ckpt.target or given
    if target is None:
        raise CheckpointError(
            f"{path} is a {title} checkpoint of another tool ({ckpt.layout} layout) and records no "
            "target: give target=NAME_OR_DIR (the model it drafts for)"
        )
    return target


def checkpoint_kind(path: str) -> str | None:
    """The drafter kind a Lightning checkpoint was trained as (None for export dirs)."""
    source = Path(path)
    if not source.is_file() and not is_sharded_checkpoint(source):
        return None
    raw = read_lightning_checkpoint(source)
    meta = raw.get("spectrain") or {}
    recipe = (raw.get("hyper_parameters") or {}).get("recipe") or {}
    return meta.get("kind") or recipe.get("kind")
