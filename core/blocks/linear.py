"""The CPU-tuned ``Linear``: ``nn.Linear``'s parameters, faster for the few rows of a speculative step."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.kernels import exact_cpu


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) tuned for CPU inference.

    bf16 on a CPU runs oneDNN's linear over a weight packed once into its blocked layout: about twice as fast as
    ``F.linear`` for the few rows of a decode or verification step, and its row results do not depend on how many
    rows share the call (what exact mode relies on, and probes). fp32 runs 2 or 3 rows as 4 on a CPU: MKL's fp32
    GEMM is slower for 2-3 rows than for 4 (``benchmarks/linear_rows.py``), and speculative steps are full of such
    shapes (short verifications, 2-3 branches). Row results do not depend on the zero rows added.

    ``exact`` (set by the engine's exact mode): fp32 on a CPU runs ``core.kernels.exact_cpu.linear``, whose rows do
    not depend on how many rows share the call (MKL's fp32 GEMM keeps a row's bits only inside full 4-row tiles).
    A CPU whose oneDNN has no bf16 linear (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only Zen 3, say) runs
    bf16 through ``F.linear``, and in exact mode through the same fp32 kernel on the bf16 values, rounded back to
    bf16: row-exact by construction there too."""

    exact: bool = False

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # a shell on the meta device, filled from a state dict: nothing to draw
            return
        super().reset_parameters()

    def forward(self, x: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
        """``out_features`` computes only the first that many outputs (a vocabulary-limited lm_head)."""
        weight, bias = self.weight, self.bias
        if out_features is not None:
            weight, bias = weight[:out_features], None if bias is None else bias[:out_features]
        # (not where autograd needs this op: the packed linear has no backward; drafters train through here)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        cpu_bf16 = x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and not needs_grad
        if cpu_bf16 and ONEDNN_BF16:
            return torch.ops.mkldnn._linear_pointwise(
                x, self._packed(weight, out_features, _onednn_packed), bias, "none", [], ""
            )
        if self.exact and cpu_bf16:
            return exact_cpu.linear(
                x.float(),
                self._packed(weight, out_features, exact_cpu.transposed_weight),
                weight.shape[0],
                None if bias is None else bias.float(),
            ).to(x.dtype)
        if self.exact and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not needs_grad:
            return exact_cpu.linear(
                x, self._packed(weight, out_features, exact_cpu.transposed_weight), weight.shape[0], bias
            )
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        pad = -rows % 4 if rows in (2, 3) else 0
        if not pad or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], -1)

    def _packed(
        self, weight: torch.Tensor, out_features: int | None, pack: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``pack(weight)``, made on first use and again whenever the weight changes."""
        packs = self.__dict__.setdefault("_packs", {})  # not a buffer: state_dict and .to() stay as nn.Linear's
        stamp = (weight.data_ptr(), self.weight._version)
        if out_features not in packs or packs[out_features][0] != stamp:
            packs[out_features] = (stamp, pack(weight))
        return packs[out_features][1]


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a bf16 weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def _onednn_has_bf16() -> bool:
    """Whether oneDNN's packed bf16 linear runs on this CPU (it refuses hosts without AVX512-BW/VL/DQ or
    AVX-NE-CONVERT with a RuntimeError at the first call)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


ONEDNN_BF16 = _onednn_has_bf16()
