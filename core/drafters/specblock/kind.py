"""SpecBlock's engine half: its row of the kind table (config, layouts, loader) and the loader itself."""

from __future__ import annotations

from typing import Any

from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.specblock import KIND, SpecBlockConfig, SpecBlockDrafter, build_drafter, read_native
from core.drafters.specblock.layouts import layout_of
from core.drafters.target_checks import check_native_target, export_needs


def load_specblock(path: str, target: Any) -> SpecBlockDrafter:
    """Load a SpecBlock native export onto ``target``'s device and dtype, sharing its token embedding. Refuses
    (one line) a drafter trained for another target, hidden size, vocabulary or layer count."""
    config, tensors, block = read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


SPECBLOCK = register_engine_kind(
    EngineKind(
        name=KIND,
        title="SpecBlock",
        needs=export_needs("a SpecBlock"),
        config_class=SpecBlockConfig,
        load=load_specblock,
        layout_of=layout_of,
    )
)
