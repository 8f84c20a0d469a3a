"""What the CPU offers: whether it computes bf16 natively (the serving and training defaults follow it)."""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 matmuls of a few rows cost what
    one row costs, and verification of a chain or tree is nearly free, as on a GPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
