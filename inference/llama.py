"""Llama-family decoder modules (Llama, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) that
write into and attend over a static KV cache. Parameter names match transformers, so a ``*ForCausalLM`` state dict
loads as-is. :class:`inference.runner.ModelRunner` drives them.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import apply_rope
from core.kernels import exact_cpu
from core.kernels.exact_cpu import KeyLists

# Exact mode (one row on a CPU, bf16 or fp32): a token's logits are bitwise the same whether it is decoded alone or
# verified inside a chain, tree or grid, so greedy speculative output equals AR's token for token. Attention, RMSNorm's
# scale, SiLU and the fp32 linears run in core.kernels.exact_cpu, whose results are fixed per row by construction:
# each token attends over its own keys in path order, whatever else the call holds. bf16 linears stay oneDNN's packed
# GEMM, called with at least two rows (a lone row is doubled) and at most EXACT_ROWS; that their rows do not depend
# on the row count is a property of the host's kernels, which inference.exactness probes before the mode claims
# anything.
EXACT_ROWS = 64


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
        exact: KeyLists | None = None,
    ) -> torch.Tensor:
        """``exact``: in exact mode, each new token's keys; the caches are then fp32, keys transposed
        ([B, kv_heads, D, slots]), and ``x`` may hold more rows than new tokens (a doubled lone row)."""
        if exact is not None:
            return self._exact_forward(x, cos, sin, k_cache, v_cache, write_index, exact)
        batch, new, _ = x.shape
        q, k, v = self._qkv(x)
        # Write the new K/V into each row's own slots (an int: every row's first slot, rows equally long; else
        # (rows [B, 1], slots [B, T])), then attend over the first attend_len slots. Slice copies and index_put:
        # scatter_ into a cache view copied the whole cache per call in bf16.
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(write_index, int):
            k_cache[:, :, write_index:write_index + new] = k
            v_cache[:, :, write_index:write_index + new] = v
        else:
            rows, slots = write_index
            k_cache[rows, :, slots] = k.transpose(1, 2)
            v_cache[rows, :, slots] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            k_cache[:, :, :attend_len],
            v_cache[:, :, :attend_len],
            attn_mask=mask,
            is_causal=is_causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, new, -1))

    def _qkv(self, x: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D], k and v [B, kv_heads, T, D], before RoPE."""
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, exact), self.k_norm(k, exact)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _exact_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, write_index: int, keys: KeyLists) -> torch.Tensor:
        rows, new = x.shape[1], keys.tokens
        q, k, v = (t[:, :, :new] for t in self._qkv(x, exact=True))  # the rows beyond `new` are copies
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[0, :, :, write_index:write_index + new] = k[0].transpose(1, 2)  # transposed, fp32
        v_cache[0, :, write_index:write_index + new] = v[0]
        out = exact_cpu.attention(q[0].transpose(0, 1), k_cache[0], v_cache[0], keys).to(x.dtype)
        out = out.reshape(1, new, -1)
        if rows > new:
            out = out.expand(1, rows, out.shape[-1]).contiguous()
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, out_bias, qk_norm)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args, exact: KeyLists | None = None) -> torch.Tensor:
        if exact is None:
            x = x + self.self_attn(self.input_layernorm(x), *attn_args)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x, exact=True), *attn_args, exact=exact)
        mlp, h = self.mlp, self.post_attention_layernorm(x, exact=True)
        return x + mlp.down_proj(exact_cpu.silu(mlp.gate_proj(h)).to(h.dtype) * mlp.up_proj(h))


class Decoder(nn.Module):
    """The ``model.`` part of a transformers ``*ForCausalLM``: embeddings, layers, final norm."""

    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, out_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
