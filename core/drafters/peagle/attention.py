"""P-EAGLE's training attention: the depth-0 rows (EAGLE-3's rows, one per position) attend causally among
themselves; a chain row (anchor ``a``, depth ``d >= 1``) attends to the depth-0 rows ``<= a`` and to the rows of its own
chain with depth ``<= d`` (speculators 0.9.0 ``models/peagle/attention.py:create_peagle_mask_mod``, one document).

Training runs ``T`` depth-0 rows and ``N`` chain rows (COD-sampled, ``spectrain.kinds.peagle.losses``). The dense mask
[T + N, T + N] is mostly False: depth-0 rows never read chain rows, and a chain row reads at most ``K - 1`` chain
rows. torch 2.13 has no flex-attention backward on a CPU, and the CPU SDPA kernel skips nothing under an explicit
mask, so the two parts run apart: the depth-0 rows as one causal SDPA (no mask), the chain rows (sorted by anchor,
then depth) in chunks of ``chunk_rows``, each chunk in ONE softmax over the depth-0 prefix its last anchor can see
plus the chain rows that may share its chains, under a small mask. DFlash's anchor blocks are cut the same way
(:mod:`core.drafters.dflash.attention`). Same result as the dense mask (``tests/core/test_peagle.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Chain rows per chunk. Measured on the 2-core CPU (benchmarks/peagle_attention.py, SmolLM2's heads, T = 640, K = 6,
# forward + backward; BENCHMARKS.md): chunks of 64-256 rows run ~1.6x faster than the dense chain mask and equal
# within the noise; 16 pays per-call overhead. A chunk rereads at most the K - 2 rows of a chain cut by its start.
CHUNK_ROWS = 64


@dataclass
class ChainLayout:
    """The chain rows of a training batch: ``anchors`` [B, N] and ``depths`` [B, N] (>= 1), sorted per batch row by
    (anchor, depth); ``valid`` [B, N] False for padding (rows with fewer chains are padded at the FRONT with anchor 0).
    ``dense`` materialises the reference mask instead of chunking."""

    anchors: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    dense: bool = False
    chunk_rows: int = CHUNK_ROWS
    _masks: dict = field(default_factory=dict, repr=False)  # built once per forward

    @property
    def rows(self) -> int:
        return self.anchors.shape[1]

    def positions(self) -> torch.Tensor:
        """[B, N] the RoPE position of each chain row: its anchor + depth (the position whose token it drafts - 2)."""
        return self.anchors + self.depths

    def mask(self, context: int, start: int = 0, stop: int | None = None, lo: int = 0) -> torch.Tensor:
        """bool [B, q, context + (stop - lo)]: chain rows ``start:stop`` against the depth-0 rows ``< context`` and the
        chain rows ``lo:stop``."""
        stop = self.rows if stop is None else stop
        anchors, depths = self.anchors[:, start:stop, None], self.depths[:, start:stop, None]
        before = torch.arange(context, device=anchors.device) <= anchors
        keys_anchor, keys_depth = self.anchors[:, None, lo:stop], self.depths[:, None, lo:stop]
        same = (keys_anchor == anchors) & (keys_depth <= depths) & self.valid[:, None, lo:stop]
        return torch.cat([before, same], dim=-1)

    def chunks(self, context: int) -> list[tuple[int, int, int, int, torch.Tensor]]:
        """Per chunk: (first row, end row, depth-0 rows read, first chain key row, bool mask [B, 1, q, keys])."""
        if "chunks" not in self._masks:
            reach = int(self.depths.max()) - 1 if self.rows else 0  # earlier rows of a chain cut by the chunk start
            out = []
            for start in range(0, self.rows, self.chunk_rows):
                stop = min(start + self.chunk_rows, self.rows)
                seen = min(int(self.anchors[:, start:stop].max()) + 1, context)
                lo = max(0, start - reach)
                out.append((start, stop, seen, lo, self.mask(seen, start, stop, lo)[:, None]))
            self._masks["chunks"] = out
        return self._masks["chunks"]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q`` [B, heads, T + N, D], ``keys`` / ``values`` [B, kv_heads, T + N, D] (depth-0 rows first) -> the
        attention output [B, heads, T + N, D] under the P-EAGLE mask (an ``Eagle3Attention`` ``Attend``)."""
        context = q.shape[2] - self.rows
        if q.is_cuda and q.shape[1] != keys.shape[1]:  # CUDA's memory-efficient kernel takes masks but not GQA
            keys, values = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (keys, values))
        gqa = q.shape[1] != keys.shape[1]
        k0, v0 = keys[:, :, :context], values[:, :, :context]
        outputs = [F.scaled_dot_product_attention(q[:, :, :context], k0, v0, is_causal=True, enable_gqa=gqa)]
        if self.dense:
            if "dense" not in self._masks:
                self._masks["dense"] = self.mask(context)[:, None]
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, context:], keys, values, attn_mask=self._masks["dense"], enable_gqa=gqa
                )
            )
        else:
            for start, stop, seen, lo, mask in self.chunks(context):
                chunk_keys = torch.cat([k0[:, :, :seen], keys[:, :, context + lo : context + stop]], dim=2)
                chunk_values = torch.cat([v0[:, :, :seen], values[:, :, context + lo : context + stop]], dim=2)
                outputs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, context + start : context + stop],
                        chunk_keys,
                        chunk_values,
                        attn_mask=mask,
                        enable_gqa=gqa,
                    )
                )
        return torch.cat(outputs, dim=2)
