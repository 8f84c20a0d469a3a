"""The gated (SwiGLU-style) MLP of Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from core.blocks.linear import Linear


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN  # transformers is heavy: imported when a model is built

        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
