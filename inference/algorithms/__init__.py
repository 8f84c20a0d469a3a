"""Decoding algorithms, one per file; each declares which drafter it needs (none, a draft LM, features)."""

from __future__ import annotations

import importlib

# name -> "module:Class"; imported lazily so one algorithm's imports never burden another's users.
ALGORITHMS: dict[str, str] = {
    "ar": "inference.algorithms.ar:Autoregressive",
    "sps": "inference.algorithms.sps:SpeculativeSampling",
    "eagle3_tree": "inference.algorithms.eagle3_tree:Eagle3Tree",
    "self_draft": "inference.algorithms.self_draft:SelfDraft",
}


def algorithm_class(name: str):
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm '{name}'; available: {', '.join(ALGORITHMS)}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_algorithm(name: str, target, draft=None, **options):
    """Instantiate an algorithm; one that needs a drafter (a draft LM, or a feature-conditioned drafter such as
    EAGLE-3) refuses to start without one."""
    cls = algorithm_class(name)
    if cls.drafter == "draft_lm":
        if draft is None:
            raise ValueError(f"algorithm '{name}' needs a draft LM: pass drafter=PATH (an exported draft LM or a "
                             "HF model directory sharing the target's tokenizer)")
        return cls(target, draft, **options)
    if cls.drafter == "features":
        if draft is None:
            raise ValueError(f"algorithm '{name}' needs a feature-conditioned drafter: pass drafter=PATH (an "
                             "EAGLE-3 export of python -m spectrain.export for this target)")
        return cls(target, draft, **options)
    return cls(target, **options)
