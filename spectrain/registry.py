"""Drafter kinds, training half: the ``kind`` field of a recipe names one; fit dispatches to its LightningModule and
export to its checkpoint exporter.

The kinds are the rows of ``core.drafters.kinds.KIND_MODULES``; each row names the module that registers its
training half here (``register_kind``) when imported. Those modules are imported lazily, so
``python -m spectrain.fit --help`` does not pay for every drafter's imports. A kind defined outside the table (a
module named in ``SPECTRAIN_KIND_MODULES``, or a test's) registers the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.drafters.kinds import KIND_MODULES
from core.errors import UserError


@dataclass(frozen=True)
class DrafterKind:
    """What training and export know of a drafter kind (the engine's half: ``core.drafters.kinds.EngineKind``)."""

    name: str
    build_module: Callable[[Any], Any]  # cfg -> LightningModule
    build_datamodule: Callable[[Any], Any]  # cfg -> LightningDataModule
    model_schema: type | None = None  # dataclass validating cfg.model
    # (Lightning .ckpt, or a directory of a layout the kind recognises, export cfg) -> export dir
    export_checkpoint: Callable[[Path, Any], Path] | None = None


_KINDS: dict[str, DrafterKind] = {}


def register_kind(kind: DrafterKind) -> DrafterKind:
    _KINDS[kind.name] = kind
    return kind


def _import_kind_modules() -> None:
    for _, module in KIND_MODULES.values():
        importlib.import_module(module)


def available_kinds() -> list[str]:
    _import_kind_modules()
    return sorted(_KINDS)


def get_kind(name: str) -> DrafterKind:
    if name not in _KINDS and name in KIND_MODULES:
        importlib.import_module(KIND_MODULES[name][1])
    if name not in _KINDS:
        _import_kind_modules()
    if name not in _KINDS:
        raise UserError(f"unknown kind '{name}'; registered kinds: {', '.join(sorted(_KINDS)) or '(none)'}")
    return _KINDS[name]
