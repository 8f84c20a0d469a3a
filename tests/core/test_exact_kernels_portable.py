"""The exact CPU kernels (core/kernels/exact_cpu.c) give the bits their C source defines, whatever the CPU: the
library built for this CPU (``-march=native``: its widest vectors, hardware fused multiply-adds, the hand-written
AVX2 paths) equals the same source built for the compiler's baseline target without optimisation (narrower vectors,
no vector FMA: libm's ``fmaf``, lane by lane), bit for bit. A tuning of a kernel that changed a result's order of operations fails here."""

from __future__ import annotations

import pytest
import torch

from core.kernels import exact_cpu
from core.kernels.exact_cpu import KeyLists


@pytest.fixture(scope="module")
def libraries():
    native = exact_cpu.library()
    # no -march=native, and -O0 (it builds in a third of a second, -O3 in nine): neither may change a result
    flags = tuple({"-O3": "-O0"}.get(flag, flag) for flag in exact_cpu.CFLAGS if flag != "-march=native")
    portable = exact_cpu.load(exact_cpu.build(flags))
    return native, portable


def both(libraries, monkeypatch, kernel, *args):
    """``kernel(*args)`` with the native library, then with the portable one."""
    results = []
    for lib in libraries:
        monkeypatch.setattr(exact_cpu, "_library", lib)
        results.append(kernel(*args))
    return results


def tree_keys(generator: torch.Generator, cached: int, nodes: int) -> KeyLists:
    """A tree of ``nodes`` new tokens after ``cached``, each over its ancestors' slots (gaps between them)."""
    allowed = torch.zeros(nodes, cached + nodes, dtype=torch.bool)
    allowed[:, :cached] = True
    for node in range(nodes):
        parent = int(torch.randint(-1, node, (1,), generator=generator)) if node else -1
        if parent >= 0:
            allowed[node] |= allowed[parent]
        allowed[node, cached + node] = True
    return KeyLists.from_mask(allowed)


@pytest.mark.parametrize("dim", [64, 38])  # SmolLM2's head size; one that is not a multiple of 4 or 16
def test_attention_equals_its_portable_build(libraries, monkeypatch, dim):
    generator = torch.Generator().manual_seed(dim)
    kv_heads, heads, slots = 2, 6, 224
    keys_t = torch.randn(kv_heads, dim, slots, generator=generator)
    values = torch.randn(kv_heads, slots, dim, generator=generator)
    for keys in (KeyLists.chain(130, 70), KeyLists.chain(40, 1), tree_keys(generator, 150, 23)):
        q = torch.randn(keys.tokens, heads, dim, generator=generator)
        native, portable = both(libraries, monkeypatch, exact_cpu.attention, q, keys_t, values, keys)
        assert torch.equal(native, portable)


def test_linear_norm_and_silu_equal_their_portable_build(libraries, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 197, generator=generator), torch.randn(200, generator=generator)
    packed = exact_cpu.transposed_weight(weight)  # 200 outputs: 13 tiles of 16, the last one partly padding
    for rows in (1, 2, 7, 64, 70):
        x = torch.randn(rows, 197, generator=generator)  # 197 inputs: two k blocks and a tail
        native, portable = both(libraries, monkeypatch, exact_cpu.linear, x, packed, 200, bias)
        assert torch.equal(native, portable), rows
    x = torch.randn(9, 100, generator=generator) * 4
    for dtype in (torch.float32, torch.bfloat16):
        cast = x.to(dtype)
        native, portable = both(libraries, monkeypatch, exact_cpu.rms_scale, cast, 1e-5)
        assert torch.equal(native, portable)
        native, portable = both(libraries, monkeypatch, exact_cpu.silu, cast)
        assert torch.equal(native, portable)
