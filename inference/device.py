"""What the CPU offers: whether it computes bf16 natively (the serving and training defaults follow it), and a one-line
description of it for benchmark records."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 matmuls of a few rows cost what
    one row costs, and verification of a chain or tree is nearly free, as on a GPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_description() -> str:
    """Model name, family/model numbers, widest vector unit and core count, e.g. "AMD EPYC 7B13, family 25 model 1,
    avx2, 2 cores": what a benchmark figure needs beside it, since kernels differ by CPU generation."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    info = {}
    for line in lines:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    vector = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    cores = sum(line.startswith("processor") for line in lines)
    return (
        f"{info.get('model name', '?')}, family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
        f"{vector}{', native bf16' if cpu_has_native_bf16() else ''}, {cores} cores"
    )
