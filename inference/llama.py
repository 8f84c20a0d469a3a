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

# Exact mode (CPU rows, bf16 or fp32): a token's logits are bitwise the same whether it is decoded alone or verified
# inside a chain, tree or grid, and whatever other rows share the batch, so greedy speculative output equals AR's token
# for token. Attention, RMSNorm's scale, SiLU and the fp32 linears run in core.kernels.exact_cpu, whose results are
# fixed per row by construction: each token attends over its own row's keys in path order, whatever else the call
# holds. Linears run on the flattened tokens of every row; bf16 linears stay oneDNN's packed GEMM, called with at
# least two rows (a lone row is doubled) and at most EXACT_ROWS (exact_linear); that their rows do not depend on the
# row count is a property of the host's kernels, which inference.exactness probes before the mode claims anything.
EXACT_ROWS = 64


def exact_linear(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` over the rows of ``x`` [1, N, K] in calls of at most EXACT_ROWS rows, a lone bf16 row doubled: the
    call sizes the probe checks, whatever N a batch of rows makes."""
    rows = x.shape[1]
    if rows <= EXACT_ROWS:
        return linear(x)
    parts = []
    for lo in range(0, rows, EXACT_ROWS):
        part = x[:, lo:lo + EXACT_ROWS]
        if part.shape[1] == 1 and x.dtype != torch.float32:
            parts.append(linear(part.expand(1, 2, -1).contiguous())[:, :1])
        else:
            parts.append(linear(part))
    return torch.cat(parts, dim=1)


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
        """``exact``: in exact mode, each new token's keys (:meth:`_exact_forward`)."""
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

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D], k and v [B, kv_heads, T, D], before RoPE."""
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _exact_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, write_index: tuple[torch.Tensor, torch.Tensor] | int,
                       keys: KeyLists) -> torch.Tensor:
        """Exact mode: ``x`` [1, N, hidden] holds the new tokens of ``keys.rows`` cache rows, row by row (N = rows
        * tokens, or 2 for a doubled lone token); cos and sin [rows, 1, T, D]; the layer's caches are fp32, keys
        transposed ([B, kv_heads, D, slots]); ``write_index`` as :meth:`forward`'s."""
        batch, new = keys.rows, keys.tokens
        tokens, rows = batch * new, x.shape[1]  # rows beyond `tokens` are copies

        def project(linear: Linear, heads: int) -> torch.Tensor:
            return exact_linear(linear, x)[0, :tokens].view(batch, new, heads, self.head_dim)

        q, k, v = project(self.q_proj, self.num_heads), project(self.k_proj, self.num_kv_heads), \
            project(self.v_proj, self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q, exact=True), self.k_norm(k, exact=True)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if isinstance(write_index, int):
            k_cache[:batch, :, :, write_index:write_index + new] = k.transpose(2, 3)  # transposed, fp32
            v_cache[:batch, :, write_index:write_index + new] = v
        else:
            index, slots = write_index
            k_cache[index, :, :, slots] = k.permute(0, 2, 1, 3).to(k_cache.dtype)
            v_cache[index, :, slots] = v.transpose(1, 2).to(v_cache.dtype)
        if batch == 1:
            out = exact_cpu.attention(q[0].transpose(0, 1), k_cache[0], v_cache[0], keys)
        else:
            out = exact_cpu.attention_rows(q.transpose(1, 2), k_cache[:batch], v_cache[:batch], keys)
        out = out.to(x.dtype).reshape(1, tokens, -1)
        if rows > tokens:
            out = out.expand(1, rows, out.shape[-1]).contiguous()
        return exact_linear(self.o_proj, out)


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
        gated = exact_cpu.silu(exact_linear(mlp.gate_proj, h)).to(h.dtype) * exact_linear(mlp.up_proj, h)
        return x + exact_linear(mlp.down_proj, gated)


class Decoder(nn.Module):
    """The ``model.`` part of a transformers ``*ForCausalLM``: embeddings, layers, final norm."""

    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, out_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
