"""The table of drafter kinds: one line per kind (``KIND_MODULES``) names the module of its engine half and the
module of its training half; each registers its record when imported (docs/drafter_kinds.md).

The engine half (:class:`EngineKind`, registered from ``core/drafters/<kind>/kind.py``) is what export, import and
the engine read: the drafter's config class, its export layouts and how to recognise them in a directory, and how
to load an export onto a target. The training half (``spectrain.registry.DrafterKind``, registered from
``spectrain/kinds/<kind>/module.py``) is resolved by spectrain only: this layer imports nothing above it. The
algorithms that serve a kind are those whose ``drafter`` names it, or the kind it serves as (``serves_as``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UserError

# kind -> (its engine module, its training module); both register their kind's record at import
KIND_MODULES: dict[str, tuple[str, str]] = {
    "draft_lm": ("core.drafters.draft_lm.kind", "spectrain.kinds.draft_lm.module"),
    "eagle3": ("core.drafters.eagle3.kind", "spectrain.kinds.eagle3.module"),
    "specblock": ("core.drafters.specblock.kind", "spectrain.kinds.specblock.module"),
    "dflash": ("core.drafters.dflash.kind", "spectrain.kinds.dflash.module"),
    "peagle": ("core.drafters.peagle.kind", "spectrain.kinds.peagle.module"),
    "hrad": ("core.drafters.hrad.kind", "spectrain.kinds.hrad.module"),
}
CAUSAL_LM_KIND = "draft_lm"  # what a drafter directory recording no kind is: a plain causal LM (HF directory)


@dataclass(frozen=True)
class EngineKind:
    """What export, import and the engine know of a drafter kind."""

    name: str  # the ``kind`` its exports record (config.json's spectrain block) and its recipes name
    title: str  # how messages name it, e.g. "P-EAGLE"
    needs: str  # what an algorithm of this kind needs, for messages: "a P-EAGLE export of ... for this target"
    config_class: type | None = None  # the drafter's config dataclass (None: a causal LM's own config)
    layouts: tuple[str, ...] = ("native",)  # the export layouts it writes (format=...)
    # (path, loaded target: .name, .tokenizer, .runner) -> the drafter an algorithm takes, on the target's device
    # and dtype; None: a causal LM, which the engine runs on a runner of its own
    load: Callable[[str, Any], Any] | None = None
    layout_of: Callable[[str | Path], str | None] | None = None  # a directory's layout if it holds this kind
    serves_as: str | None = None  # its drafter implements that kind's interface: that kind's algorithms serve it

    @property
    def interface(self) -> str:
        """The kind whose algorithms serve this one (an algorithm's ``drafter`` names it)."""
        return self.serves_as or self.name


_ENGINE_KINDS: dict[str, EngineKind] = {}


def register_engine_kind(kind: EngineKind) -> EngineKind:
    _ENGINE_KINDS[kind.name] = kind
    return kind


def engine_kind(name: str) -> EngineKind:
    """The engine half of kind ``name`` (its module imported on first use); an unknown kind is refused in one line."""
    if name not in _ENGINE_KINDS and name in KIND_MODULES:
        importlib.import_module(KIND_MODULES[name][0])
    if name not in _ENGINE_KINDS:
        raise UserError(f"unknown drafter kind '{name}'; known kinds: {', '.join(KIND_MODULES)}")
    return _ENGINE_KINDS[name]


def engine_kinds() -> dict[str, EngineKind]:
    """Every kind of the table, in its order (each module imported on first use)."""
    return {name: engine_kind(name) for name in KIND_MODULES}


def training_module(name: str) -> str:
    """The module that registers kind ``name``'s training half (spectrain imports it)."""
    if name not in KIND_MODULES:
        raise UserError(f"unknown drafter kind '{name}'; known kinds: {', '.join(KIND_MODULES)}")
    return KIND_MODULES[name][1]


def kind_of_directory(path: str | Path) -> tuple[str, str] | None:
    """(kind, layout) of the first kind of the table that recognises the directory ``path``; None if none does."""
    for kind in engine_kinds().values():
        layout = kind.layout_of(path) if kind.layout_of is not None else None
        if layout is not None:
            return kind.name, layout
    return None
