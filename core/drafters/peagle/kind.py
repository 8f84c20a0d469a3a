"""P-EAGLE's engine half: its row of the kind table (config, layouts, loader) and the loader itself."""

from __future__ import annotations

from typing import Any

from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.peagle import KIND, PEagleConfig, PEagleDrafter
from core.drafters.peagle.layouts import LAYOUTS, build_drafter, layout_of, read_native
from core.drafters.target_checks import check_native_target, export_needs


def load_peagle(path: str, target: Any) -> PEagleDrafter:
    """Load a P-EAGLE export of ours (either layout) onto ``target``'s device and dtype, sharing its token embedding
    unless the drafter owns one. Refuses (one line) a drafter trained for another target, hidden size, vocabulary or
    layer count."""
    config, tensors, block = read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


PEAGLE = register_engine_kind(
    EngineKind(
        name=KIND,
        title="P-EAGLE",
        needs=export_needs("a P-EAGLE"),
        config_class=PEagleConfig,
        layouts=LAYOUTS,
        load=load_peagle,
        layout_of=layout_of,
    )
)
