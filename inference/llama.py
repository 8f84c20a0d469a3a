"""Llama-family decoder modules (Llama, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm, Qwen3-MoE
and Qwen2-MoE with sparse expert MLPs) that write into and attend over a static KV cache. Parameter names match
transformers, so a ``*ForCausalLM`` state dict loads as-is. :class:`inference.runner.ModelRunner` drives them.
"""

from __future__ import annotations

import copy

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
        part = x[:, lo : lo + EXACT_ROWS]
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
            k_cache[:, :, write_index : write_index + new] = k
            v_cache[:, :, write_index : write_index + new] = v
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

    def _exact_forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_index: tuple[torch.Tensor, torch.Tensor] | int,
        keys: KeyLists,
    ) -> torch.Tensor:
        """Exact mode: ``x`` [1, N, hidden] holds the new tokens of ``keys.rows`` cache rows, row by row (N = rows
        * tokens, or 2 for a doubled lone token); cos and sin [rows, 1, T, D]; the layer's caches are fp32, keys
        transposed ([B, kv_heads, D, slots]); ``write_index`` as :meth:`forward`'s."""
        batch, new = keys.rows, keys.tokens
        tokens, rows = batch * new, x.shape[1]  # rows beyond `tokens` are copies

        def project(linear: Linear, heads: int) -> torch.Tensor:
            return exact_linear(linear, x)[0, :tokens].view(batch, new, heads, self.head_dim)

        q, k, v = (
            project(self.q_proj, self.num_heads),
            project(self.k_proj, self.num_kv_heads),
            project(self.v_proj, self.num_kv_heads),
        )
        if self.q_norm is not None:
            q, k = self.q_norm(q, exact=True), self.k_norm(k, exact=True)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if isinstance(write_index, int):
            k_cache[:batch, :, :, write_index : write_index + new] = k.transpose(2, 3)  # transposed, fp32
            v_cache[:batch, :, write_index : write_index + new] = v
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


def sparse_layers(config) -> list[bool]:
    """Per decoder layer, whether its MLP is a sparse mixture of experts, as transformers' Qwen3-MoE and Qwen2-MoE
    decide: experts configured, the layer not in ``mlp_only_layers``, its number (from 1) a multiple of
    ``decoder_sparse_step``."""
    layers = config.num_hidden_layers
    if not getattr(config, "num_experts", 0):
        return [False] * layers
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _view_linear(weight: torch.Tensor) -> Linear:
    """A :class:`Linear` over ``weight`` [out, in] (a view, not a copy): it runs what a dense linear runs."""
    linear = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class Experts(nn.Module):
    """Qwen3-MoE's and Qwen2-MoE's experts as transformers stores them: ``gate_up_proj`` [E, 2 * I, H] (gate rows,
    then up rows) and ``down_proj`` [E, H, I]."""

    def __init__(self, config):
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))

    def linears(self, expert: int) -> tuple[Linear, Linear]:
        """Expert ``expert``'s two projections as :class:`Linear` views of the stacked weights (made on first use and
        again when the weights change), so that each runs a dense linear's path: packed bf16 weights, exact kernels."""
        stamp = (
            self.gate_up_proj.data_ptr(),
            self.down_proj.data_ptr(),
            self.gate_up_proj._version,
            self.down_proj._version,
            self.gate_up_proj.dtype,
        )
        views = self.__dict__.get("_views")  # not submodules: the state dict stays transformers'
        if views is None or views[0] != stamp:
            views = (
                stamp,
                [
                    (_view_linear(self.gate_up_proj[e]), _view_linear(self.down_proj[e]))
                    for e in range(self.gate_up_proj.shape[0])
                ],
            )
            self.__dict__["_views"] = views
        return views[1][expert]


def exact_mlp(mlp: MLP, h: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP over ``h`` [1, N, H] by exact mode's rules (the linears by :func:`exact_linear`)."""
    gated = exact_cpu.silu(exact_linear(mlp.gate_proj, h)).to(h.dtype) * exact_linear(mlp.up_proj, h)
    return exact_linear(mlp.down_proj, gated)


class SparseMoe(nn.Module):
    """A sparse mixture-of-experts MLP with transformers' names (``mlp.gate.weight``, ``mlp.experts.*``; Qwen2-MoE's
    ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``), computed as transformers computes it: router
    logits in the model dtype; their softmax over every expert in fp32; the ``num_experts_per_tok`` most probable,
    their probabilities divided by their sum when ``norm_topk_prob``, cast to the model dtype; each chosen expert's
    SwiGLU output times its weight, added to zeros in increasing expert order; then, with a shared expert, plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN  # transformers is heavy: imported when a model is built

        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.top_k = config.num_experts_per_tok
        self.normalize = bool(config.norm_topk_prob)
        self.inner = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = self.shared_expert_gate = None
        if shared:  # Qwen2-MoE: a dense expert every token takes, scaled by its own sigmoid gate
            shared_config = copy.copy(config)
            shared_config.intermediate_size = shared
            self.shared_expert = MLP(shared_config)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``x`` [B, T, H]. ``exact``: exact mode's rules (x is [1, N, H], a lone bf16 token already doubled): the
        router's and the shared expert's linears as dense ones, the routing's softmax and top-k in
        ``core.kernels.exact_cpu.route``, each expert's linears over the rows routed to it as dense linears run (at
        most EXACT_ROWS rows a call, a lone bf16 row doubled), SiLU and the sigmoid in the exact kernels. A row's sum
        is over its own experts in a fixed order, and no kernel mixes rows except the linears, whose rows obey exact
        mode's rules: each row's output depends on that row alone (docs/numerics.md §3.6)."""
        flat = x.reshape(-1, x.shape[-1])
        if exact:
            weights, chosen = exact_cpu.route(exact_linear(self.gate, flat[None])[0], self.top_k, self.normalize)
        else:
            probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():  # increasing, as transformers adds them
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            y = self._expert(expert, flat[token], exact)
            out[token] += y * weights[token, slot, None]  # each token once per expert (index_add_ is slow on a CPU)
        if self.shared_expert is not None:
            if exact:
                gate = exact_cpu.sigmoid(exact_linear(self.shared_expert_gate, flat[None])[0]).to(x.dtype)
                out = out + gate * exact_mlp(self.shared_expert, flat[None])[0]
            else:
                out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)

    def _expert(self, expert: int, rows: torch.Tensor, exact: bool) -> torch.Tensor:
        """One expert's SwiGLU over ``rows`` [n, H]."""
        gate_up, down = self.experts.linears(expert)
        if not exact:
            gate_up.exact = down.exact = False
            gate, up = gate_up(rows).split(self.inner, dim=-1)
            return down(self.act_fn(gate) * up)
        gate_up.exact = down.exact = True
        count = rows.shape[0]
        if count == 1 and rows.dtype != torch.float32:  # a lone bf16 row doubled, as every bf16 call of the mode
            rows = rows.expand(2, -1)
        gate, up = exact_linear(gate_up, rows[None].contiguous())[0].split(self.inner, dim=-1)
        gated = exact_cpu.silu(gate).to(up.dtype) * up
        return exact_linear(down, gated[None].contiguous())[0, :count]


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool, sparse: bool = False):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, out_bias, qk_norm)
        self.mlp = SparseMoe(config) if sparse else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args, exact: KeyLists | None = None) -> torch.Tensor:
        if exact is None:
            x = x + self.self_attn(self.input_layernorm(x), *attn_args)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x, exact=True), *attn_args, exact=exact)
        mlp, h = self.mlp, self.post_attention_layernorm(x, exact=True)
        return x + (mlp(h, exact=True) if isinstance(mlp, SparseMoe) else exact_mlp(mlp, h))


class Decoder(nn.Module):
    """The ``model.`` part of a transformers ``*ForCausalLM``: embeddings, layers, final norm."""

    def __init__(self, config, qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        # (_weight: no random init; a runner builds this on the meta device and loads the target's weights)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, out_bias, qk_norm, sparse) for sparse in sparse_layers(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
