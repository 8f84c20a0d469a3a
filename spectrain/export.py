"""``python -m spectrain.export ckpt=PATH format=native|sglang|speculators|dflash out=DIR`` — export a trained drafter.

``python -m spectrain.export import=PATH [target=NAME_OR_DIR] [format=native] out=DIR`` reads an EAGLE-3
checkpoint in the SGLang or speculators/vLLM layout, a DFlash one in the speculators or z-lab/SGLang layout, or a
P-EAGLE one in the speculators layout (auto-detected), back into our module and writes it out.

What ``ckpt=`` accepts (the training contract):

* a Lightning ``.ckpt`` whose ``state_dict`` holds the drafter under the prefix ``drafter.`` (the
  LightningModule keeps the ``nn.Module`` as ``self.drafter``) and whose top-level ``"spectrain"`` entry is
  :func:`spectrain.checkpoint_contract.checkpoint_metadata` (the LightningModule adds it in ``on_save_checkpoint``): drafter kind and config,
  target record, optionally the resolved recipe and metrics;
* an export directory in any layout (re-export to another layout).

The output directory (written atomically; it must not exist yet) holds ``config.json`` (with the ``spectrain``
block: kind, target identity, architecture, layer ids + convention, vocab map sizes), ``model.safetensors``,
``recipe.yaml`` when the checkpoint has a recipe, and ``metrics.json`` (training metrics and provenance).
Layouts and their engine conventions: :mod:`core.drafters.eagle3_layouts` (EAGLE-3: native, sglang, speculators),
:mod:`core.drafters.dflash_layouts` (DFlash: native, speculators, dflash) and :mod:`core.drafters.peagle_layouts`
(P-EAGLE: native, speculators). ``verifier=PATH_OR_ID`` (speculators
layout only) names the target as vLLM/speculators should load it; by default the target's local directory.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import check_model_reference, target_record
from core.atomic import atomic_directory, check_output
from core.drafters import dflash_layouts, peagle_layouts
from core.drafters.eagle3 import Eagle3Config
from core.drafters.eagle3_layouts import (LAYOUTS, CheckpointError, Eagle3Checkpoint, check_against_target,
                                          drafter_tensors, read_checkpoint, same_target, write_layout)
from core.overrides import OverrideError, parse_cli, run_cli
from spectrain.checkpoint_contract import DRAFTER_PREFIX, DTYPES
from spectrain.registry import get_kind
from spectrain.resume import is_sharded_checkpoint

FORMATS = tuple(dict.fromkeys((*LAYOUTS, *dflash_layouts.LAYOUTS)))  # each kind's exporter refuses the others
USAGE = ("python -m spectrain.export ckpt=PATH format=native|sglang|speculators|dflash [verifier=PATH_OR_ID] "
         "out=DIR  |  "
         "python -m spectrain.export import=PATH [target=NAME_OR_DIR] [format=native] out=DIR")


@dataclass
class ExportConfig:
    ckpt: str | None = None  # a Lightning .ckpt (drafter.* state dict + "spectrain" metadata) or an export dir
    import_path: str | None = None  # given on the command line as import=PATH
    format: str = "native"  # EAGLE-3: native | sglang | speculators; DFlash: native | speculators | dflash;
    #                         P-EAGLE: native | speculators
    out: str | None = None
    target: str | None = None  # target name or HF dir: identity for foreign checkpoints, checked otherwise
    dtype: str = "auto"  # auto (as stored) | float32 | bfloat16 | float16
    speculative_tokens: int = 3  # EAGLE-3 speculators layout: vLLM's default num_speculative_tokens (DFlash's is
    #                              always block_size - 1, P-EAGLE's num_depths: one forward drafts them)
    verifier: str | None = None  # speculators layout: the target as vLLM/speculators load it (local dir or hub
    #                              id); default: the target's local directory, never our alias (smollm2)


@dataclass
class Loaded:
    checkpoint: Eagle3Checkpoint
    recipe: dict[str, Any] | None
    metrics: dict[str, Any]


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint's content; a file that is not one (damaged, truncated, another format) is refused
    in one line. It also pickles training state (loops, hyper-parameters): it is the user's own artifact, so
    full unpickling is acceptable here (weights_only would refuse omegaconf objects). A sharded (FSDP) checkpoint
    directory is gathered into one full state dict in this process."""
    if is_sharded_checkpoint(path):
        # Lightning's own reader of the format its ModelParallelStrategy writes (CPU, no process group).
        from lightning.fabric.utilities.load import _load_distributed_checkpoint  # Lightning: heavy, deferred

        return _load_distributed_checkpoint(Path(path))
    try:
        raw = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn zip, a foreign pickle or another format raises any of several types
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"ckpt={path} is not a readable Lightning checkpoint ({type(exc).__name__}: "
                              f"{reason}); give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt) of "
                              "python -m spectrain.fit, or an export directory") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"ckpt={path} holds a {type(raw).__name__}, not a Lightning checkpoint; give "
                              "runs/<run>/checkpoints/last.ckpt of python -m spectrain.fit")
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
            raise CheckpointError(f"{path} was trained for target '{recorded.get('name')}', not '{target}'; "
                                  "use the target it was trained for")
        recorded = recorded or wanted
    skipped = {DRAFTER_PREFIX + name for name in frozen}
    tensors = {name.removeprefix(DRAFTER_PREFIX): t for name, t in (raw.get("state_dict") or {}).items()
               if name.startswith(DRAFTER_PREFIX) and name not in skipped}
    if not tensors:
        raise CheckpointError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule keeps the "
                              "drafter as self.drafter)")
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "epoch": raw.get("epoch"),
               "source": str(path)}
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
        raise CheckpointError(f"{path} is a {title} checkpoint of another tool ({ckpt.layout} layout) and records no "
                              "target: give target=NAME_OR_DIR (the model it drafts for)")
    return target


def load_lightning_checkpoint(path: Path) -> Loaded:
    raw = read_lightning_checkpoint(path)
    meta = raw.get("spectrain")
    if not meta:
        raise CheckpointError(f"{path} has no 'spectrain' metadata: the LightningModule must add "
                              "spectrain.checkpoint_contract.checkpoint_metadata(...) in on_save_checkpoint")
    if meta.get("kind") != "eagle3":
        raise CheckpointError(f"{path} holds a '{meta.get('kind')}' drafter; this exporter handles eagle3")
    state = raw.get("state_dict") or {}
    drafter_state = {k.removeprefix(DRAFTER_PREFIX): v for k, v in state.items() if k.startswith(DRAFTER_PREFIX)}
    if not drafter_state:
        raise CheckpointError(f"{path}: no '{DRAFTER_PREFIX}*' tensors in state_dict (the LightningModule must "
                              "keep the drafter as self.drafter)")
    config = Eagle3Config.from_dict(meta["config"])
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "epoch": raw.get("epoch")}
    # save_hyperparameters({"recipe": ...}) is where our LightningModules keep the resolved recipe
    recipe = meta.get("recipe") or (raw.get("hyper_parameters") or {}).get("recipe")
    return Loaded(Eagle3Checkpoint(config, drafter_tensors(drafter_state, config), meta.get("target"), "lightning"),
                  recipe, metrics)


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
        raise CheckpointError(f"{path} does not exist; give runs/<run>/checkpoints/last.ckpt of python -m "
                              "spectrain.fit, or an export directory")
    loaded = load_lightning_checkpoint(source)
    if target is not None:
        recorded = loaded.checkpoint.target
        if recorded is not None and not same_target(recorded, target):
            raise CheckpointError(f"{path} was trained for target '{recorded.get('name')}', not "
                                  f"'{target.get('name')}'; use the target it was trained for")
        check_against_target(loaded.checkpoint.config, target)
        loaded.checkpoint.target = recorded or target
    return loaded


def write_export(ckpt: Eagle3Checkpoint, out: str | Path, *, layout: str = "native",
                 recipe: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None, speculative_tokens: int = 3, verifier: str | None = None) -> Path:
    """Write ``ckpt`` as an export directory, atomically (also what a LightningModule's ``export`` calls).
    Refuses a drafter without a target record: an export must say which target it runs with."""
    out = Path(out)
    if any(out.iterdir()) if out.is_dir() else out.exists():
        raise CheckpointError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    if ckpt.target is None:
        raise CheckpointError("this checkpoint does not record its target: give target=NAME_OR_DIR (the model it "
                              "drafts for) so the export can be checked and loaded safely")
    ckpt.check_shapes()  # every tensor must fit the module before anything is written
    for name, tensor in ckpt.tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"the drafter's tensor '{name}' holds NaN/inf (training diverged?): export an "
                                  "earlier checkpoint (runs/<run>/checkpoints/stepN.ckpt) or retrain")
    with atomic_directory(out) as tmp:
        write_layout(ckpt, layout, tmp, dtype=dtype, speculative_tokens=speculative_tokens, verifier=verifier)
        (tmp / "metrics.json").write_text(json.dumps(metrics or {}, indent=2, default=str) + "\n")
        if recipe is not None:
            (tmp / "recipe.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(recipe)))
    return out


def export(cfg: Any) -> Path:
    """Run the export a config describes; returns the output directory."""
    if bool(cfg.ckpt) == bool(cfg.import_path):
        raise OverrideError(f"give exactly one of ckpt=PATH or import=PATH; usage: {USAGE}")
    if cfg.format not in FORMATS:
        raise OverrideError(f"format must be one of {', '.join(FORMATS)}, got '{cfg.format}'")
    if cfg.dtype not in DTYPES:
        raise OverrideError(f"dtype must be one of {', '.join(DTYPES)}, got '{cfg.dtype}'")
    if not cfg.out:
        raise OverrideError(f"out=DIR is required; usage: {USAGE}")
    if cfg.verifier and cfg.format != "speculators":
        raise OverrideError(f"verifier= names the target in the speculators layout only; drop it or add "
                            f"format=speculators (got format={cfg.format})")
    verifier = check_model_reference(cfg.verifier) if cfg.verifier else None
    out = check_output(cfg.out)  # before reading anything
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    source = cfg.ckpt or cfg.import_path
    kind = checkpoint_kind(cfg.ckpt) if cfg.ckpt else None
    if kind in ("draft_lm", "hrad", "specblock", "dflash", "peagle"):  # each kind's module exports its checkpoints
        return get_kind(kind).export_checkpoint(Path(cfg.ckpt), cfg)
    if dflash_layouts.layout_of(source) is not None:  # a DFlash directory, ours or another tool's, any layout
        return get_kind("dflash").export_checkpoint(Path(source), cfg)
    if peagle_layouts.layout_of(source) is not None:  # a P-EAGLE directory, ours or the library's
        return get_kind("peagle").export_checkpoint(Path(source), cfg)
    reference = Path(cfg.import_path or "") / "config.json"  # the SpecBlock reference release's config
    if cfg.import_path and reference.is_file() and "diffspec_draft_token_num" in json.loads(reference.read_text()):
        return get_kind("specblock").import_reference(Path(cfg.import_path), cfg)
    if cfg.format not in LAYOUTS:
        raise CheckpointError(f"format={cfg.format} is a DFlash layout; an EAGLE-3 drafter exports as format="
                              f"{', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}")
    loaded = load_source(source, target_record(cfg.target) if cfg.target else None)
    metrics = {**loaded.metrics, "source": str(source), "source_layout": loaded.checkpoint.layout}
    return write_export(loaded.checkpoint, cfg.out, layout=cfg.format, recipe=loaded.recipe, metrics=metrics,
                        dtype=DTYPES[cfg.dtype], speculative_tokens=cfg.speculative_tokens, verifier=verifier)


def checkpoint_kind(path: str) -> str | None:
    """The drafter kind a Lightning checkpoint was trained as (None for export dirs)."""
    source = Path(path)
    if not source.is_file() and not is_sharded_checkpoint(source):
        return None
    raw = read_lightning_checkpoint(source)
    meta = raw.get("spectrain") or {}
    recipe = (raw.get("hyper_parameters") or {}).get("recipe") or {}
    return meta.get("kind") or recipe.get("kind")


def parse_args(argv: Sequence[str]) -> Any:
    # "import" is a Python keyword, so the schema field is import_path; accept the documented spelling.
    argv = [("import_path=" + a.split("=", 1)[1]) if a.startswith("import=") else a for a in argv]
    return parse_cli(argv, ExportConfig, USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: list[str]) -> tuple[Any, Path]:
        cfg = parse_args(args)
        return cfg, export(cfg)

    def report(result: tuple[Any, Path]) -> None:
        print(f"[export] wrote {result[0].format} drafter to {result[1]}", file=sys.stderr)

    return run_cli(argv, run, doc=__doc__, schema=ExportConfig, report=report)

if __name__ == "__main__":
    sys.exit(main())
