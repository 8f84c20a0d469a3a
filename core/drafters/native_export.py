"""The native export directory every learned drafter kind writes (docs/architecture.md §5.3): ``config.json`` with the
``spectrain`` block, ``model.safetensors``, ``metrics.json`` and ``recipe.yaml``; written atomically, never over
an existing export, and read back with one-line errors naming the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import load_safetensors, read_json
from core.atomic import atomic_directory
from core.errors import UserError
from core.vocab import check_vocab_mapping

REEXPORT = "re-export the drafter (python -m spectrain.export)"


def write_export_dir(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    block: dict[str, Any],
    *,
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    engine_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``tensors`` and the ``spectrain`` ``block`` (its ``kind`` names the drafter) to ``out_dir`` atomically;
    refuses an existing non-empty ``out_dir`` and a block without a target record. ``engine_config``: the fields
    another engine's layout reads, written in ``config.json`` beside the block (e.g. DFlash's speculators one)."""
    from safetensors.torch import save_file  # safetensors: a heavy import, deferred to first use

    out = Path(out_dir)
    if any(out.iterdir()) if out.is_dir() else out.exists():
        raise UserError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    if block.get("target") is None:
        raise UserError(f"a {block['kind']} export must record its target: pass target=target_record(NAME)")
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "spectrain_kind": block["kind"]})
        config = {**(engine_config or {}), "spectrain": block}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "metrics.json").write_text(json.dumps(metrics or {}, indent=2, default=str) + "\n")
        if recipe is not None:
            (tmp / "recipe.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(recipe)))
    return out


def read_export_dir(
    path: str | Path, *, kind: str, title: str, loader: str, config_cls: Any
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, spectrain block) of a native export of ``kind`` (``title``: how messages name the kind,
    e.g. "SpecBlock"; ``loader``: what cannot load another kind, e.g. "SpecBlock algorithms")."""
    directory = Path(path)
    if not directory.exists():
        raise UserError(f"drafter '{directory}' does not exist; give a {title} export of python -m spectrain.export")
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise UserError(
            f"{directory} is not a {title} export (needs config.json and model.safetensors; an "
            f"interrupted export or copy lacks one); {REEXPORT}"
        )
    block = read_json(directory / "config.json", fix=REEXPORT).get("spectrain") or {}
    if block.get("kind") != kind:
        raise UserError(
            f"{directory}/config.json records a '{block.get('kind')}' drafter, not {kind}: {loader} "
            f"cannot load it; give a {kind} export of python -m spectrain.export (or use this one with "
            f"an algorithm for {block.get('kind')} drafters)"
        )
    try:
        config = config_cls.from_dict(block.get("architecture") or {})
    except (TypeError, ValueError) as exc:  # e.g. another kind's export relabelled as this one
        raise UserError(
            f"{directory}/config.json records a {kind} drafter, but its architecture is not a "
            f"{title}'s ({str(exc).split(';')[0]}); {REEXPORT}"
        ) from None
    return config, load_safetensors(directory / "model.safetensors", fix=REEXPORT), block


def assign_strict(
    drafter: torch.nn.Module, tensors: dict[str, torch.Tensor], *, title: str, frozen: tuple[str, ...]
) -> None:
    """Assign ``tensors`` to ``drafter`` (built on the meta device): every tensor but the ``frozen`` ones the
    target gives must be there, none unknown, each of the config's shape, and the vocab map must be consistent."""
    expected = {name: t.shape for name, t in drafter.state_dict().items() if name not in frozen}
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise UserError(
            f"{title} weights do not match the config: unknown {unknown[:4]}, missing {missing[:4]}; "
            "re-export the drafter"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise UserError(
                f"tensor {name} has shape {tuple(tensor.shape)} but the config gives {tuple(expected[name])}"
            )
    check_vocab_mapping(tensors["d2t"].long(), tensors["t2d"].bool())
    drafter.load_state_dict(tensors, strict=False, assign=True)
