"""H-RAD's engine half: its row of the kind table. SpecBranch reads it through ``hrad=PATH`` (or ``drafters=DIR``)."""

from __future__ import annotations

from typing import Any

from core.drafters.hrad import KIND, HRADConfig, HRADPredictor, load_hrad
from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.target_checks import export_needs


def load_predictor(path: str, target: Any) -> HRADPredictor:
    """The H-RAD predictor of an export, on ``target``'s device; one trained for another target is refused."""
    return load_hrad(path, target)


HRAD_KIND = register_engine_kind(
    EngineKind(name=KIND, title="H-RAD", needs=export_needs("an H-RAD"), config_class=HRADConfig, load=load_predictor)
)
