"""The DFlash drafter (block diffusion drafting, arXiv 2602.06036): one module, one code path for training and
serving.

Architecture (parameter names are those of z-lab's release and vLLM's ``speculators`` ``DFlashDraftModel``, so
the module's body state dict loads into both as is)::

    c      = hidden_norm(fc(concat(h_l1, ..., h_ln)))     # target features n·H_t -> H, one row per context position
    per draft layer l (Qwen3-style: q_norm / k_norm per head, no bias by default):
      K_ctx, V_ctx = k_norm(k_proj_l(c)), v_proj_l(c)      # the context enters EVERY layer's attention as K/V only
      x      = x + o_proj(attn(q = q_norm(q_proj(input_layernorm(x))),
                               keys = [K_ctx ; K_block], values = [V_ctx ; V_block]))
      x      = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                              # lm_head: the target's rows of the draft vocabulary, frozen
    draft id i -> target id i + d2t[i]                     # EAGLE-3 offsets; t2d[v]: v is in the draft vocab

Blocks. A block at anchor position ``p`` is ``block_size`` tokens: the anchor token (the token AT ``p``, already
decided) followed by ``block_size - 1`` copies of ``mask_token_id``, at RoPE positions ``p .. p + block_size - 1``;
the block's input ``x`` is the target's (frozen) embedding of those tokens. Slot ``k >= 1`` predicts the token at
``p + k`` (the target's distribution at ``p + k - 1``); slot 0 predicts nothing. The block sees the context
features of the positions ``< p`` and all of its own slots (bidirectional), nothing else, so one forward drafts
``block_size - 1`` tokens.

Training (:meth:`DFlashDrafter.forward`): many anchors per sequence at once; each block's attention reads its own
context prefix and its own block (:mod:`core.drafters.dflash.attention`, block-sparse). Serving
(:meth:`DFlashDrafter.draft`): the context K/V of committed positions are cached per layer (they depend on the
features only, never on other positions), and one block is run against them with no mask. Both call
:meth:`DFlashDrafter._layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.errors import UserError
from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import apply_rope
from core.drafters.dflash.attention import CHUNK_ANCHORS, AnchorLayout, ContextLengths, anchor_block_attention
from core.drafters.eagle3 import TargetShapedConfig, layer_llama_config, target_layer_shape
from core.drafters.row_kv import RowKV
from core.drafters.target_tied import TargetTiedDrafter

KIND = "dflash"


@dataclass(kw_only=True)
class DFlashConfig(TargetShapedConfig):
    """Everything that shapes a DFlash drafter (the shared fields: :class:`TargetShapedConfig`). ``aux_layer_ids``
    are output-of-layer ids, 0-based (``core.layer_ids``), any number of them (z-lab uses as many as draft
    layers). Its own fields are keyword-only."""

    KIND = "DFlash"

    block_size: int  # tokens per block: the anchor + block_size - 1 mask tokens (= drafted tokens)
    num_layers: int  # draft decoder layers
    mask_token_id: int  # the token id of every non-anchor slot (its embedding is the target's, frozen)
    attention_bias: bool = False  # q/k/v/o biases (Qwen3: none)

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.head_dim is None:  # stored resolved, so configs compare equal whatever their source wrote
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_layers",
        ):
            if int(getattr(self, name)) < 1:
                raise UserError(f"DFlash config: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise UserError(
                f"DFlash block_size must be >= 2 (the anchor + at least one drafted token), got {self.block_size}"
            )
        if not self.aux_layer_ids or any(i < 0 for i in self.aux_layer_ids):
            raise UserError(f"DFlash needs at least one non-negative aux layer id, got {self.aux_layer_ids}")
        if self.hidden_size != self.target_hidden_size:
            raise UserError(
                f"DFlash drafter hidden_size {self.hidden_size} must equal the target's "
                f"{self.target_hidden_size}: it embeds with the target's matrix"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise UserError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab_size {self.vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(
                f"mask_token_id {self.mask_token_id} is not a token id of the {self.vocab_size}-token "
                "vocabulary; pick an unused or special token of the target's tokenizer"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def for_target(
        cls,
        target_config,
        *,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        block_size: int,
        num_layers: int,
        mask_token_id: int,
        **overrides: Any,
    ) -> DFlashConfig:
        """Decoder layers with ``target_config``'s per-layer shapes and RoPE (as z-lab's releases)."""
        values = target_layer_shape(target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
        values.update(
            block_size=block_size,
            num_layers=num_layers,
            mask_token_id=mask_token_id,
            attention_bias=bool(getattr(target_config, "attention_bias", False)),
        )
        values.update(overrides)
        return cls(**values)

    @property
    def drafted_tokens(self) -> int:
        """Tokens one forward drafts (vLLM's ``num_speculative_tokens`` for DFlash)."""
        return self.block_size - 1

    def llama_config(self):
        return layer_llama_config(self, num_layers=self.num_layers)


# ----------------------------------------------------------------------------------------------------------
# Modules


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are the context's (precomputed per layer) followed by the block's own."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim = config.resolved_head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def _heads(self, proj: Linear, x: torch.Tensor, heads: int, norm: RMSNorm | None) -> torch.Tensor:
        """[B, T, H] -> [B, heads, T, D], normed per head first when ``norm`` is given."""
        out = proj(x).view(*x.shape[:2], heads, self.head_dim)
        return (out if norm is None else norm(out)).transpose(1, 2)

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused context [B, P, H] at cos/sin [B, 1, P, D] -> RoPE'd K and V [B, kv_heads, P, D]."""
        k = apply_rope(self._heads(self.k_proj, context, self.num_kv_heads, self.k_norm), cos, sin)
        return k, self._heads(self.v_proj, context, self.num_kv_heads, None)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        layout: AnchorLayout | None,
    ) -> torch.Tensor:
        """Block rows x [B, Q, H] (normed) -> attention output [B, Q, H]. ``layout`` None: every row sees all of
        the context and all Q rows (one block, serving); else the anchors' block-sparse pattern (training)."""
        q = apply_rope(self._heads(self.q_proj, x, self.num_heads, self.q_norm), cos, sin)
        k, v = self.context_kv(x, cos, sin)
        out = anchor_block_attention(q, k, v, context_k, context_v, layout)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer; the context is not normed here (``hidden_norm`` did it once)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = MLP(config.llama_config())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashCache(RowKV):
    """The serving cache: per draft layer the context K/V [B, kv_heads, capacity, D] of committed positions and
    ``lengths`` [B] (:class:`core.drafters.row_kv.RowKV`)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        super().__init__(k, v, name="DFlash context cache", unit="positions")


class DFlashDrafter(TargetTiedDrafter):
    """The DFlash drafter; see the module docstring for the architecture, blocks and positions."""

    ROW_EXACT_SERVING = True

    def __init__(
        self, config: DFlashConfig, embed_weight: torch.Tensor | None = None, head_weight: torch.Tensor | None = None
    ):
        """``embed_weight`` [V, H]: the target's token embedding, shared and frozen; ``head_weight`` [V, H]: the
        target's lm_head, whose draft-vocabulary rows become this drafter's frozen ``lm_head``."""
        super().__init__()
        self._init_target_tied(config, embed_weight)
        hidden = config.hidden_size
        self.fc = Linear(len(config.aux_layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's rows (paper §3; speculators freezes it too)
        self._target_head: torch.Tensor | None = None
        if head_weight is not None:
            self.use_target_head(head_weight)

    # -- the target's frozen weights --------------------------------------------------------------------------

    def use_target_head(self, weight: torch.Tensor) -> None:
        """Take the frozen ``lm_head`` from the target's [V, H] head: its rows of the draft vocabulary (kept in
        sync by :meth:`set_vocab_map`)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"target lm_head is {tuple(weight.shape)} but this drafter needs "
                f"{(self.config.vocab_size, self.config.hidden_size)}; it was built for another target"
            )
        self._target_head = weight
        rows = weight.detach()[self.draft_ids_in_target().to(weight.device)]
        self.lm_head.weight = nn.Parameter(rows.to(self.lm_head.weight.dtype), requires_grad=False)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        super().set_vocab_map(d2t, t2d)
        if self._target_head is not None:
            self.use_target_head(self._target_head)

    def new_cache(self, max_len: int, batch_size: int = 1) -> DFlashCache:
        ref = self.fc.weight
        shape = (batch_size, self.config.num_key_value_heads, max_len, self.config.resolved_head_dim)
        layers = self.config.num_layers
        return DFlashCache([ref.new_zeros(shape) for _ in range(layers)], [ref.new_zeros(shape) for _ in range(layers)])

    # -- the one code path -----------------------------------------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [B, P, n·H_t] -> the fused context [B, P, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer: the context's K, V [B, kv_heads, P, D] at ``positions`` [B, P]."""
        cos, sin = self._rope(positions, context.dtype)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def block_tokens(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Anchor tokens [B, A] -> block tokens [B, A·block_size]: each anchor followed by mask tokens."""
        tokens = torch.full(
            (*anchor_tokens.shape, self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        tokens[..., 0] = anchor_tokens
        return tokens.flatten(1)

    def _layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        layout: AnchorLayout | ContextLengths | None,
    ) -> torch.Tensor:
        """Block tokens [B, Q] at ``positions`` [B, Q] -> last-layer hidden states (pre-norm) [B, Q, H]."""
        dtype = self.fc.weight.dtype
        cos, sin = self._rope(positions, dtype)
        x = self.embed_tokens(tokens).to(dtype)
        for layer, (k, v) in zip(self.layers, context_kv):
            x = layer(x, cos, sin, k, v, layout)
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (pre-norm) [..., H] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    # -- training --------------------------------------------------------------------------------------------

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        *,
        attention: str = "block_sparse",
        chunk_anchors: int = CHUNK_ANCHORS,
    ) -> torch.Tensor:
        """Training forward: blocks at ``anchors`` [B, A] (positions in the sequence) over whole sequences.

        ``features`` [B, T, n·H_t] and ``input_ids`` [B, T] are unshifted (row t = the target's features at t and
        token t). Returns the last-layer hidden states (pre-norm) [B, A, block_size, H]: slot k of anchor p
        predicts token p + k (apply :meth:`head` to the slots that carry a loss). ``attention``: ``block_sparse``
        (each block reads only its context prefix and itself) or ``dense`` (the reference [Q, T + Q] mask; the
        same result, for tests and measurements); ``chunk_anchors``: anchors per chunk of the sparse path."""
        batch, length = input_ids.shape
        k = self.config.block_size
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        context_kv = self.context_kv(self.context(features.to(self.fc.weight.dtype)), positions)
        tokens = self.block_tokens(input_ids.gather(1, anchors))
        slots = torch.arange(k, device=anchors.device)
        block_positions = (anchors[..., None] + slots).flatten(1)
        layout = AnchorLayout(anchors, k, dense=attention == "dense", chunk_anchors=chunk_anchors)
        hidden = self._layers(tokens, block_positions, context_kv, layout)
        return hidden.view(batch, anchors.shape[1], k, -1)

    # -- serving ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self,
        cache: DFlashCache,
        features: torch.Tensor,
        anchor_token: int | torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """For each of the cache's B rows: append the context of its newly committed positions (``features`` [B, n,
        n·H_t], the positions right after those the row caches; ``counts`` [B]: row b's first ``counts[b]`` are real,
        None: all n), then draft the block of its next position: the anchor ``anchor_token[b]`` sits at position
        ``cache.lengths[b]``. Returns the logits of the drafted slots [B, block_size - 1, Vd]."""
        device = self.fc.weight.device
        batch, new = features.shape[:2]
        if cache.batch != batch:
            raise ValueError(
                f"draft got {batch} rows but the DFlash cache holds {cache.batch}; build the cache with "
                f"new_cache(max_len, batch_size={batch})"
            )
        counts = cache.counts(new, counts)
        if new:
            positions = cache.lengths[:, None] + torch.arange(new, device=device)
            cache.append(self.context_kv(self.context(features.to(self.fc.weight.dtype)), positions), counts)
        anchor = torch.as_tensor(anchor_token, dtype=torch.long, device=device).view(batch, 1)
        positions = torch.arange(self.config.block_size, device=device)[None] + cache.lengths[:, None]
        keys = ContextLengths(cache.lengths, self.row_exact) if self.row_exact or not cache.uniform else None
        hidden = self._layers(self.block_tokens(anchor), positions, cache.view(), keys)
        return self.head(hidden[:, 1:])
