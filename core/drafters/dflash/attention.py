"""DFlash's anchor-block attention: block ``j`` (anchor position ``p_j``) sees the context positions ``< p_j`` and
all of its own slots, nothing else (speculators' ``create_anchor_block_mask_mod``, without documents).

Serving runs one block against the whole context, so it needs no mask. Training runs ``A`` blocks per sequence
(queries ``A·K``, keys ``T`` context + ``A·K`` block entries): the dense mask [A·K, T + A·K] is mostly False (other
blocks' entries, and the context after each anchor). On a GPU the library builds it as a flex-attention block mask;
torch 2.13 has no flex-attention backward on a CPU ("FlexAttention does not support backward on CPU"), and the CPU
SDPA kernel skips nothing under an explicit mask. So training cuts the (sorted) anchors into chunks of
``chunk_anchors``: a chunk attends, in ONE softmax, to the context prefix its last anchor can see plus its own
blocks' entries, under a small mask; other chunks' blocks and the context past the chunk are never touched. Same
result as the dense mask (``tests/core/test_dflash.py``); the work it saves is measured in ``benchmarks/dflash_attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Anchors per chunk. Measured on the 2-core CPU (benchmarks/dflash_attention.py, SmolLM2's heads, forward +
# backward): chunks of 4-16 anchors run about twice as fast as the dense mask at T = 640 / 32 anchors of 8 and at
# T = 2048 / 128 anchors; 8 is within noise of the best at both. Smaller chunks pay per-call overhead, larger
# ones read more of the context past each anchor.
CHUNK_ANCHORS = 8


@dataclass
class AnchorLayout:
    """Which keys each training block sees: ``anchors`` [B, A] (positions, sorted per row for a sparse plan) and
    ``block_size``; ``dense`` materialises the reference mask instead of chunking."""

    anchors: torch.Tensor
    block_size: int
    dense: bool = False
    chunk_anchors: int = CHUNK_ANCHORS
    _masks: dict = field(default_factory=dict, repr=False)  # built once per forward, shared by every layer

    def dense_mask(self, context: int) -> torch.Tensor:
        """bool [B, 1, A·K, context + A·K], True = attend: the library's mask."""
        if "dense" not in self._masks:
            self._masks["dense"] = self._mask(self.anchors, context)[:, None]
        return self._masks["dense"]

    def chunks(self, context: int) -> list[tuple[slice, int, torch.Tensor]]:
        """Per chunk: (its query / block-key slice, context keys it reads, bool mask [B, 1, queries, keys])."""
        if "chunks" not in self._masks:
            chunks, k = [], self.block_size
            for start in range(0, self.anchors.shape[1], self.chunk_anchors):
                anchors = self.anchors[:, start : start + self.chunk_anchors]
                seen = min(int(anchors.max()), context)
                rows = slice(start * k, (start + anchors.shape[1]) * k)
                chunks.append((rows, seen, self._mask(anchors, seen)[:, None]))
            self._masks["chunks"] = chunks
        return self._masks["chunks"]

    def _mask(self, anchors: torch.Tensor, context: int) -> torch.Tensor:
        """bool [B, a·K, context + a·K] for ``anchors`` [B, a]: context keys before the row's anchor, then its own
        block."""
        k, count = self.block_size, anchors.shape[1]
        anchor_of_row = anchors.repeat_interleave(k, dim=1)  # [B, a·K]
        before = torch.arange(context, device=anchors.device) < anchor_of_row[..., None]
        block = torch.arange(count, device=anchors.device).repeat_interleave(k)
        same = (block[:, None] == block[None, :]).expand(anchors.shape[0], -1, -1)
        return torch.cat([before, same], dim=-1)


@dataclass
class ContextLengths:
    """Serving B blocks, one per cache row, over ragged contexts: row b's block sees the first ``lengths[b]``
    context slots and all of its own slots. ``per_row``: one SDPA per row over exactly those keys (the call the row
    gets alone: row-exact serving); else one padded SDPA under a key-padding mask."""

    lengths: torch.Tensor
    per_row: bool = False

    def key_mask(self, context: int, block: int) -> torch.Tensor:
        """bool [B, 1, 1, context + block]: the held context slots, then the block."""
        held = torch.arange(context, device=self.lengths.device) < self.lengths[:, None]
        return torch.cat([held, held.new_ones(held.shape[0], block)], dim=-1)[:, None, None]


def anchor_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    layout: AnchorLayout | ContextLengths | None,
) -> torch.Tensor:
    """``q`` [B, heads, Q, D] of the block rows, their ``k``, ``v`` [B, kv_heads, Q, D], the context's
    ``context_k`` / ``context_v`` [B, kv_heads, T, D] -> [B, heads, Q, D]. ``layout`` None: every row sees the
    whole context and all rows (one block); :class:`ContextLengths`: one block per row over its own context."""
    heads = q.shape[1]
    if q.is_cuda and heads != k.shape[1]:  # CUDA's memory-efficient kernel takes masks but not GQA
        k, v, context_k, context_v = (
            t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v, context_k, context_v)
        )
    gqa = heads != k.shape[1]
    if isinstance(layout, ContextLengths):
        return _ragged_blocks(q, k, v, context_k, context_v, layout, gqa)
    if layout is None:
        return F.scaled_dot_product_attention(
            q, torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2), enable_gqa=gqa
        )
    context = context_k.shape[2]
    if layout.dense:
        return F.scaled_dot_product_attention(
            q,
            torch.cat([context_k, k], dim=2),
            torch.cat([context_v, v], dim=2),
            attn_mask=layout.dense_mask(context),
            enable_gqa=gqa,
        )
    outputs = []
    for rows, seen, mask in layout.chunks(context):
        keys = torch.cat([context_k[:, :, :seen], k[:, :, rows]], dim=2)
        values = torch.cat([context_v[:, :, :seen], v[:, :, rows]], dim=2)
        outputs.append(F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask, enable_gqa=gqa))
    return torch.cat(outputs, dim=2)


def _ragged_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    layout: ContextLengths,
    gqa: bool,
) -> torch.Tensor:
    """One block per row, row b over its first ``layout.lengths[b]`` context slots and its own block."""
    if not layout.per_row:
        mask = layout.key_mask(context_k.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(
            q, torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2), attn_mask=mask, enable_gqa=gqa
        )
    rows = []
    for b, held in enumerate(layout.lengths.tolist()):
        row_keys = torch.cat([context_k[b : b + 1, :, :held], k[b : b + 1]], dim=2)
        row_values = torch.cat([context_v[b : b + 1, :, :held], v[b : b + 1]], dim=2)
        rows.append(F.scaled_dot_product_attention(q[b : b + 1], row_keys, row_values, enable_gqa=gqa))
    return torch.cat(rows)
