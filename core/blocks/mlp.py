"""The gated (SwiGLU-style) MLP of Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from core.blocks.linear import Linear
from core.kernels import exact_cpu


class MLP(nn.Module):
    # Set on a drafter's MLPs by its row-exact serving mode: SiLU from core.kernels.exact_cpu, whose value of an
    # element does not depend on where it sits in the tensor (torch's vectorised loop computes a tail apart).
    exact: bool = False

    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN  # transformers is heavy: imported when a model is built

        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact and not torch.is_grad_enabled():
            gate = self.gate_proj(x)
            return self.down_proj(exact_cpu.silu(gate).to(gate.dtype) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
