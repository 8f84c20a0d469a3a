"""EAGLE-3's engine half: its row of the kind table (config, layouts, loader) and the loader itself."""

from __future__ import annotations

from typing import Any

from core import assets
from core.assets import target_record
from core.drafters.checkpoint_files import check_against_target, same_target
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.eagle3.layouts import LAYOUTS, layout_of, read_checkpoint
from core.drafters.kinds import EngineKind, register_engine_kind
from core.drafters.target_checks import export_needs
from core.errors import UserError


def load_eagle3(path: str, target: Any) -> Eagle3Drafter:
    """Load an EAGLE-3 export (any layout with a spectrain block) onto ``target``'s device and dtype, sharing its
    token embedding. Refuses (one line) a drafter trained for another target, hidden size or vocabulary."""
    ckpt = read_checkpoint(path)
    if ckpt.target is None:
        raise UserError(
            f"drafter '{path}' does not record its target; import it first: python -m spectrain.export "
            f"import={path} target={target.name} out=DIR"
        )
    record = target_record(target.name)
    if not same_target(ckpt.target, record):
        raise UserError(
            f"drafter '{path}' was trained for target '{ckpt.target.get('name')}' (config "
            f"{ckpt.target.get('config_hash')}, weights {ckpt.target.get('weights_hash')}), not "
            f"'{target.name}' (config {record['config_hash']}, weights {record['weights_hash']}): use a "
            "drafter trained for this target"
        )
    check_against_target(ckpt.config, record)
    assets.check_chat_template(f"drafter '{path}'", ckpt.target, target.tokenizer)
    runner = target.runner
    drafter = ckpt.build(embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


EAGLE3 = register_engine_kind(
    EngineKind(
        name="eagle3",
        title="EAGLE-3",
        needs=export_needs("an EAGLE-3"),
        config_class=Eagle3Config,
        layouts=LAYOUTS,
        load=load_eagle3,
        layout_of=layout_of,
    )
)
