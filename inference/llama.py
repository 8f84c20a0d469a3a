"""Llama-family decoder modules (Llama, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) that
write into and attend over a static KV cache. Parameter names match transformers, so a ``*ForCausalLM`` state dict
loads as-is. :class:`inference.runner.ModelRunner` drives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import apply_rope

# Batch-invariant mode (bf16 on a CPU, one row): a token's logits are then bitwise the same whether it is
# decoded alone or verified inside a chain, tree or grid, so greedy speculative output equals AR's exactly. Three
# facts of the CPU kernels make it work (tests/test_batch_invariant.py checks them on SmolLM2's shapes): the
# packed oneDNN bf16 linear (``Linear``) gives each row the same result whatever the other rows of the call; SDPA's
# per-row reductions do not depend on the attended length once it is padded to a multiple of INVARIANT_KV_BLOCK
# with masked slots, nor on the number of query rows from 2 up to INVARIANT_ROWS (a lone row takes another path,
# so it is doubled). Forwards therefore run in chunks of at most INVARIANT_ROWS tokens over padded lengths.
INVARIANT_ROWS = 64
INVARIANT_KV_BLOCK = 64



@dataclass(frozen=True)
class GatheredKeys:
    """Per new token of a one-row forward, the cache slots it attends to, in order ([T, L], padded), and which
    of those L entries are real ([T, L] bool). The first ``shared`` slots are the same for every token (the
    cached text and any common ancestors): they are copied once per token straight from the cache, and only the
    rest goes through an index gather."""

    index: torch.Tensor
    mask: torch.Tensor
    shared: int

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Each token's keys (or values) from one row's cache [kv_heads, S, D], contiguous: [T, kv_heads, L, D]."""
        tokens, length = self.index.shape
        out = cache.new_empty(tokens, cache.shape[0], length, cache.shape[-1])
        out[:, :, :self.shared] = cache[:, :self.shared]  # broadcast over the tokens
        out[:, :, self.shared:] = cache[:, self.index[:, self.shared:]].transpose(0, 1)
        return out


def gathered_keys(allowed: torch.Tensor) -> GatheredKeys | None:
    """For a one-row mask over slots ([T, S] bool): None when every token's keys are slots 0..n-1 (a chain: the
    plain attention is already batch-invariant), else where to gather each token's keys from. A tree or grid
    leaves gaps between a node's ancestors, and a gap changes how the kernel pairs and sums the keys."""
    counts = allowed.sum(-1)
    slots = torch.arange(allowed.shape[-1], device=allowed.device)
    if bool((allowed == (slots < counts[:, None])).all()):
        return None
    length = -(-int(counts.max()) // INVARIANT_KV_BLOCK) * INVARIANT_KV_BLOCK
    index = torch.argsort((~allowed).to(torch.uint8), dim=-1, stable=True)[:, :length]  # allowed slots first, in order
    shared = int(allowed.all(0).to(torch.uint8).cumprod(0).sum())  # leading slots every token attends to
    return GatheredKeys(index, slots[:length] < counts[:, None], min(shared, length))


class Attention(nn.Module):
    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=out_bias)
        # Qwen3: RMSNorm over each head's vector, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_index: tuple[torch.Tensor, torch.Tensor] | int,
        attend_len: int,
        mask: torch.Tensor | None,
        is_causal: bool,
        invariant: bool | GatheredKeys = False,
    ) -> torch.Tensor:
        """``invariant``: True in batch-invariant mode; a :class:`GatheredKeys` when, in that mode, some new token's
        keys are not one contiguous run of slots (a tree or grid mask)."""
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write the new K/V into each row's own slots (an int: every row's first slot, rows equally long; else
        # (rows [B, 1], slots [B, T])), then attend over the first attend_len slots. Slice copies and index_put:
        # scatter_ into a cache view copied the whole cache per call in bf16.
        if isinstance(write_index, int):
            k_cache[:, :, write_index:write_index + new] = k
            v_cache[:, :, write_index:write_index + new] = v
        else:
            rows, slots = write_index
            k_cache[rows, :, slots] = k.transpose(1, 2)
            v_cache[rows, :, slots] = v.transpose(1, 2)
        if isinstance(invariant, GatheredKeys):
            out = self._gathered_attention(q, k_cache, v_cache, invariant)
            return self.o_proj(out.transpose(1, 2).reshape(batch, new, -1))
        if invariant and new == 1:
            # SDPA takes another path for a single query row, whose rounding differs from the multi-row one: a
            # copy of the row makes a decode step compute exactly what a verification computes for that token.
            # (a real copy: a stride-0 expand takes yet another path)
            q, mask = q.repeat(1, 1, 2, 1), mask.repeat(1, 1, 2, 1)
        out = F.scaled_dot_product_attention(
            q,
            k_cache[:, :, :attend_len],
            v_cache[:, :, :attend_len],
            attn_mask=mask,
            is_causal=is_causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )[:, :, :new]
        return self.o_proj(out.transpose(1, 2).reshape(batch, new, -1))

    def _gathered_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            keys: GatheredKeys) -> torch.Tensor:
        """Each new token of one row attends over its own keys moved into contiguous slots, one SDPA batch entry
        per token: exactly the computation of decoding it after its own path ([1, heads, T, D])."""
        k, v = keys.gather(k_cache[0]), keys.gather(v_cache[0])  # [T, kv_heads, L, D]
        q = q[0].transpose(0, 1).unsqueeze(2).repeat(1, 1, 2, 1)  # [T, heads, 2, D]: a doubled row, as a decode
        mask = keys.mask[:, None, None, :].repeat(1, 1, 2, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return out[:, :, 0].transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, out_bias, qk_norm)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` part of a transformers ``*ForCausalLM``: embeddings, layers, final norm."""

    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, out_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
