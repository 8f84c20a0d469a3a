"""Drafter kinds: the ``kind`` field of a recipe names one; fit dispatches to its LightningModule and export
to its checkpoint exporter (kinds other than EAGLE-3).

Each drafter issue registers its kind in its own module and adds that module to ``KIND_MODULES``, which is
imported lazily so ``python -m spectrain.fit --help`` does not pay for every drafter's imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UserError

KIND_MODULES: list[str] = [  # modules that call register_kind(...) at import time
    "spectrain.modules.draft_lm",
    "spectrain.modules.eagle3",
    "spectrain.modules.specblock",
    "spectrain.modules.hrad",
    "spectrain.modules.dflash",
    "spectrain.modules.peagle",
]


@dataclass(frozen=True)
class DrafterKind:
    name: str
    build_module: Callable[[Any], Any]  # cfg -> LightningModule
    build_datamodule: Callable[[Any], Any]  # cfg -> LightningDataModule
    model_schema: type | None = None  # dataclass validating cfg.model
    export_checkpoint: Callable[[Path, Any], Path] | None = None  # (.ckpt, export cfg) -> export dir; None: EAGLE-3's
    import_reference: Callable[[Path, Any], Path] | None = None  # (reference release, export cfg) -> export dir


_KINDS: dict[str, DrafterKind] = {}


def register_kind(kind: DrafterKind) -> DrafterKind:
    _KINDS[kind.name] = kind
    return kind


def _import_kind_modules() -> None:
    for module in KIND_MODULES:
        importlib.import_module(module)


def available_kinds() -> list[str]:
    _import_kind_modules()
    return sorted(_KINDS)


def get_kind(name: str) -> DrafterKind:
    _import_kind_modules()
    if name not in _KINDS:
        raise UserError(f"unknown kind '{name}'; registered kinds: {', '.join(sorted(_KINDS)) or '(none)'}")
    return _KINDS[name]
