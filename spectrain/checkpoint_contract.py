"""What a training checkpoint holds for ``python -m spectrain.export ckpt=``: the drafter under ``drafter.`` and
a top-level ``"spectrain"`` entry (:func:`checkpoint_metadata`); and the dtype names an export may convert to."""

from __future__ import annotations

from typing import Any

import torch

from core.drafters.eagle3 import Eagle3Drafter

DRAFTER_PREFIX = "drafter."
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_metadata(
    drafter: Eagle3Drafter,
    target: dict[str, Any],
    *,
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a LightningModule stores as ``checkpoint["spectrain"]`` so ``ckpt=`` can be exported."""
    return {
        "kind": "eagle3",
        "config": drafter.config.to_dict(),
        "target": target,
        "recipe": recipe,
        "metrics": metrics or {},
    }
