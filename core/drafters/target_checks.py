"""The checks every native export passes before it runs with a target: it records that target, fits its vocabulary,
hidden size and layers, and was trained under its chat template (one line each, naming the fix)."""

from __future__ import annotations

from typing import Any

from core import assets
from core.assets import target_record
from core.drafters.checkpoint_files import same_target
from core.errors import UserError


def check_native_target(path: str, config: Any, recorded: dict[str, Any] | None, target: Any) -> None:
    """Refuse (one line) a native export that records no target, another target, another vocabulary or hidden
    size, aux layers the target lacks, or another chat template. ``target``: a loaded target (``.name``,
    ``.tokenizer``, ``.runner``)."""
    if recorded is None:
        raise UserError(f"drafter '{path}' does not record its target; re-export it with its target record")
    record = target_record(target.name)
    if not same_target(recorded, record):
        raise UserError(
            f"drafter '{path}' was trained for target '{recorded.get('name')}' (config "
            f"{recorded.get('config_hash')}, weights {recorded.get('weights_hash')}), not "
            f"'{target.name}' (config {record['config_hash']}, weights {record['weights_hash']}): use a "
            "drafter trained for this target"
        )
    if (config.vocab_size, config.target_hidden_size) != (
        target.runner.config.vocab_size,
        target.runner.config.hidden_size,
    ):
        raise UserError(
            f"drafter '{path}' expects vocab {config.vocab_size} / hidden {config.target_hidden_size} "
            f"but target '{target.name}' has {target.runner.config.vocab_size} / "
            f"{target.runner.config.hidden_size}: it was trained for another target"
        )
    if max(config.aux_layer_ids) >= record["num_hidden_layers"]:
        raise UserError(
            f"drafter '{path}' reads aux layers {config.aux_layer_ids} that target '{target.name}' "
            f"({record['num_hidden_layers']} layers) does not have"
        )
    assets.check_chat_template(f"drafter '{path}'", recorded, target.tokenizer)


def export_needs(a_title: str) -> str:
    """What an algorithm of a kind needs, for messages; ``a_title``: the kind's title with its article ("a DFlash")."""
    return f"{a_title} export of python -m spectrain.export for this target"
