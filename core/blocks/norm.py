"""RMSNorm as transformers computes it (fp32 statistics, cast back before the weight)."""

from __future__ import annotations

import torch
from torch import nn

from core.kernels import exact_cpu


class RMSNorm(nn.Module):
    exact: bool = False  # set on a drafter's norms by its row-exact serving mode (the target passes ``exact``)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``exact`` (or the module's ``exact`` outside autograd): the fp32 scale from ``core.kernels.exact_cpu`` (a
        row's result fixed whatever the call's shape; the engine's exact mode), else torch's ops."""
        # Normalise in fp32 and cast back before the weight, exactly as transformers does.
        input_dtype = x.dtype
        if exact or (self.exact and not torch.is_grad_enabled()):
            return self.weight * exact_cpu.rms_scale(x, self.eps).to(input_dtype)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
