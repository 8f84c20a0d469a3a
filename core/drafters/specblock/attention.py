"""Block-sparse training attention of the SpecBlock drafter: the result of the dense boolean masks of
:func:`core.drafters.specblock.first_block_mask` / :func:`~core.drafters.specblock.later_block_mask`, without
computing the entries they mask (at 300 anchors a later block's mask keeps 12–17 % of them).

Entries are flattened as ``anchor·K + slot``.

* First block: its mask is exactly the causal mask over entries, so it is ``is_causal`` SDPA (the kernels skip
  the upper triangle).
* Later block: a query ``(i, k)`` sees two kinds of keys:
  - the "earlier" groups: the first block's entries (and its own block's, with the release quirk) of anchors
    ``j < i``;
  - anchor ``i``'s "local" keys: slots ``< valid`` of each previous block, and its own slots ``<= k``.

  Queries are cut into chunks of ``chunk_anchors`` anchors. A chunk attends, in ONE softmax, to the prefix of
  the earlier groups that its last anchor can see plus its anchors' local keys, under a small mask; keys after
  the chunk and other anchors' local keys are never touched. This leaves ~half the first block's area per
  later block instead of all of every group.

Flex attention would express this directly, but torch 2.13 has no flex attention backward on a CPU, and the
CPU SDPA kernel skips nothing under an explicit mask (only under ``is_causal``), hence the chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_KINDS = ("block_sparse", "dense")
# Smaller chunks waste fewer keys on their own staircase and local keys, larger ones pay less per call: of 8 / 16 /
# 32 / 64, 16 and 32 were the fastest for a later block at 300 anchors (benchmarks.specblock_attention, this CPU).
CHUNK_ANCHORS = 16
# On CUDA (unmeasured: no GPU here) larger chunks: fewer launches, and fewer copies of the earlier prefix kept
# for the backward (their total grows as anchors² / chunk).
CHUNK_ANCHORS_CUDA = 64


@dataclass(frozen=True)
class BlockLayout:
    """Which keys one training block's queries see (docs/algorithms/specblock.md §4), as structure, not a mask.

    ``first_block``: the keys start with the first block's entries (seen for anchors ``j < i``); ``ttt_valid``:
    one group per previous block (same anchor, slots ``< valid``); ``own_sees_earlier``: the block's own
    entries of anchors ``j < i`` are seen too (a first block; later blocks with the release quirk)."""

    anchors: int
    block_size: int
    first_block: bool = False
    ttt_valid: tuple[int, ...] = ()
    own_sees_earlier: bool = True
    chunk_anchors: int = CHUNK_ANCHORS

    @property
    def causal(self) -> bool:
        """True when the mask is exactly causal over entries (a first block)."""
        return not self.first_block and not self.ttt_valid and self.own_sees_earlier

    @property
    def earlier_groups(self) -> int:
        """How many groups are seen for anchors ``j < i``: the first block, and the own block when it is."""
        return int(self.first_block) + int(self.own_sees_earlier)


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one layout: ``index`` gathers every chunk's keys, one after another, from the groups
    concatenated as [earlier groups] + [local groups] (each A·K entries); ``key_counts`` splits them per chunk;
    ``masks[c]`` is chunk c's bool mask [its queries, its keys]."""

    index: torch.Tensor
    key_counts: list[int]
    query_counts: list[int]
    masks: list[torch.Tensor]


@functools.lru_cache(maxsize=64)
def chunk_plan(layout: BlockLayout, device: torch.device) -> ChunkPlan:
    """The :class:`ChunkPlan` of a later-block ``layout`` (cached: every layer and step of a length reuses it).
    A chunk of anchors ``start .. end - 1`` gets each earlier group's entries of anchors ``< end - 1``, then per
    anchor its local keys: each previous block's slots ``< valid``, then its own K slots."""
    k, entries = layout.block_size, layout.anchors * layout.block_size
    n_earlier = layout.earlier_groups
    valid = list(layout.ttt_valid) + [k]
    # one anchor's local keys, relative to its entry a·K in the concatenated groups
    pattern = torch.cat([(n_earlier + g) * entries + torch.arange(m) for g, m in enumerate(valid)])
    seen = sum(layout.ttt_valid)
    index, key_counts, query_counts, masks = [], [], [], []
    for start in range(0, layout.anchors, layout.chunk_anchors):
        end = min(start + layout.chunk_anchors, layout.anchors)
        prefix = torch.arange((end - 1) * k)
        anchors = torch.arange(start, end)
        local = (anchors[:, None] * k + pattern[None, :]).flatten()
        index += [g * entries + prefix for g in range(n_earlier)] + [local]
        rows = torch.arange((end - start) * k)
        anchor, slot = start + rows // k, rows % k
        earlier = (prefix[None, :] // k) < anchor[:, None]
        offset = torch.arange(len(local)) % len(pattern)
        owner = start + torch.arange(len(local)) // len(pattern)
        own_anchor = (owner[None, :] == anchor[:, None]) & (
            (offset[None, :] < seen) | (offset[None, :] - seen <= slot[:, None])
        )
        masks.append(torch.cat([earlier] * n_earlier + [own_anchor], dim=-1).to(device))
        key_counts.append(n_earlier * len(prefix) + len(local))
        query_counts.append(len(rows))
    return ChunkPlan(torch.cat(index).to(device), key_counts, query_counts, masks)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: Sequence[torch.Tensor],
    past_v: Sequence[torch.Tensor],
    layout: BlockLayout,
    *,
    expand_kv: bool = False,
) -> torch.Tensor:
    """Attention of one block: ``q`` [B, heads, A·K, D], this block's ``k``, ``v`` [B, kv_heads, A·K, D],
    ``past_k`` / ``past_v`` the earlier blocks' groups in ``layout`` order ([first block] + one per
    ``ttt_valid``) -> [B, heads, A·K, D]. ``expand_kv``: later blocks repeat the K/V heads per chunk instead of
    asking SDPA for grouped-query attention (CUDA's memory-efficient kernel takes masks but not GQA)."""
    heads = q.shape[1]
    if layout.causal:  # flash kernels take GQA under is_causal, on CUDA too
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != heads)
    n_first = int(layout.first_block)
    if len(past_k) != n_first + len(layout.ttt_valid) or len(past_v) != len(past_k):
        raise ValueError(
            f"block_sparse_attention got {len(past_k)} past groups for a layout of {n_first} first "
            f"block + {len(layout.ttt_valid)} previous blocks"
        )
    plan = chunk_plan(layout, q.device)
    own = [k] if layout.own_sees_earlier else []
    # One gather and one split for all chunks: slicing per chunk would zero-fill a full-size gradient per chunk.
    keys = torch.cat([*past_k[:n_first], *own, *past_k[n_first:], k], dim=2).index_select(2, plan.index)
    own = [v] if layout.own_sees_earlier else []
    values = torch.cat([*past_v[:n_first], *own, *past_v[n_first:], v], dim=2).index_select(2, plan.index)
    expand = expand_kv and k.shape[1] != heads

    def heads_of(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(heads // t.shape[1], dim=1) if expand else t

    outputs = [
        F.scaled_dot_product_attention(
            query, heads_of(key), heads_of(value), attn_mask=mask, enable_gqa=k.shape[1] != heads and not expand
        )
        for query, key, value, mask in zip(
            q.split(plan.query_counts, dim=2),
            keys.split(plan.key_counts, dim=2),
            values.split(plan.key_counts, dim=2),
            plan.masks,
        )
    ]
    return torch.cat(outputs, dim=2)
