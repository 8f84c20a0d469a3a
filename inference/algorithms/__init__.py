"""Decoding algorithms, one per file; each declares which drafter it needs (none, a draft LM, features)."""

from __future__ import annotations

import importlib

from core.errors import UserError
from inference.drafters import DRAFTER_KINDS

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


def build_algorithm(name: str, target, draft=None, options=None, **keywords):
    """Instantiate an algorithm with its options dataclass (None: the defaults) and keywords (fields of it, or what
    the engine hands it: ``context``); one that needs a drafter (a draft LM, an EAGLE-3, SpecBlock, DFlash or P-EAGLE
    drafter) refuses to start without one."""
    cls = algorithm_class(name)
    if cls.drafter == "none":
        return cls(target, options, **keywords)
    if draft is None:
        raise UserError(f"algorithm '{name}' needs {DRAFTER_KINDS[cls.drafter][1]}: pass drafter=PATH or "
                         "drafters=DIR (a directory of exports)")
    return cls(target, draft, options, **keywords)
