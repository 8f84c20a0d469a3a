"""The row-exact CPU kernels (``exact_cpu.c``): attention over each token's own keys, RMSNorm's scale, SiLU, the
sigmoid and a mixture-of-experts router, computed so that a row's result depends on nothing but its own inputs (the
C file says how). Compiled once per machine with the system C compiler into ``$SPECTRAIN_CACHE/kernels`` and loaded
with ctypes: no torch headers, so the build takes about a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("exact_cpu.c")
# -ffp-contract=off and no -ffast-math: the compiler may vectorise but not reorder or fuse (see the C file).
# -fno-math-errno lets sqrtf vectorise; it changes no result.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
# Below this many multiply-adds an attention call stays on one thread: starting one costs about 20 µs.
THREAD_WORK = 4_000_000


class KernelUnavailable(RuntimeError):
    """The exact kernels could not be built or loaded on this machine."""


def _cache_dir() -> Path:
    root = Path(os.environ.get("SPECTRAIN_CACHE", Path.home() / ".cache" / "spectrain")).expanduser()
    return root / "kernels"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def build(flags: tuple[str, ...] = CFLAGS) -> Path:
    """The kernels compiled with ``flags`` into the kernel cache (once per source, flags, compiler and CPU)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler found for the exact CPU kernels; install gcc (apt-get install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # -march=native: the library is built for this CPU, so its flags are part of the key.
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags), version, _cpu_flags()]).encode())
    target = _cache_dir() / f"exact_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise KernelUnavailable(f"building the exact CPU kernels failed: {result.stderr.strip()[:300]}")
        os.replace(built, target)  # atomic: a concurrent build of the same source is harmless
    return target


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded kernels, built on first use (raises :class:`KernelUnavailable` with the reason)."""
    global _library
    if _library is not None:  # (every kernel call asks: no lock once built)
        return _library
    with _lock:
        if _library is None:
            _library = load(build())
        return _library


def load(path: Path) -> ctypes.CDLL:
    """The kernels built at ``path``, their signatures declared (:func:`library` is the one the engine uses)."""
    lib = ctypes.CDLL(str(path))
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.exact_rms_scale.argtypes = [ptr, i32, i64, i32, f32, ptr]
    lib.exact_silu.argtypes = [ptr, i32, i64, ptr]
    lib.exact_sigmoid.argtypes = [ptr, i32, i64, ptr]
    lib.exact_route.argtypes = [ptr, i32, i64, i32, i32, i32, ptr, ptr, ptr]
    lib.exact_linear_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i32]
    lib.exact_attention.argtypes = [
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i32,
        i32,
        i32,
        i32,
        ptr,
        ptr,
        ptr,
        f32,
        ptr,
        i32,
    ]
    lib.exact_attention_rows.argtypes = [
        i32,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i32,
        i32,
        i32,
        i32,
        ptr,
        ptr,
        ptr,
        f32,
        ptr,
        i32,
    ]
    for fn in (
        lib.exact_rms_scale,
        lib.exact_silu,
        lib.exact_attention,
        lib.exact_attention_rows,
        lib.exact_linear_f32,
        lib.exact_route,
        lib.exact_sigmoid,
    ):
        fn.restype = None
    return lib


def _check(x: torch.Tensor) -> int:
    """1 for bf16, 0 for fp32; anything else is refused."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the exact CPU kernels take bf16 or fp32 CPU tensors, got {x.dtype} on {x.device}")
    return int(x.dtype == torch.bfloat16)


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x.float() * rsqrt(mean(x²) + eps)`` over the last dimension, as fp32 (RMSNorm before its cast and weight)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().exact_rms_scale(x.data_ptr(), _check(x), x.numel() // x.shape[-1], x.shape[-1], eps, out.data_ptr())
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` as fp32."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().exact_silu(x.data_ptr(), _check(x), x.numel(), out.data_ptr())
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid of ``x`` as fp32."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().exact_sigmoid(x.data_ptr(), _check(x), x.numel(), out.data_ptr())
    return out


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse MoE MLP's routing of each row of ``logits`` [N, E] (bf16 or fp32): the softmax over the E experts in
    fp32, the ``top_k`` most probable in decreasing order (equal probabilities: the lower index first) and their
    probabilities, divided by their sum when ``normalize``; fp32 weights [N, k] and int64 experts [N, k]."""
    logits = logits.contiguous()
    rows, experts = logits.numel() // logits.shape[-1], logits.shape[-1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must lie in 1..{experts} (the experts), got {top_k}")
    weights = torch.empty(*logits.shape[:-1], top_k, dtype=torch.float32)
    chosen = torch.empty(*logits.shape[:-1], top_k, dtype=torch.int64)
    scratch = torch.empty(experts + 16, dtype=torch.float32)
    library().exact_route(
        logits.data_ptr(),
        _check(logits),
        rows,
        experts,
        top_k,
        int(normalize),
        weights.data_ptr(),
        chosen.data_ptr(),
        scratch.data_ptr(),
    )
    return weights, chosen


def transposed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as :func:`linear` takes it: transposed in tiles of 16 outputs, fp32 [ceil(N / 16), K, 16]
    (tile j holds outputs 16j..16j+15, each tile's rows contiguous over K), zeros past output N."""
    out_features, in_features = weight.shape
    weight = weight.detach()
    full, rest = divmod(out_features, 16)
    # One strided copy per tile (a padded copy, then a transposed one, read and wrote the weight three times)
    tiled = torch.empty(full + bool(rest), in_features, 16, dtype=torch.float32)
    tiled[:full] = weight[: full * 16].view(full, 16, in_features).transpose(1, 2)
    if rest:
        tiled[full] = 0.0
        tiled[full, :, :rest] = weight[full * 16 :].T
    return tiled


def linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """fp32 ``x @ W.T + bias`` whose rows are each fixed whatever else the call holds (each output one fused
    multiply-add per input feature, in order); ``weight_t`` from :func:`transposed_weight`."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or weight_t.dtype != torch.float32:
        raise ValueError(f"the exact linear takes fp32 CPU tensors, got {x.dtype} on {x.device}")
    # (a decode step calls this for every projection of every layer: each tensor op below costs a microsecond or
    # more, so the ones with nothing to do are skipped)
    in_features = x.shape[-1]
    fits = weight_t.dim() == 3 and weight_t.shape[1:] == (in_features, 16) and weight_t.shape[0] * 16 >= out_features
    if not fits or not weight_t.is_contiguous():
        raise ValueError(f"weight_t {tuple(weight_t.shape)} does not fit {in_features} inputs, {out_features} outputs")
    flat = x.reshape(-1, in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows, padded = flat.shape[0], weight_t.shape[0] * 16
    out = torch.empty(rows, padded, dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.detach().to(torch.float32).contiguous()
    if threads is None:
        threads = torch.get_num_threads() if rows * padded * in_features >= THREAD_WORK else 1
    library().exact_linear_f32(
        flat.data_ptr(),
        rows,
        in_features,
        weight_t.data_ptr(),
        out_features,
        padded,
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        threads,
    )
    shape = (*x.shape[:-1], out_features)
    return out.view(shape) if padded == out_features else out[:, :out_features].reshape(shape)


@dataclass(frozen=True)
class KeyLists:
    """Which cache slots each new token of a forward attends to, oldest first, for ``rows`` cache rows of the same
    number of new tokens: token i (row ``i // tokens``) sees slots ``0..prefix[i]-1`` of its row, then
    ``extra[offsets[i]:offsets[i+1]]`` (int32 CPU tensors). Built once per forward, used by every layer."""

    prefix: torch.Tensor
    offsets: torch.Tensor
    extra: torch.Tensor
    longest: int  # the most keys any token has
    rows: int = 1

    @property
    def tokens(self) -> int:
        """New tokens per row."""
        return self.prefix.shape[0] // self.rows

    @classmethod
    def chain(cls, cached: int, new: int) -> KeyLists:
        """Causal, one row: new token t sees the cache and new tokens 0..t."""
        prefix = torch.arange(cached + 1, cached + new + 1, dtype=torch.int32)
        return cls(prefix, torch.zeros(new + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), cached + new)

    @classmethod
    def chains(cls, cached: torch.Tensor, new: int) -> KeyLists:
        """Causal, one row per entry of ``cached`` (each row's cached tokens): what :meth:`chain` gives each row."""
        cached = cached.to(device="cpu", dtype=torch.int32)
        prefix = (cached[:, None] + torch.arange(1, new + 1, dtype=torch.int32)).reshape(-1)
        return cls(
            prefix,
            torch.zeros(prefix.shape[0] + 1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32),
            int(cached.max()) + new,
            cached.shape[0],
        )

    @classmethod
    def from_mask(cls, allowed: torch.Tensor) -> KeyLists:
        """From a bool mask over slots, [T, S] (one row) or [B, T, S]: each token's leading run of allowed slots,
        then the rest in order."""
        rows = allowed.shape[0] if allowed.dim() == 3 else 1
        allowed = allowed.cpu().reshape(-1, allowed.shape[-1])
        prefix = allowed.to(torch.int32).cumprod(-1).sum(-1, dtype=torch.int32)
        rest = allowed & (torch.arange(allowed.shape[-1]) >= prefix[:, None])
        counts = rest.sum(-1, dtype=torch.int32)
        offsets = torch.zeros(allowed.shape[0] + 1, dtype=torch.int32)
        offsets[1:] = counts.cumsum(0)
        longest = int((prefix + counts).max()) if allowed.shape[0] else 0
        return cls(prefix, offsets, rest.nonzero()[:, 1].to(torch.int32).contiguous(), longest, rows)


def attention(
    q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, keys: KeyLists, threads: int | None = None
) -> torch.Tensor:
    """Softmax attention of ``q`` [T, H, D] over one cache row, token t over the slots ``keys`` lists for it; fp32
    [T, H, D]. ``keys_t`` [KV, D, S] holds the row's keys transposed (slots contiguous, S a multiple of 16: scores
    are computed 16 slots at a time), ``values`` [KV, S', D] its values (features contiguous), both fp32."""
    tokens, heads, dim = q.shape
    kv_heads = keys_t.shape[0]
    if keys.tokens != tokens or heads % kv_heads or keys_t.shape[1] != dim or values.shape[-1] != dim:
        raise ValueError(
            f"attention shapes disagree: q {tuple(q.shape)}, keys {tuple(keys_t.shape)}, values "
            f"{tuple(values.shape)}, {keys.tokens} key lists"
        )
    if keys_t.dtype != torch.float32 or keys_t.stride(-1) != 1 or keys_t.stride(1) % 16 or keys_t.shape[-1] % 16:
        raise ValueError("keys_t must be fp32 [KV, D, S] with contiguous slots and S a multiple of 16")
    if values.dtype != torch.float32 or values.stride(-1) != 1 or values.stride(-2) != dim:
        raise ValueError("values must be fp32 [KV, S, D] with contiguous slot and feature dimensions")
    if keys.longest > min(keys_t.shape[-1], values.shape[1]):
        raise ValueError("a key list reaches past the cache")
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    if threads is None:
        threads = torch.get_num_threads() if tokens * heads * dim * keys.longest >= THREAD_WORK else 1
    library().exact_attention(
        q.data_ptr(),
        keys_t.data_ptr(),
        values.data_ptr(),
        keys_t.stride(0),
        keys_t.stride(1),
        values.stride(0),
        tokens,
        heads,
        kv_heads,
        dim,
        keys.prefix.data_ptr(),
        keys.offsets.data_ptr(),
        keys.extra.data_ptr(),
        dim**-0.5,
        out.data_ptr(),
        threads,
    )
    return out


def attention_rows(
    q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, keys: KeyLists, threads: int | None = None
) -> torch.Tensor:
    """:func:`attention` for B cache rows at once: ``q`` [B, T, H, D], ``keys_t`` [B, KV, D, S] and ``values``
    [B, KV, S', D] (the rows of a cache), ``keys`` for B rows of T tokens; fp32 [B, T, H, D]. Each row's result is
    the one :func:`attention` gives it alone (the same code runs per row, work split by row, kv head and tokens)."""
    batch, tokens, heads, dim = q.shape
    kv_heads = keys_t.shape[1]
    if (
        keys.rows != batch
        or keys.tokens != tokens
        or keys_t.shape[0] != batch
        or values.shape[0] != batch
        or heads % kv_heads
        or keys_t.shape[2] != dim
        or values.shape[-1] != dim
    ):
        raise ValueError(
            f"attention shapes disagree: q {tuple(q.shape)}, keys {tuple(keys_t.shape)}, values "
            f"{tuple(values.shape)}, {keys.rows} rows of {keys.tokens} key lists"
        )
    if keys_t.dtype != torch.float32 or keys_t.stride(-1) != 1 or keys_t.stride(2) % 16 or keys_t.shape[-1] % 16:
        raise ValueError("keys_t must be fp32 [B, KV, D, S] with contiguous slots and S a multiple of 16")
    if values.dtype != torch.float32 or values.stride(-1) != 1 or values.stride(-2) != dim:
        raise ValueError("values must be fp32 [B, KV, S, D] with contiguous slot and feature dimensions")
    if keys.longest > min(keys_t.shape[-1], values.shape[2]):
        raise ValueError("a key list reaches past the cache")
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    if threads is None:
        threads = torch.get_num_threads() if batch * tokens * heads * dim * keys.longest >= THREAD_WORK else 1
    library().exact_attention_rows(
        batch,
        q.data_ptr(),
        tokens * heads * dim,
        keys_t.data_ptr(),
        keys_t.stride(0),
        values.data_ptr(),
        values.stride(0),
        keys_t.stride(1),
        keys_t.stride(2),
        values.stride(1),
        tokens,
        heads,
        kv_heads,
        dim,
        keys.prefix.data_ptr(),
        keys.offsets.data_ptr(),
        keys.extra.data_ptr(),
        dim**-0.5,
        out.data_ptr(),
        threads,
    )
    return out
