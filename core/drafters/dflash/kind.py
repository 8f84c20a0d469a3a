"""DFlash's engine half: its row of the kind table (config, layouts, loader) and the loader itself."""

from __future__ import annotations

from typing import Any

from core.drafters.dflash import KIND, DFlashConfig, DFlashDrafter
from core.drafters.dflash.layouts import LAYOUTS, build_drafter, layout_of, read_native
from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.target_checks import check_native_target, export_needs


def load_dflash(path: str, target: Any) -> DFlashDrafter:
    """Load a DFlash native export onto ``target``'s device and dtype, sharing its token embedding and head. Refuses
    (one line) a drafter trained for another target, hidden size, vocabulary or layer count."""
    config, tensors, block = read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight, head_weight=runner.lm_head.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


DFLASH = register_engine_kind(
    EngineKind(
        name=KIND,
        title="DFlash",
        needs=export_needs("a DFlash"),
        config_class=DFlashConfig,
        layouts=LAYOUTS,
        load=load_dflash,
        layout_of=layout_of,
    )
)
