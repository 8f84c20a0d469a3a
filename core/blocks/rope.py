"""Rotary position embeddings: frequencies from a transformers config, cos/sin at positions, rotation."""

from __future__ import annotations

import torch

# Rope types whose inv_freq does not depend on the sequence length (dynamic / longrope rescale on the fly).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the cos/sin scale, computed as transformers does for this config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported by ModelRunner (supported: {STATIC_ROPE_TYPES})")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    else:  # transformers is heavy: imported only for a scaled RoPE
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported by ModelRunner (head_dim={head_dim})")
    return inv_freq.float(), float(scale)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] at ``positions`` [B, T] (computed in fp32, scaled, then cast to ``dtype``)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, heads, T, D] rotated by the angles whose cos/sin are given."""
    return x * cos + rotate_half(x) * sin
