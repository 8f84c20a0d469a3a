"""Exact mode: the dtypes it runs in here, an exact-mode runner, and a host whose GEMM rounds differently."""

from __future__ import annotations

import pytest
import torch

from core.blocks.linear import Linear
from inference.device import cpu_has_native_bf16
from inference.runner import ModelRunner

native_bf16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16/AMX)")


DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=native_bf16)]


def exact_runner(model, dtype=torch.bfloat16, **kw) -> ModelRunner:
    return ModelRunner.from_hf_model(model, dtype=dtype, max_seq_len=kw.pop("max_seq_len", 640), **kw)


def rounds_differently_past(rows_limit: int):
    """Linear.forward as on a host whose GEMM rounds a call of more than ``rows_limit`` rows differently: the
    last bit of each output of such a call is flipped."""
    original = Linear.forward

    def forward(self, x, out_features=None):
        out = original(self, x, out_features)
        if x.numel() // x.shape[-1] > rows_limit:
            bits = out.view(torch.int16) if out.dtype == torch.bfloat16 else out.view(torch.int32)
            out = (bits ^ 1).view(out.dtype)
        return out

    return forward
