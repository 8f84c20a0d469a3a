"""Decoding algorithms, one per file; each declares the drafter kind it is written for (``drafter``: none, or a
kind of ``core.drafters.kinds``; a kind that serves as that one runs with it too)."""

from __future__ import annotations

import importlib

from core.drafters.kinds import engine_kind
from core.errors import UserError

# name -> "module:Class"; imported lazily so one algorithm's imports never burden another's users.
ALGORITHMS: dict[str, str] = {
    "ar": "inference.algorithms.ar:Autoregressive",
    "sps": "inference.algorithms.sps:SpeculativeSampling",
    "eagle3_tree": "inference.algorithms.eagle3_tree:Eagle3Tree",
    "self_draft": "inference.algorithms.self_draft:SelfDraft",
    "pearl": "inference.algorithms.pearl:Pearl",
    "specbranch": "inference.algorithms.specbranch:SpecBranch",
    "specblock_tree": "inference.algorithms.specblock_tree:SpecBlockTree",
    "ssd": "inference.algorithms.ssd:SSD",
    "dflash": "inference.algorithms.dflash:DFlash",
    "peagle": "inference.algorithms.peagle:PEagle",
}


def algorithm_class(name: str):
    if name not in ALGORITHMS:
        raise UserError(f"unknown algorithm '{name}'; available: {', '.join(ALGORITHMS)}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def serving_algorithms(kind: str) -> list[str]:
    """The algorithms that serve drafters of ``kind``: those written for it, or for the kind it serves as."""
    interface = engine_kind(kind).interface
    return [name for name in ALGORITHMS if algorithm_class(name).drafter == interface]


def build_algorithm(name: str, target, draft=None, options=None, **keywords):
    """Instantiate an algorithm with its options dataclass (None: the defaults) and keywords (fields of it, or what
    the engine hands it: ``context``); one that needs a drafter refuses to start without one."""
    cls = algorithm_class(name)
    if cls.drafter == "none":
        return cls(target, options, **keywords)
    if draft is None:
        raise UserError(
            f"algorithm '{name}' needs {engine_kind(cls.drafter).needs}: pass drafter=PATH or "
            "drafters=DIR (a directory of exports)"
        )
    return cls(target, draft, options, **keywords)
