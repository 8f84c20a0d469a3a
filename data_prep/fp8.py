"""FP8 (e4m3) storage of hidden states: one byte a value, plus a power-of-two scale per token and per layer block.

``quantize(x, blocks)`` cuts each row of ``x [T, W]`` into ``blocks`` equal blocks (one per captured layer: their
magnitudes differ by orders across depth) and stores ``x / s`` as ``float8_e4m3fn`` with ``s`` the smallest power of
two that brings the block's largest magnitude to at most 448 (e4m3's largest finite value). A power of two makes
the division exact, so the only rounding is e4m3's own (4 significant bits: at most 2^-4 relative error on values
above 1/14,336 of the block's largest magnitude, at most 2^-10 · s absolute below), and makes ``dequantize`` exact
in bf16, fp32 or any wider dtype: an e4m3 value times a power of two needs 4 significant bits. Measured errors on SmolLM2's
features are in docs/architecture.md §5.1.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # = 0.875 · 2^9, the largest finite e4m3fn value
MIN_EXPONENT = -126  # scales stay normal float32 numbers (an all-zero block gets 2^-9, any scale would do)


def block_scales(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """``[T, blocks]`` float32 powers of two: per block, the smallest ``2^k`` with ``max|x| / 2^k <= 448``."""
    rows, width = x.shape
    if width % blocks:
        raise ValueError(f"a row of {width} values does not split into {blocks} equal blocks")
    peak = x.detach().float().abs().reshape(rows, blocks, width // blocks).amax(-1)
    # peak = m · 2^e with m in [0.5, 1): peak / 2^(e-9) = m · 512 <= 448 iff m <= 0.875, else one exponent more.
    mantissa, exponent = torch.frexp(peak)
    exponent = (exponent - 9 + (mantissa > 0.875).int()).clamp(min=MIN_EXPONENT)
    return torch.ldexp(torch.ones_like(peak), exponent)


def quantize(x: torch.Tensor, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [T, W] float8_e4m3fn, scales [T, blocks] float32)`` of ``x [T, W]`` (any float dtype)."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes [T, W] rows, got shape {tuple(x.shape)}")
    scales = block_scales(x, blocks)
    rows, width = x.shape
    scaled = x.detach().float().reshape(rows, blocks, width // blocks) / scales[..., None]  # exact: powers of two
    return scaled.to(FP8).view(rows, width), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``codes · scales`` per block, in ``dtype`` (exact for bf16 and wider)."""
    rows, width = codes.shape
    blocks = scales.shape[-1]
    values = codes.float().reshape(rows, blocks, width // blocks) * scales.float()[..., None]
    return values.view(rows, width).to(dtype)
