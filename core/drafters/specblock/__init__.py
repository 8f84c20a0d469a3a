"""The SpecBlock drafter (docs/algorithms/specblock.md §3–4): one module, one code path for training and serving.

One forward at an anchor drafts a BLOCK of ``K`` dependent positions (slots)::

    c      = RMSNorm_c(W_c · f_i)           target features 3·H_t -> H (first block), or RMSNorm_c(G_s) (later block)
    e      = RMSNorm_e(Emb(token))          the target's embedding, frozen
    q_k    = RMSNorm_q(P[k])                learnable position queries, k = 0..K-1
    z_k    = W_f · [c ; e ; q_k]            "prefix broadcast": c and e are the same for all K slots
    before decoder layer l >= 1:  z_k <- W_s^(l) · [z_k ; z_{k-1}]   (slot 0 paired with itself; per anchor)
    G_k    = output of the last decoder layer (pre-norm; conditions later blocks)
    logits = lm_head(RMSNorm_out(G_k))      over the draft vocabulary (Vd)
    rank   = RankHead([stopgrad(RMSNorm_out(G_k)) ; φ(logits)])   4 buckets of the target token's draft rank

Rows (docs/algorithms/eagle3.md §1): anchor ``i`` pairs the target's features at position ``i`` with the token at
``i + 1``; its slot ``k`` predicts the token at ``i + 2 + k`` and sits at RoPE position ``i + 1 + k``. A later
block started from slot ``s`` of anchor ``i`` keeps anchor ``i``'s positions (§4).

Attention (§4), entries flattened as ``anchor·K + slot``:

* first block: slot ``(i, k)`` sees ``(j, k')`` iff ``j < i`` or (``j == i`` and ``k' <= k``);
* block ``b >= 2``: the first block's entries of anchors ``j < i``; for each previous block ``b'`` the SAME
  anchor's entries with slot ``< valid[b']`` (the cut used when leaving ``b'``); its own block causally within the
  anchor (plus anchors ``j < i`` only with ``train_block2_sees_other_anchors``, a training quirk of the release).

Training computes these masks' attention block-sparsely by default (:mod:`core.drafters.specblock.attention`:
same result, without the masked entries; ``attention="dense"`` materialises the masks). Training calls
:meth:`SpecBlockDrafter.forward_block`; serving calls :meth:`SpecBlockDrafter.extend_and_draft`
(first blocks of newly committed anchors against the cross cache) and :meth:`SpecBlockDrafter.forward_leaves`
(later blocks of pending tree leaves). All three run :meth:`SpecBlockDrafter._trunk` + :meth:`_heads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UserError
from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.drafters.eagle3 import (
    NUM_AUX_LAYERS,
    Eagle3Attention,
    TargetShapedConfig,
    check_drafter_config,
    layer_llama_config,
    per_row_attention,
    target_layer_shape,
)
from core.drafters.row_kv import RowKV
from core.drafters.specblock.attention import (
    ATTENTION_KINDS,
    CHUNK_ANCHORS,
    CHUNK_ANCHORS_CUDA,
    BlockLayout,
    block_sparse_attention,
)
from core.drafters.native_export import assign_strict, read_export_dir, write_export_dir
from core.drafters.target_tied import TargetTiedDrafter
from core.kernels import exact_cpu
from core.layer_ids import LAYER_CONVENTION

NUM_RANK_FEATURES = 15
RANK_BUCKET_UPPER = (1, 4, 10)  # bucket c holds ranks in (UPPER[c-1], UPPER[c]]; > 10 is the "give up" bucket
FORMAT_VERSION = 1
KIND = "specblock"
EMBED = "embed_tokens.weight"
INITS = ("random", "identity")  # SpecBlockDrafter.init_weights_: the modules' own random init | identity-style


@dataclass(kw_only=True)
class SpecBlockConfig(TargetShapedConfig):
    """Everything that shapes a SpecBlock drafter (the shared fields: :class:`TargetShapedConfig`; §3: the Llama
    release has no RoPE base of its own, so ``rope_theta`` defaults to 10 000). Its own fields are keyword-only."""

    KIND = "SpecBlock"

    block_size: int  # K: slots per block
    num_layers: int  # L_d
    rank_buckets: int = 4
    rank_topk: int = 20  # rank features read the top-20 draft logits, in training AND serving (§9 item 2)
    rank_hidden_size: int = 256
    widths: list[int] = field(default_factory=lambda: [2, 4, 6, 4])  # serving default TOPK[bucket] table
    train_block2_sees_other_anchors: bool = False  # release quirk (§4): later blocks see other anchors' blocks

    def __post_init__(self) -> None:
        self.widths = [int(w) for w in self.widths]
        check_drafter_config(self, self.KIND, ("block_size", "num_layers", "rank_topk", "rank_hidden_size"))
        if self.rank_buckets != len(RANK_BUCKET_UPPER) + 1:
            raise UserError(
                f"rank_buckets must be {len(RANK_BUCKET_UPPER) + 1} (ranks 1 | 2-4 | 5-10 | >10), got "
                f"{self.rank_buckets}"
            )
        if len(self.widths) != self.rank_buckets or any(w < 0 for w in self.widths):
            raise UserError(
                f"widths must give {self.rank_buckets} non-negative candidate counts (one per rank "
                f"bucket), got {self.widths}"
            )

    @classmethod
    def for_target(
        cls,
        target_config,
        *,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        block_size: int = 4,
        num_layers: int = 2,
        **overrides: Any,
    ) -> SpecBlockConfig:
        """A drafter whose decoder layers have the target's per-layer shapes (§3), like the release.
        RoPE: the target's unless ``rope_theta`` / ``rope_scaling`` are overridden."""
        values = target_layer_shape(target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
        values.update(block_size=block_size, num_layers=num_layers)
        values.update(overrides)
        return cls(**values)

    def llama_config(self):
        """The transformers ``LlamaConfig`` of one decoder layer (RoPE and MLP read it)."""
        return layer_llama_config(self, num_layers=self.num_layers)


# ----------------------------------------------------------------------------------------------------------
# Rank features and buckets


@torch.no_grad()
def rank_features(logits: torch.Tensor, topk: int = 20) -> torch.Tensor:
    """The 15 rank-head features φ of §3 from draft logits [..., Vd] -> fp32 [..., 15], no gradient.

    With ``ℓ(1) >= ... >= ℓ(topk)`` the top logits, ``A = logsumexp(ℓ)``, ``π = exp(ℓ - A)``: ``ℓ(1..10) - A``,
    the gaps ``ℓ(1) - ℓ(2)``, ``ℓ(1) - ℓ(3)``, ``ℓ(1) - ℓ(5)``, ``π_1`` and the entropy ``-Σ π log π``.
    A draft vocabulary smaller than ``topk`` (tiny test models) is padded with logits 1e4 below the smallest,
    whose probability is exactly 0 in fp32."""
    top = logits.detach().float().topk(min(topk, logits.shape[-1]), dim=-1).values
    if top.shape[-1] < max(topk, 10):
        pad = top[..., -1:] - 1e4
        top = torch.cat([top, pad.expand(*top.shape[:-1], max(topk, 10) - top.shape[-1])], dim=-1)
    log_z = torch.logsumexp(top, dim=-1, keepdim=True)
    log_pi = top - log_z
    pi = log_pi.exp()
    entropy = -torch.special.xlogy(pi, pi).sum(-1, keepdim=True)
    gaps = top[..., :1] - top[..., [1, 2, 4]]
    return torch.cat([log_pi[..., :10], gaps, pi[..., :1], entropy], dim=-1)


def rank_bucket(rank: torch.Tensor) -> torch.Tensor:
    """1-based rank of the target token in the draft ranking -> bucket: 1 -> 0, 2-4 -> 1, 5-10 -> 2, >10 -> 3."""
    upper = torch.tensor(RANK_BUCKET_UPPER, dtype=torch.long, device=rank.device)
    return torch.bucketize(rank.long(), upper)


def shift_slots(z: torch.Tensor) -> torch.Tensor:
    """The layer-wise shift's partner [..., K, H]: slot 0 gets itself, slot k gets slot k - 1 (per anchor)."""
    return torch.cat([z[..., :1, :], z[..., :-1, :]], dim=-2)


# ----------------------------------------------------------------------------------------------------------
# Attention masks (boolean, True = attend) over flattened entries anchor·K + slot


def first_block_mask(anchors: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[A·K, A·K]: ``(i, k)`` sees ``(j, k')`` iff ``j < i`` or (``j == i`` and ``k' <= k``)."""
    anchor = torch.arange(anchors, device=device).repeat_interleave(k)
    slot = torch.arange(k, device=device).repeat(anchors)
    earlier = anchor[None, :] < anchor[:, None]
    same = (anchor[None, :] == anchor[:, None]) & (slot[None, :] <= slot[:, None])
    return earlier | same


def _earlier_anchors(anchors: int, k: int, device) -> torch.Tensor:
    anchor = torch.arange(anchors, device=device).repeat_interleave(k)
    return anchor[None, :] < anchor[:, None]


def _same_anchor_below(anchors: int, k: int, valid: int, device) -> torch.Tensor:
    anchor = torch.arange(anchors, device=device).repeat_interleave(k)
    slot = torch.arange(k, device=device).repeat(anchors)
    return (anchor[None, :] == anchor[:, None]) & (slot[None, :] < valid)


def later_block_mask(
    anchors: int,
    k: int,
    *,
    first_block: bool,
    ttt_valid: Sequence[int],
    other_anchors: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[A·K, keys] of a training block ``b >= 2``; keys = [first block (if given)] + [one group per previous block
    (``ttt_valid``)] + [this block], each group A·K wide (§4)."""
    groups = []
    if first_block:
        groups.append(_earlier_anchors(anchors, k, device))
    groups += [_same_anchor_below(anchors, k, int(valid), device) for valid in ttt_valid]
    own = first_block_mask(anchors, k, device)
    if not other_anchors:
        own = own & ~_earlier_anchors(anchors, k, device)
    return torch.cat(groups + [own], dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Modules


class SpecBlockAttention(Eagle3Attention):
    """Llama attention over this block's keys after the past K/V groups (``past_k``, ``past_v``: per group
    [B, kv_heads, entries, D]). ``attention``: a dense bool mask [B, T, P + T] over the groups concatenated, an
    ``Attend`` function over them (row-exact serving: one call per row), or the :class:`BlockLayout` of a
    training block (block-sparse, same result)."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: Sequence[torch.Tensor],
        past_v: Sequence[torch.Tensor],
        attention,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not isinstance(attention, BlockLayout):
            return super().forward(x, cos, sin, _joined(past_k), _joined(past_v), attention)
        q, k, v = self.project(x, cos, sin)
        out = block_sparse_attention(q, k, v, past_k, past_v, attention, expand_kv=q.is_cuda)
        return self.merge(out), k, v


def _exact_linear(x: torch.Tensor, weight_t: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` by ``core.kernels.exact_cpu.linear`` (fp32; bf16 values computed in fp32, rounded back)."""
    return exact_cpu.linear(x.float(), weight_t, out_features).to(x.dtype)


def _joined(groups: Sequence[torch.Tensor]) -> torch.Tensor | None:
    if len(groups) <= 1:  # no copy of a lone group (the serving cache)
        return groups[0] if groups else None
    return torch.cat(list(groups), dim=2)


class SpecBlockLayer(nn.Module):
    """A standard pre-norm Llama decoder layer with the target's shapes (transformers parameter names)."""

    def __init__(self, config: SpecBlockConfig):
        super().__init__()
        self.self_attn = SpecBlockAttention(config, input_width=config.hidden_size)
        self.mlp = MLP(config.llama_config())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, k, v = self.self_attn(self.input_layernorm(x), *attn_args)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


@dataclass
class BlockKV:
    """Per-layer K/V of one block forward: ``k[l]``, ``v[l]`` [B, kv_heads, entries, D], entries anchor·K + slot.
    Training keeps them WITH grad (the TTT cache)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def entries(self) -> int:
        return self.k[0].shape[2]

    def select(self, index: torch.Tensor) -> BlockKV:
        """The entries at ``index`` (LongTensor over the entry axis)."""
        return BlockKV([k.index_select(2, index) for k in self.k], [v.index_select(2, index) for v in self.v])

    @staticmethod
    def cat(parts: Sequence[BlockKV]) -> BlockKV:
        layers = len(parts[0].k)
        return BlockKV(
            [torch.cat([p.k[i] for p in parts], dim=2) for i in range(layers)],
            [torch.cat([p.v[i] for p in parts], dim=2) for i in range(layers)],
        )


@dataclass
class BlockOutput:
    """One block forward: per anchor ``i`` and slot ``k``."""

    logits: torch.Tensor  # [B, S, K, Vd] draft logits
    rank_logits: torch.Tensor  # [B, S, K, rank_buckets]
    hidden: torch.Tensor  # [B, S, K, H] pre-norm last-layer hidden G (conditions later blocks)
    kv: BlockKV  # this block's K/V for its B·S·K entries


class SpecBlockCache(RowKV):
    """The serving CROSS cache (§4): per layer K/V [B, kv_heads, capacity, D] holding all K slots of every
    committed anchor (first-block entries computed from target features), one length per row in entries
    (:class:`core.drafters.row_kv.RowKV`; row ``b`` holds ``held[b] // K`` anchors)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int):
        super().__init__(k, v, name="SpecBlock cross cache", unit="entries")
        self.block_size = block_size

    @property
    def anchors(self) -> int:
        """The anchors every row holds (the one-row API); refuses rows of different lengths."""
        return self.length // self.block_size

    @property
    def row_anchors(self) -> list[int]:
        """The anchors each row holds."""
        return [n // self.block_size for n in self.held]

    def append(self, kv: BlockKV, counts: list[int] | None = None) -> None:
        """Row ``b`` appends the first ``counts[b]`` entries of ``kv`` (None: all of them)."""
        super().append(list(zip(kv.k, kv.v)), counts)

    def view(self) -> BlockKV:
        """Every row's entries up to the longest row's (a row alone: exactly its entries)."""
        layers = super().view()
        return BlockKV([k for k, _ in layers], [v for _, v in layers])


class SpecBlockDrafter(TargetTiedDrafter):
    """The SpecBlock drafter; see the module docstring for the architecture, positions and masks."""

    ROW_EXACT_SERVING = True

    def __init__(self, config: SpecBlockConfig, embed_weight: torch.Tensor | None = None):
        """``embed_weight`` [V, H]: the target's token embedding, shared (not copied) and frozen."""
        super().__init__()
        self._init_target_tied(config, embed_weight)
        hidden, k = config.hidden_size, config.block_size
        self.fc = Linear(NUM_AUX_LAYERS * config.target_hidden_size, hidden, bias=False)  # W_c
        self.cond_norm = RMSNorm(hidden, config.rms_norm_eps)  # RMSNorm_c
        self.embed_norm = RMSNorm(hidden, config.rms_norm_eps)  # RMSNorm_e
        self.query_norm = RMSNorm(hidden, config.rms_norm_eps)  # RMSNorm_q
        self.position_queries = nn.Parameter(torch.empty(k, hidden))  # P
        nn.init.normal_(self.position_queries, std=0.02)
        self.fuse = Linear(3 * hidden, hidden, bias=False)  # W_f over [c ; e ; q]
        self.layers = nn.ModuleList(SpecBlockLayer(config) for _ in range(config.num_layers))
        self.shift = nn.ModuleList(Linear(2 * hidden, hidden, bias=False) for _ in range(config.num_layers - 1))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)  # RMSNorm_out
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)
        self.rank_head = nn.Sequential(
            Linear(hidden + NUM_RANK_FEATURES, config.rank_hidden_size, bias=False),
            nn.SiLU(),
            Linear(config.rank_hidden_size, config.rank_buckets, bias=False),
        )

    def init_weights_(self, init: str) -> None:
        """``random``: leave the modules' own random init. ``identity``: an identity-style start, every layer-wise
        shift ``W_s = [I | 0]`` (it returns its first input: the slot's own state, as a residual would) and the
        condition block of the fusion projection ``W_f = [I | W_e | W_q]`` (it passes ``c`` through; the token
        and position-query blocks keep their random init). Draws no random numbers either way."""
        if init not in INITS:
            raise UserError(f"init={init!r} is not one of {', '.join(INITS)}")
        if init == "random":
            return
        hidden = self.config.hidden_size
        with torch.no_grad():
            eye = torch.eye(hidden, dtype=self.fuse.weight.dtype, device=self.fuse.weight.device)
            for shift in self.shift:
                shift.weight.zero_()
                shift.weight[:, :hidden].copy_(eye)
            self.fuse.weight[:, :hidden].copy_(eye)

    def head_parameters(self) -> list[nn.Parameter]:
        """The output pathway (lm_head + rank head) that the serving-time bandit's head-only update trains."""
        return list(self.lm_head.parameters()) + list(self.rank_head.parameters())

    def new_cache(self, max_anchors: int, batch_size: int = 1) -> SpecBlockCache:
        """An empty cross cache for ``max_anchors`` committed anchors (K entries each)."""
        ref = self.fc.weight
        shape = (
            batch_size,
            self.config.num_key_value_heads,
            max_anchors * self.config.block_size,
            self.config.resolved_head_dim,
        )
        layers = self.config.num_layers
        return SpecBlockCache(
            [ref.new_zeros(shape) for _ in range(layers)],
            [ref.new_zeros(shape) for _ in range(layers)],
            self.config.block_size,
        )

    # -- the one code path -----------------------------------------------------------------------------------

    def _trunk(
        self,
        cond: torch.Tensor,
        tokens: torch.Tensor,
        anchors: torch.Tensor,
        past: Sequence[BlockKV],
        attention: torch.Tensor | BlockLayout,
    ) -> tuple[torch.Tensor, BlockKV]:
        """Block forward of A anchors: ``cond`` [B, A, H] (RMSNorm_c input), ``tokens`` [B, A] target ids,
        ``anchors`` [B, A] anchor indices (slot k at position anchor + 1 + k), ``past`` the key groups before this
        block's, ``attention`` a bool mask [B, A·K, P + A·K] over them or their :class:`BlockLayout`
        -> (G [B, A, K, H], this block's K/V)."""
        batch, count = tokens.shape
        k, hidden = self.config.block_size, self.config.hidden_size
        c = self.cond_norm(cond)
        dtype = c.dtype
        e = self.embed_norm(self.embed_tokens(tokens).to(dtype))
        q = self.query_norm(self.position_queries).to(dtype)
        # W_f · [c ; e ; q_k] split by input block: c and e are projected once per anchor (prefix broadcast).
        w_c, w_e, w_q = self.fuse.weight.split(hidden, dim=1)
        if self.row_exact:  # rows whose bits do not depend on the call's other rows
            w_c_t, w_e_t = self._fuse_packed()
            prefix = _exact_linear(c, w_c_t, hidden) + _exact_linear(e, w_e_t, hidden)
        else:
            prefix = F.linear(c, w_c) + F.linear(e, w_e)
        z = prefix[:, :, None, :] + F.linear(q, w_q)  # [B, A, K, H]
        positions = (anchors[..., None] + 1 + torch.arange(k, device=anchors.device)).reshape(batch, count * k)
        cos, sin = self._rope(positions, dtype)
        ks, vs = [], []
        for index, layer in enumerate(self.layers):
            if index >= 1:  # the shift projection REPLACES the layer input (no residual add)
                z = self.shift[index - 1](torch.cat([z, shift_slots(z)], dim=-1))
            past_k, past_v = [group.k[index] for group in past], [group.v[index] for group in past]
            x, key, value = layer(z.reshape(batch, count * k, hidden), cos, sin, past_k, past_v, attention)
            z = x.view(batch, count, k, hidden)
            ks.append(key)
            vs.append(value)
        return z, BlockKV(ks, vs)

    def _fuse_packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition and token blocks of W_f as the exact linear takes them (made again when W_f changes)."""
        weight = self.fuse.weight
        stamp = (weight.data_ptr(), weight._version)
        packed = self.__dict__.get("_fuse_packs")
        if packed is None or packed[0] != stamp:
            hidden = self.config.hidden_size
            packed = (stamp, tuple(exact_cpu.transposed_weight(w.float()) for w in weight.split(hidden, dim=1)[:2]))
            self.__dict__["_fuse_packs"] = packed
        return packed[1]

    def _heads(self, hidden: torch.Tensor, counts: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """G [B, A, ..., H] -> (draft logits [B, A, ..., Vd], rank logits [B, A, ..., buckets]); the rank head
        reads no gradient path into the trunk (detached hidden, no-grad features). Row-exact: one call per row
        over its ``counts[b]`` real anchors (None: all A), the rest zero (the rank features' and SiLU's vectorised
        kernels treat a tensor's tail apart, so a row's bits could depend on its neighbours and pads)."""
        batch, count = hidden.shape[:2]
        if not self.row_exact or (batch == 1 and (counts is None or counts[0] == count)):
            return self._row_heads(hidden)
        counts = [count] * batch if counts is None else counts
        logits = hidden.new_zeros(*hidden.shape[:-1], self.config.draft_vocab_size)
        rank = hidden.new_zeros(*hidden.shape[:-1], self.config.rank_buckets)
        for b, n in enumerate(counts):
            if n:
                logits[b : b + 1, :n], rank[b : b + 1, :n] = self._row_heads(hidden[b : b + 1, :n])
        return logits, rank

    def _row_heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(hidden)
        logits = self.lm_head(normed)
        features = rank_features(logits, self.config.rank_topk).to(normed.dtype)
        return logits, self.rank_head(torch.cat([normed.detach(), features], dim=-1))

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3·H_t] -> W_c · f (RMSNorm_c is applied inside the block forward)."""
        return self.fc(aux_hidden)

    # -- training --------------------------------------------------------------------------------------------

    def forward_block(
        self,
        cond: torch.Tensor,
        tokens: torch.Tensor,
        *,
        from_target: bool,
        first_block_kv: BlockKV | None = None,
        ttt_kv: Sequence[BlockKV] = (),
        ttt_valid: Sequence[int] = (),
        attention: str = "block_sparse",
    ) -> BlockOutput:
        """Training-mode forward of one block for all anchors of a batch.

        ``cond``: [B, S, 3·H_t] target aux features (W_c + RMSNorm_c applied here) when ``from_target``, else
        [B, S, H] drafter pre-norm hiddens G (RMSNorm_c only). ``tokens``: [B, S] target-vocab ids (row i = the
        token embedded with anchor i). Slot k of anchor i sits at RoPE position i + 1 + k (later blocks reuse
        the anchor's positions). Attention per §4 (module docstring); ``first_block_kv`` / ``ttt_kv`` /
        ``ttt_valid`` are used by later blocks only (``ttt_kv[b']`` = block b''s ``kv``, ``ttt_valid[b']`` = the
        cut M leaving it). ``attention``: ``block_sparse`` (skips masked entries) or ``dense`` (the boolean
        masks of :func:`first_block_mask` / :func:`later_block_mask`; the reference)."""
        if len(ttt_kv) != len(ttt_valid):
            raise ValueError(f"ttt_kv has {len(ttt_kv)} blocks but ttt_valid {len(ttt_valid)}: give one cut per block")
        if from_target and (first_block_kv is not None or ttt_kv):
            raise ValueError("a first block (from_target=True) attends to no earlier block: drop first_block_kv/ttt_kv")
        if any(not 1 <= int(m) <= self.config.block_size for m in ttt_valid):
            raise ValueError(f"ttt_valid cuts must lie in 1..K={self.config.block_size}, got {list(ttt_valid)}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
        batch, count = tokens.shape
        device, k = tokens.device, self.config.block_size
        if from_target:
            cond = self.fc(cond)
        past = ([first_block_kv] if first_block_kv is not None else []) + list(ttt_kv)
        other_anchors = self.config.train_block2_sees_other_anchors
        structure: torch.Tensor | BlockLayout = BlockLayout(
            count,
            k,
            first_block=first_block_kv is not None,
            ttt_valid=tuple(int(m) for m in ttt_valid),
            own_sees_earlier=from_target or other_anchors,
            chunk_anchors=CHUNK_ANCHORS_CUDA if device.type == "cuda" else CHUNK_ANCHORS,
        )
        if attention == "dense":
            mask = (
                first_block_mask(count, k, device)
                if from_target
                else later_block_mask(
                    count,
                    k,
                    first_block=first_block_kv is not None,
                    ttt_valid=ttt_valid,
                    other_anchors=other_anchors,
                    device=device,
                )
            )
            structure = mask.expand(batch, *mask.shape)
        anchors = torch.arange(count, device=device).expand(batch, count)
        hidden, kv = self._trunk(cond, tokens, anchors, past, structure)
        logits, rank = self._heads(hidden)
        return BlockOutput(logits, rank, hidden, kv)

    # -- serving ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def extend_and_draft(
        self, features: torch.Tensor, tokens: torch.Tensor, cache: SpecBlockCache, counts: list[int] | None = None
    ) -> BlockOutput:
        """Commit new anchors and draft the first block of the last one, for the B rows of ``cache`` at once.

        ``features`` [B, T, 3·H_t]: the target's aux features of positions ``n_b .. n_b + T - 1`` (``n_b`` =
        anchors row ``b`` holds), ``tokens`` [B, T]: the token that follows each. ``counts`` [B]: row ``b``'s
        first ``counts[b]`` anchors are real, the rest pads that are never kept (None: all T of every row). Every
        new anchor's K slots see its row's cross cache plus the row's earlier new anchors and their own slots
        causally (= the training first-block mask); all K entries of every real new anchor are appended to
        ``cache``. Returns each row's LAST real anchor's block ([B, 1, K, ...]; ``kv`` = its entries; a row with
        no new anchor: meaningless)."""
        batch, count = tokens.shape
        k = self.config.block_size
        if cache.batch != batch:
            raise ValueError(
                f"extend_and_draft got {batch} rows but the cross cache holds {cache.batch}; build it "
                f"with new_cache(max_anchors, batch_size={batch})"
            )
        entries = cache.counts(count * k, None if counts is None else [int(n) * k for n in counts])
        ragged = not cache.uniform or any(n != count * k for n in entries)
        past = [cache.view()] if cache.longest else []
        own = first_block_mask(count, k, tokens.device)
        if ragged:
            mask = self._ragged_mask(own, cache, entries)
            firsts = torch.tensor(cache.row_anchors, device=tokens.device)[:, None]
        else:
            mask = torch.cat([own.new_ones(count * k, cache.length), own], dim=-1).expand(batch, -1, -1)
            firsts = cache.anchors
        anchors = (firsts + torch.arange(count, device=tokens.device)).expand(batch, count)
        attention = per_row_attention(mask, cache.held, entries) if self.row_exact else mask
        hidden, kv = self._trunk(self.fc(features), tokens, anchors, past, attention)
        cache.append(kv, entries if ragged else None)
        last = [max(n // k, 1) - 1 for n in entries]
        if not ragged:
            logits, rank = self._heads(hidden[:, -1:])
            return BlockOutput(
                logits, rank, hidden[:, -1:], kv.select(torch.arange((count - 1) * k, count * k, device=tokens.device))
            )
        rows = torch.arange(batch, device=tokens.device)
        at = torch.tensor(last, device=tokens.device)
        hidden = hidden[rows, at][:, None]  # [B, 1, K, H]
        logits, rank = self._heads(hidden)
        slots = at[:, None] * k + torch.arange(k, device=tokens.device)  # [B, K]
        select = [(t[rows[:, None], :, slots].transpose(1, 2)) for t in (*kv.k, *kv.v)]
        layers = len(kv.k)
        return BlockOutput(logits, rank, hidden, BlockKV(select[:layers], select[layers:]))

    @staticmethod
    def _ragged_mask(own: torch.Tensor, cache: SpecBlockCache, entries: list[int]) -> torch.Tensor:
        """bool [B, T·K, P + T·K] of a ragged :meth:`extend_and_draft`: row ``b``'s held entries, then its real new
        entries under the first-block mask; a pad entry sees itself (no empty softmax row)."""
        batch, new = cache.batch, own.shape[0]
        real = torch.arange(new, device=own.device) < torch.tensor(entries, device=own.device)[:, None]  # [B, T·K]
        mine = own & real[:, None, :]
        mine = mine | torch.eye(new, dtype=torch.bool, device=own.device)
        return torch.cat([cache.key_mask(new).to(own.device), mine], dim=-1).expand(batch, new, -1)

    @torch.no_grad()
    def forward_leaves(
        self,
        cond: torch.Tensor,
        tokens: torch.Tensor,
        cache: SpecBlockCache,
        *,
        current_valid: torch.Tensor,
        ttt: BlockKV | None = None,
        ttt_visible: torch.Tensor | None = None,
        counts: list[int] | None = None,
        ttt_counts: list[int] | None = None,
    ) -> BlockOutput:
        """Later blocks of L pending tree leaves of the CURRENT anchor (the last one in ``cache``), in one forward.

        ``cond`` [B, L, H]: the pre-norm hidden G of each leaf's source slot; ``tokens`` [B, L]: the leaf tokens
        (target ids). Each leaf sees the cross cache of earlier anchors, the current anchor's first-block slots
        ``< current_valid[l]`` (LongTensor [L]), the TTT entries ``ttt`` where ``ttt_visible`` [L, entries] is
        True (its lineage's earlier later-blocks, slot < source slot + 1), and its own slots causally. Positions
        are the current anchor's (§4).

        Ragged rows (``counts`` [B]: row ``b``'s first ``counts[b]`` leaves are real): each row's leaves belong to
        its own current anchor (its last in ``cache``), ``current_valid`` is [B, L], ``ttt_visible`` [B, L, E]
        and ``ttt_counts`` [B] the TTT entries each row holds (the first of ``ttt``'s E); a row reads only its own
        cache entries, TTT entries and real leaves. Pad leaves' outputs are meaningless."""
        if counts is not None:
            return self._leaves_of_rows(cond, tokens, cache, current_valid, ttt, ttt_visible, counts, ttt_counts)
        batch, count = tokens.shape
        k = self.config.block_size
        device = tokens.device
        current = cache.anchors - 1
        if current < 0:
            raise ValueError(
                "forward_leaves needs the current anchor's first block in the cache: call extend_and_draft first"
            )
        slot = torch.arange(k, device=device)
        earlier = torch.ones(count * k, current * k, dtype=torch.bool, device=device)
        block1 = (slot[None, :] < current_valid.to(device)[:, None]).repeat_interleave(k, dim=0)  # [L·K, K]
        groups, parts = [earlier, block1], [cache.view()]
        if ttt is not None:
            if ttt_visible is None or tuple(ttt_visible.shape) != (count, ttt.entries):
                raise ValueError(f"ttt_visible must be [{count}, {ttt.entries}] when ttt entries are given")
            groups.append(ttt_visible.to(device).repeat_interleave(k, dim=0))
            parts.append(ttt)
        own = first_block_mask(count, k, device) & ~_earlier_anchors(count, k, device)
        mask = torch.cat(groups + [own], dim=-1).expand(batch, -1, -1)
        anchors = torch.full((batch, count), current, dtype=torch.long, device=device)
        hidden, kv = self._trunk(cond, tokens, anchors, parts, mask)
        logits, rank = self._heads(hidden)
        return BlockOutput(logits, rank, hidden, kv)

    def _leaves_of_rows(
        self,
        cond: torch.Tensor,
        tokens: torch.Tensor,
        cache: SpecBlockCache,
        current_valid: torch.Tensor,
        ttt: BlockKV | None,
        ttt_visible: torch.Tensor | None,
        counts: list[int],
        ttt_counts: list[int] | None,
    ) -> BlockOutput:
        """:meth:`forward_leaves` over ragged rows (see there)."""
        batch, count = tokens.shape
        k, device = self.config.block_size, tokens.device
        if cache.batch != batch or len(counts) != batch or any(not 0 <= n <= count for n in counts):
            raise ValueError(
                f"forward_leaves got {batch} rows and counts {list(counts)} for a cross cache of "
                f"{cache.batch} rows; give one count in 0..{count} per cache row"
            )
        held = cache.held
        if any(n and h < k for n, h in zip(counts, held)):
            raise ValueError(
                "forward_leaves needs each row's current anchor's first block in the cache: call extend_and_draft first"
            )
        past, entries = cache.longest, (0 if ttt is None else ttt.entries)
        current = torch.tensor([max(h // k - 1, 0) for h in held], device=device)  # [B]
        column = torch.arange(past, device=device)
        start = (current * k)[:, None, None]  # the current anchor's first entry
        slot = column[None, None, :] - start  # [B, 1, P]: slot of the current anchor, < 0 for earlier anchors
        valid = current_valid.to(device).repeat_interleave(k, dim=1)[:, :, None]  # [B, L·K, 1]
        groups = [(slot < 0) | ((slot < k) & (slot < valid))]  # [B, L·K, P]
        parts = [cache.view()]
        if ttt is not None:
            if ttt_visible is None or tuple(ttt_visible.shape) != (batch, count, entries):
                raise ValueError(f"ttt_visible must be [{batch}, {count}, {entries}] when ttt entries are given")
            groups.append(ttt_visible.to(device).repeat_interleave(k, dim=1))
            parts.append(ttt)
        own = first_block_mask(count, k, device) & ~_earlier_anchors(count, k, device)
        real = torch.arange(count * k, device=device) < torch.tensor([n * k for n in counts], device=device)[:, None]
        own = (own & real[:, None, :]) | torch.eye(count * k, dtype=torch.bool, device=device)
        mask = torch.cat(groups + [own], dim=-1)
        anchors = current[:, None].expand(batch, count)
        attention = mask
        if self.row_exact:
            ttt_held = list(ttt_counts) if ttt_counts is not None else [entries] * batch
            spans = [[(0, h), (past, e), (past + entries, n * k)] for h, e, n in zip(held, ttt_held, counts)]
            attention = span_attention(mask, spans)
        hidden, kv = self._trunk(cond, tokens, anchors, parts, attention)
        logits, rank = self._heads(hidden, counts)
        return BlockOutput(logits, rank, hidden, kv)


def span_attention(mask: torch.Tensor, spans: Sequence[Sequence[tuple[int, int]]]):
    """An attention function (``Attend``) that runs one SDPA per row over exactly its keys: row ``b``'s key
    columns are its ``spans[b]`` (start, length) in order, its queries the first ``spans[b][-1][1]`` (its own new
    entries, the last span), under ``mask`` [B, T, keys]: the call the row gets alone, so its result does not
    depend on the other rows (row-exact serving). Pad queries come out zero."""

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = q.new_zeros(q.shape)
        gqa = q.shape[1] != keys.shape[1]
        for b, row in enumerate(spans):
            queries = row[-1][1]
            if queries == 0:
                continue
            cols = torch.cat([torch.arange(start, start + n) for start, n in row]).to(mask.device)
            out[b : b + 1, :, :queries] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :queries],
                keys[b : b + 1, :, cols],
                values[b : b + 1, :, cols],
                attn_mask=mask[b : b + 1, :queries, cols][:, None],
                enable_gqa=gqa,
            )
        return out

    return attend


# ----------------------------------------------------------------------------------------------------------
# Native export directory (docs/architecture.md §5.3)


def spectrain_block(
    config: SpecBlockConfig, target: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "layout": "native",
        "target": target,
        "architecture": config.to_dict(),
        "block_size": config.block_size,
        "num_layers": config.num_layers,
        "layers": {"ids": list(config.aux_layer_ids), "convention": LAYER_CONVENTION},
        "rank_buckets": {
            "count": config.rank_buckets,
            "rank_upper_bounds": list(RANK_BUCKET_UPPER),
            "topk_features": config.rank_topk,
        },
        "widths": list(config.widths),
        "vocab": {"vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size},
        "embed_tokens": "target",
        **(extra or {}),
    }


def save_native(
    drafter: SpecBlockDrafter,
    out_dir: str | Path,
    *,
    target: dict[str, Any],
    recipe: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the native export dir atomically: ``config.json`` (``spectrain`` block), ``model.safetensors``
    (without the frozen target embedding), ``metrics.json`` and ``recipe.yaml`` when given. Refuses an existing
    non-empty ``out_dir`` (exports are never overwritten)."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in drafter.state_dict().items() if name != EMBED}
    return write_export_dir(
        out_dir, tensors, spectrain_block(drafter.config, target, extra), recipe=recipe, metrics=metrics
    )


def read_native(path: str | Path) -> tuple[SpecBlockConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, spectrain block) of a native SpecBlock export; one-line errors for anything else."""
    return read_export_dir(
        path, kind=KIND, title="SpecBlock", loader="SpecBlock algorithms", config_cls=SpecBlockConfig
    )


def build_drafter(
    config: SpecBlockConfig, tensors: dict[str, torch.Tensor], embed_weight: torch.Tensor | None = None
) -> SpecBlockDrafter:
    """The module holding ``tensors`` (strict: no missing or unknown tensor, shapes checked)."""
    with torch.device("meta"):
        drafter = SpecBlockDrafter(config)
    assign_strict(drafter, tensors, title="SpecBlock", frozen=(EMBED,))
    if embed_weight is None:  # a placeholder; serving must share the target's embedding (use_target_embedding)
        embed_weight = torch.zeros(config.vocab_size, config.hidden_size, dtype=tensors["fc.weight"].dtype)
    drafter.use_target_embedding(embed_weight)
    return drafter


def load_native(path: str | Path, embed_weight: torch.Tensor | None = None) -> SpecBlockDrafter:
    """Load a native export. ``embed_weight``: the target's embedding, shared; without it the embedding is a
    zero placeholder (weights inspection, tests) that must be replaced before serving."""
    config, tensors, _ = read_native(path)
    return build_drafter(config, tensors, embed_weight)
