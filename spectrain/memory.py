"""A per-device memory estimate for a recipe's strategy, printed by ``dry_run=true`` (an estimate, not a measurement).

Counted: the drafter's model states and, when features are computed online, the target's weights on every device.
Per trainable parameter, AdamW in fp32 keeps 16 bytes (weight, gradient, two moments; bf16 autocast computes in bf16
from the same fp32 weights); a frozen parameter keeps its weight only (4 bytes fp32, 2 in bf16-true). How the states
are split over the W data-parallel devices:

    ddp                 everything replicated
    fsdp                trainable states / W (frozen weights replicated: spectrain.strategies)
    deepspeed_stage_2   weights replicated, gradients and optimizer moments / W
    deepspeed_stage_3   everything / W

Activations, the CUDA context and allocator slack come on top (not estimated: they depend on batch x max_len and
the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


@dataclass
class MemoryEstimate:
    devices: int
    drafter_gib: float  # drafter weights + gradients + optimizer states on one device
    target_gib: float  # the target's weights on one device (online features), 0 offline

    @property
    def total_gib(self) -> float:
        return self.drafter_gib + self.target_gib

    def line(self, strategy: str) -> str:
        return (
            f"estimated memory per device ({strategy}, {self.devices} device(s)): {self.total_gib:.2f} GiB = "
            f"drafter states {self.drafter_gib:.2f} + target weights {self.target_gib:.2f}, plus activations "
            "(not estimated)"
        )


def parameter_counts(module: Any) -> tuple[int, int]:
    """(trainable, frozen) parameter counts; works on meta tensors (dry runs)."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in module.parameters()) - trainable


def estimate(
    trainable: int, frozen: int, target_params: int, *, strategy: str, devices: int, precision: str
) -> MemoryEstimate:
    """See the module docstring; ``target_params`` = 0 when features are read from disk."""
    w = max(devices, 1)
    frozen_bytes = 2 if precision in ("bf16-true", "16-true") else 4
    weights, states = 4 * trainable, 12 * trainable  # fp32 weight | gradient + two AdamW moments
    if strategy == "fsdp" or strategy == "deepspeed_stage_3":
        drafter = (weights + states) / w
    elif strategy == "deepspeed_stage_2":
        drafter = weights + states / w
    else:
        drafter = weights + states
    drafter += frozen * (frozen_bytes / w if strategy == "deepspeed_stage_3" else frozen_bytes)
    target = 2 * target_params if precision.startswith(("bf16", "16")) or precision == "auto" else 4 * target_params
    return MemoryEstimate(devices, drafter / GIB, target / GIB)
