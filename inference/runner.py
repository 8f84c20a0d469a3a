"""Target-model runners: one forward for chains, trees and grids over a KV cache.

Two implementations share one interface (DESIGN §5):

* :class:`ModelRunner` -- our own Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2 with qkv bias,
  Qwen3 with q/k RMSNorm) built from a transformers config + state dict, with a preallocated static KV
  cache. CPU fp32 for tests, CUDA bf16 with ``scaled_dot_product_attention``. Modelled on gpt-fast: plain
  modules, no per-token Python loops, static cache tensors.
* :class:`TransformersRunner` -- any transformers causal LM through its ``DynamicCache`` and a custom 4D
  mask. Slower (transformers' per-call overhead, a float mask over the whole cache, cache compaction by
  copying), but it covers architectures :class:`ModelRunner` does not.

The common contract
-------------------
Each batch row ``b`` holds ``cache_lens[b]`` cached tokens. ``forward(input_ids[B, T])`` appends T new
tokens to every row: row ``b``'s new token ``t`` is stored right after that row's cache (cache slot
``cache_lens[b] + t``) and ``cache_lens`` advances by T. ``positions`` (RoPE / position ids) default to
``cache_lens[b] + t`` but may be given explicitly, so tree nodes at the same depth share a position.

**Attention mask convention.** ``attention_mask`` is a BoolTensor ``[B, T, P + T]`` with
``P = max(cache_lens)`` before the forward; True = may attend. Column ``j < P`` is cached token ``j`` of
the row (columns ``j >= cache_lens[b]`` of a shorter row are padding and always masked out by the runner);
column ``P + u`` is new token ``u`` of this forward, whatever the row's length. The short form
``[B, T, T]`` gives only the new-token part and lets every new token see the row's whole cache. A 2D mask
(``[T, P + T]`` or ``[T, T]``) is shared by all rows. ``None`` means causal: all of the row's cache plus
new tokens ``0..t``. A new token always attends to itself, whatever the mask says (so no softmax row is
empty).

After verification, ``commit(kept)`` keeps only the accepted new tokens (indices into the last forward's
T tokens, increasing), moving their K/V to be contiguous after the pre-forward length; ``truncate(n)``
rolls rows back to length n; ``reset()`` empties the cache.

**Hidden capture convention.** ``capture_layers=(i, ...)``: layer ``i`` (0-based, negative counts from
the end) is the OUTPUT of decoder layer ``i``, i.e. transformers' ``output_hidden_states[i + 1]`` for
``i < L - 1`` (transformers stores the final-normed state at ``[L]``; we return the raw output of the last
layer there). ``last_hidden`` is the final hidden AFTER the final norm, so ``lm_head(last_hidden) ==
logits``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import apply_rope, rope_cos_sin, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
KeptIndices = torch.Tensor | Sequence[Sequence[int]]

# Batch-invariant mode (bf16 on a CPU, one row): a token's logits are then bitwise the same whether it is
# decoded alone or verified inside a chain, tree or grid, so greedy speculative output equals AR's exactly. Three
# facts of the CPU kernels make it work (tests/test_batch_invariant.py checks them on SmolLM2's shapes): the
# packed oneDNN bf16 linear (``Linear``) gives each row the same result whatever the other rows of the call; SDPA's
# per-row reductions do not depend on the attended length once it is padded to a multiple of INVARIANT_KV_BLOCK
# with masked slots, nor on the number of query rows from 2 up to INVARIANT_ROWS (a lone row takes another path,
# so it is doubled). Forwards therefore run in chunks of at most INVARIANT_ROWS tokens over padded lengths.
INVARIANT_ROWS = 64
INVARIANT_KV_BLOCK = 64


@dataclass
class RunnerOutput:
    """``logits``: float32 [B, T, V] (or the requested rows only); ``hidden``: captured layer
    outputs {layer index: [B, T, H]}; ``last_hidden``: final-normed hidden [B, T, H] when requested."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    last_hidden: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------------
# Config checks shared by both runners


def _logit_rows(only_last: bool, rows: slice | None) -> slice:
    if only_last and rows is not None:
        raise ValueError("pass only_last_logits or logit_rows, not both")
    return slice(-1, None) if only_last else rows if rows is not None else slice(None)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 matmuls of a few rows cost what
    one row costs, and verification of a chain or tree is nearly free, as on a GPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_windows(config) -> dict[str, int | None]:
    """Layer type -> sliding window (None = full attention), as transformers applies it.

    With ``config.layer_types`` (Gemma-2/3, Qwen2/3, Cohere-2, OLMo-3, ...) the window applies to the
    ``sliding_attention`` layers only; without it (Mistral, Phi-3, Starcoder2) ``sliding_window``, when set, applies
    to every layer (key ``"all"``). Other layer kinds (chunked, linear or hybrid attention) are refused."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"all": window}
    unknown = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{config.model_type} has {unknown} attention layers, which spectrain's runners do not "
                         f"serve (they serve {', '.join(ATTENTION_LAYER_TYPES)})")
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(layer_types)}


def window_matters(config, max_seq_len: int) -> bool:
    """Whether some layer's sliding window is shorter than the context, so it changes the result."""
    return any(w is not None and w < max_seq_len for w in attention_windows(config).values())


def _check_sliding_window(config, max_seq_len: int) -> None:
    """ModelRunner uses full attention; refuse configs where a sliding window would change the result."""
    if window_matters(config, max_seq_len):
        window = min(w for w in attention_windows(config).values() if w is not None)
        raise ValueError(
            f"{config.model_type} uses a sliding window of {window} < max_seq_len={max_seq_len}, which ModelRunner "
            f"does not implement; load it with backend=auto or backend=transformers (TransformersRunner applies it)"
        )


def _normalize_layers(capture_layers: Sequence[int], num_layers: int) -> list[int]:
    layers = []
    for layer in capture_layers:
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"capture layer {layer} out of range for a {num_layers}-layer model")
        layers.append(layer % num_layers)
    return layers


def _overflow_check(needed: int, max_seq_len: int) -> None:
    if needed > max_seq_len:
        raise ValueError(
            f"forward needs {needed} cache slots but the runner has max_seq_len={max_seq_len}; "
            f"build it with max_seq_len={needed} or more"
        )


def _full_user_mask(mask: torch.Tensor, batch: int, new: int, cached: int) -> torch.Tensor:
    """Normalise a user mask to BoolTensor [B, T, P + T] (see the module docstring for the convention)."""
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if mask.dim() != 3 or mask.shape[1] != new or mask.shape[-1] not in (new, cached + new):
        raise ValueError(
            f"attention_mask must be [B, {new}, {cached + new}] or [B, {new}, {new}], got {tuple(mask.shape)}"
        )
    mask = mask.to(torch.bool).expand(batch, -1, -1)
    if mask.shape[-1] == new and cached > 0:  # short form: the whole cache is visible
        mask = torch.cat([mask.new_ones(batch, new, cached), mask], dim=-1)
    return mask


def _kept_to_tensor(
    kept: KeptIndices, batch: int, new: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate kept indices; return (padded indices LongTensor[B, K], per-row counts LongTensor[B])."""
    if isinstance(kept, torch.Tensor):
        kept = kept.to(device=device, dtype=torch.long)
        if kept.dim() == 1:
            kept = kept.unsqueeze(0).expand(batch, -1)
        if kept.dim() != 2 or kept.shape[0] != batch:
            raise ValueError(f"commit expects kept indices [B={batch}, K], got {tuple(kept.shape)}")
        counts = torch.full((batch,), kept.shape[1], dtype=torch.long, device=device)
        rows = kept.tolist()
    else:
        rows = [list(map(int, row)) for row in kept]
        if len(rows) != batch:
            raise ValueError(f"commit expects one index list per row ({batch}), got {len(rows)}")
        width = max((len(row) for row in rows), default=0)
        # Pad with the row's own last index: the padded moves land beyond the row's new length (harmless).
        padded = [row + [row[-1] if row else 0] * (width - len(row)) for row in rows]
        kept = torch.tensor(padded, dtype=torch.long, device=device).reshape(batch, width)
        counts = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)
    for row in rows:
        if any(not 0 <= i < new for i in row) or any(a >= b for a, b in itertools.pairwise(row)):
            raise ValueError(f"kept indices must be increasing and within 0..{new - 1}, got {row}")
    return kept, counts


# ----------------------------------------------------------------------------------------------------------
# Llama-family modules (parameter names match transformers so the state dict loads as-is)


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


def check_logit_vocab(vocab: int | None, vocab_size: int) -> int | None:
    """``None`` / 0 = the whole vocabulary; otherwise 1..vocab_size."""
    if not vocab:
        return None
    if not 1 <= vocab <= vocab_size:
        raise ValueError(f"draft_vocab={vocab} is outside 1..{vocab_size} (the model's vocabulary); use 0 for all ids")
    return None if vocab == vocab_size else int(vocab)


def limited_logits(scored: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 logits over the whole vocabulary from ``scored`` (the lowest ids); ids beyond it get -inf, so their
    probability is exactly 0 under any temperature, top-k or top-p."""
    full = scored.new_full((*scored.shape[:-1], vocab_size), float("-inf"), dtype=torch.float32)
    full[..., : scored.shape[-1]] = scored
    return full


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


# ----------------------------------------------------------------------------------------------------------


class ModelRunner(nn.Module):
    """Llama-family decoder with a static KV cache; see the module docstring for the forward contract.

    The KV cache is ``k_cache[layer] -> [B, kv_heads, max_seq_len, head_dim]`` (same for ``v_cache``), with
    per-row lengths ``cache_lens: LongTensor[B]``. Built with :meth:`from_config` or :meth:`from_hf_model`.
    """

    def __init__(
        self,
        config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        batch_invariant: bool | None = None,
    ):
        """``batch_invariant`` (default: on for a bf16 CPU runner of one row) runs forwards in the
        batch-invariant mode described at ``INVARIANT_ROWS``."""
        super().__init__()
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ModelRunner supports model_type in {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use TransformersRunner (or load_runner) for other architectures"
            )
        _check_sliding_window(config, max_seq_len)
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        out_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        with torch.device("meta"):  # weights come from the state dict; don't allocate them twice
            self.model = Decoder(config, qkv_bias, out_bias, qk_norm=model_type == "qwen3")
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        inv_freq, self.rope_scale = rope_inv_freq(config, self.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        if batch_invariant is None:
            # bf16 only: the row-invariant packed linear is bf16's (fp16 runs F.linear, whose rows are not invariant)
            batch_invariant = device.type == "cpu" and dtype == torch.bfloat16 and max_batch_size == 1
        self.batch_invariant = batch_invariant
        # Invariant mode pads the attended length up to a block: the cache holds the padding of its last block.
        slots = -(-max_seq_len // INVARIANT_KV_BLOCK) * INVARIANT_KV_BLOCK if batch_invariant else max_seq_len
        cache_shape = (self.num_layers, max_batch_size, self.num_kv_heads, slots, self.head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )
        self.cache_lens = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._pending: tuple[torch.Tensor, int] | None = None  # (lengths before the last forward, its T)
        self._dtype = dtype
        self.logit_vocab: int | None = None  # see with_logit_vocab

    # -- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config,
        state_dict: dict[str, torch.Tensor],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
        batch_invariant: bool | None = None,
    ) -> ModelRunner:
        """Build from a transformers config and its HF-named state dict
        (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight`` or tied to
        ``model.embed_tokens.weight``). Default dtype: fp32 on CPU, bf16 on CUDA. Weights already on
        ``device`` in ``dtype`` are shared with the state dict, not copied."""
        device = torch.device(device)
        dtype = dtype or _default_dtype(device)
        runner = cls(
            config, device=device, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            batch_invariant=batch_invariant,
        )
        runner._load_weights(state_dict, device, dtype)
        return runner

    @classmethod
    def from_hf_model(cls, model: nn.Module, **kw) -> ModelRunner:
        """Build from a transformers ``PreTrainedModel`` (its config + state dict); ``device`` defaults to the
        model's device. Other keywords as :meth:`from_config`."""
        kw.setdefault("device", next(model.parameters()).device)
        return cls.from_config(model.config, model.state_dict(), **kw)

    def _load_weights(
        self, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
    ) -> None:
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        weights = {
            name: tensor
            for name, tensor in state_dict.items()
            if "rotary_emb." not in name and not (tied and name == "lm_head.weight")
        }
        own = set(self.model.state_dict(prefix="model.")) | ({"lm_head.weight"} if not tied else set())
        missing, unexpected = sorted(own - set(weights)), sorted(set(weights) - own)
        if missing or unexpected:
            raise ValueError(
                f"state dict does not match a {self.config.model_type} model: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
        self.load_state_dict(weights, strict=False, assign=True)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in (self.model, self.lm_head):
            module.to(device=device, dtype=dtype)
        self.requires_grad_(False)
        self.eval()

    # -- modules drafters reuse ------------------------------------------------------------------------------

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.model.norm

    @property
    def device(self) -> torch.device:
        return self.cache_lens.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def batch_size(self) -> int:
        return self.cache_lens.shape[0]

    # -- cache state -----------------------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        """Cached tokens per row."""
        return self.cache_lens.tolist()

    def length(self, row: int = 0) -> int:
        return int(self.cache_lens[row])

    def reset(self, batch_size: int | None = None) -> None:
        """Empty the cache; optionally change the active batch size (at most ``max_batch_size``)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size {batch_size} outside 1..max_batch_size={self.max_batch_size}")
        self.cache_lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._pending = None

    @torch.no_grad()
    def select_rows(self, rows: Sequence[int], length: int) -> None:
        """Rebuild the batch from existing rows: new row i holds a copy of current row ``rows[i]``'s first
        ``length`` cached tokens (forking branches from one prefix, keeping a surviving branch)."""
        if not 1 <= len(rows) <= self.max_batch_size:
            raise ValueError(f"{len(rows)} rows outside 1..max_batch_size={self.max_batch_size}")
        shortest = min(self.length(r) for r in rows)
        if not 0 <= length <= shortest:
            raise ValueError(f"select_rows keeps {length} tokens but the chosen rows hold only {shortest}")
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        for cache in (self.k_cache, self.v_cache):
            cache[:, : len(rows), :, :length] = cache[:, index, :, :length]  # the gather copies before writing
        self.cache_lens = torch.full((len(rows),), length, dtype=torch.long, device=self.device)
        self._pending = None

    @contextlib.contextmanager
    def row_block(self, start: int, stop: int) -> Iterator[None]:
        """Inside the block, forwards see only cache rows ``start..stop-1`` (a view, starting empty): a prefill of a
        few prompts into spare rows costs those rows only, not a padded forward over the whole batch. The batch's
        rows and lengths are restored on exit; :meth:`copy_rows` then moves the prefilled rows into place."""
        if not 0 <= start < stop <= self.max_batch_size:
            raise ValueError(f"row block {start}..{stop} outside 0..max_batch_size={self.max_batch_size}")
        saved = (self.k_cache, self.v_cache, self.cache_lens, self._pending)
        self.k_cache, self.v_cache = saved[0][:, start:stop], saved[1][:, start:stop]
        self.cache_lens = torch.zeros(stop - start, dtype=torch.long, device=self.device)
        self._pending = None
        try:
            yield
        finally:
            self.k_cache, self.v_cache, self.cache_lens, self._pending = saved

    @contextlib.contextmanager
    def first_rows(self, n: int) -> Iterator[None]:
        """Inside, forwards see only the batch's rows ``0..n-1``, with their cached tokens; the rows after them sit
        out untouched. A continuous batch whose active rows are the first few pays for those rows only."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"first_rows({n}) outside 1..batch_size={self.batch_size}")
        rest = self.cache_lens[n:]
        self.cache_lens, self._pending = self.cache_lens[:n].clone(), None
        try:
            yield
        finally:
            self.cache_lens, self._pending = torch.cat([self.cache_lens, rest]), None

    @torch.no_grad()
    def copy_rows(self, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Row ``dst[i]`` of the batch becomes a copy of cache row ``src[i]``'s first ``lengths[i]`` tokens (``src``
        may lie outside the active batch, e.g. rows a :meth:`row_block` prefilled)."""
        for s, d, n in zip(src, dst, lengths):
            if not 0 <= d < self.batch_size or not 0 <= s < self.max_batch_size or not 0 <= n <= self.max_seq_len:
                raise ValueError(f"copy_rows {s} -> {d} ({n} tokens) outside the cache")
            for cache in (self.k_cache, self.v_cache):
                cache[:, d, :, :n] = cache[:, s, :, :n]
        lens = self.cache_lens.clone()
        lens[torch.as_tensor(list(dst), dtype=torch.long, device=self.device)] = torch.as_tensor(
            list(lengths), dtype=torch.long, device=self.device)
        self.cache_lens = lens
        self._pending = None

    def truncate(self, n: int | torch.Tensor) -> None:
        """Roll every row (or row b to ``n[b]``) back to length ``n``; the dropped K/V become dead slots."""
        new_lens = torch.as_tensor(n, dtype=torch.long, device=self.device).expand(self.batch_size)
        if bool(((new_lens < 0) | (new_lens > self.cache_lens)).any()):
            raise ValueError(f"truncate to {new_lens.tolist()} but lengths are {self.lengths}")
        self.cache_lens = new_lens.clone()
        self._pending = None

    @torch.no_grad()
    def commit(self, kept: KeptIndices) -> None:
        """Keep only the new tokens at ``kept`` (indices 0..T-1 of the last forward, increasing):
        LongTensor[B, K] (same K per row) or one index list per row. Their K/V move to slots
        ``len_before .. len_before + K - 1``."""
        if self._pending is None:
            raise ValueError("commit() needs a forward() first (and only one commit per forward)")
        start, new = self._pending
        batch = self.batch_size
        kept, counts = _kept_to_tensor(kept, batch, new, self.device)
        num_kept = kept.shape[1]
        if num_kept:
            # All layers at once: gather the kept slots, then write them contiguously (gather copies first,
            # so overlapping source/destination ranges are safe).
            # Advanced indexing over (row, slot) of a [layers, B, slots, heads, D] view: the right side is gathered
            # before the write (index_put; scatter_ into this view copied the whole cache per call in bf16).
            src = start[:, None] + kept
            dst = start[:, None] + torch.arange(num_kept, device=self.device)
            rows = torch.arange(batch, device=self.device)[:, None].expand(batch, num_kept)
            for cache in (self.k_cache, self.v_cache):
                slots_first = cache.transpose(2, 3)
                slots_first[:, rows, dst] = slots_first[:, rows, src]
        self.cache_lens = start + counts
        self._pending = None

    # -- forward ---------------------------------------------------------------------------------------------

    def _attention_mask(
        self, user_mask: torch.Tensor | None, slots: torch.Tensor, cached: int, new: int, attend_len: int
    ) -> torch.Tensor:
        """BoolTensor [B, 1, T, attend_len] over physical slots, from the user convention (module docstring) in
        its full form [B, T, P + T]; slots from P + T on (invariant mode's padding) are masked."""
        batch = slots.shape[0]
        slot = torch.arange(attend_len, device=self.device)
        own_slot = slot[None, None, :] == slots[:, :, None]
        if user_mask is None:
            # Row b's new token t sits at slot L_b + t: it sees every slot up to and including its own.
            return (slot[None, None, :] <= slots[:, :, None]).unsqueeze(1)
        lens = self.cache_lens[:, None]
        # Physical slot -> user column: cache slots keep their index, new tokens map to P + t.
        column = torch.where(slot < lens, slot, cached + slot - lens).clamp(max=cached + new - 1)
        in_use = slot < lens + new
        allowed = user_mask.gather(2, column[:, None, :].expand(batch, new, attend_len)) & in_use[:, None, :]
        return (allowed | own_slot).unsqueeze(1)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        capture_layers: Sequence[int] = (),
        return_last_hidden: bool = False,
        only_last_logits: bool = False,
        logit_rows: slice | None = None,
    ) -> RunnerOutput:
        """Run T new tokens per row; see the module docstring for positions, mask and capture conventions.
        ``only_last_logits`` returns logits for the last new token only ([B, 1, V]; saves prefill memory);
        ``logit_rows`` (a slice of the new tokens) returns those rows only: on a CPU the lm_head over a large
        vocabulary is a sizeable share of a step (≈ 12 of ≈ 70 ms for SmolLM2) and grows with the rows, so
        callers that need few rows ask for just those."""
        batch, new = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(
                f"input has batch {batch} but the runner's batch is {self.batch_size}; use reset()"
            )
        shortest, cached = (int(x) for x in torch.aminmax(self.cache_lens))  # the one host sync per forward
        _overflow_check(cached + new, self.max_seq_len)
        capture = _normalize_layers(capture_layers, self.num_layers)
        input_ids = input_ids.to(self.device)
        if positions is not None:
            positions = positions.to(self.device).expand(batch, new)
        user_mask = None if attention_mask is None else _full_user_mask(attention_mask.to(self.device), batch, new,
                                                                        cached)
        start = self.cache_lens
        # Invariant mode on equally long rows: chunks of at most INVARIANT_ROWS tokens, each appended to the cache
        # before the next reads it (a chunk's mask rows over columns up to its own end are the user's own rows).
        step = max(1, INVARIANT_ROWS // batch) if self.batch_invariant and shortest == cached else new
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in capture}
        chunks = []
        for lo in range(0, new, step):
            hi = min(new, lo + step)
            chunks.append(self._layers(
                input_ids[:, lo:hi], None if positions is None else positions[:, lo:hi],
                None if user_mask is None else user_mask[:, lo:hi, :cached + hi], shortest + lo, cached + lo,
                capture, hidden))
        x = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        self._pending = (start, new)

        x = self.model.norm(x)
        rows = x[:, _logit_rows(only_last_logits, logit_rows)]
        if self.batch_invariant and rows.shape[0] * rows.shape[1] > INVARIANT_ROWS:
            per = max(1, INVARIANT_ROWS // rows.shape[0])
            logits = torch.cat([self._logits(rows[:, lo:lo + per]) for lo in range(0, rows.shape[1], per)], dim=1)
        else:
            logits = self._logits(rows)
        return RunnerOutput(logits=logits, hidden={i: torch.cat(h, dim=1) if len(h) > 1 else h[0]
                                                   for i, h in hidden.items()},
                            last_hidden=x if return_last_hidden else None)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        # As one contiguous 2D matmul: a strided 3D input would take a batched path that copies the weight.
        flat = rows.reshape(-1, rows.shape[-1]).contiguous()
        if self.logit_vocab is None:
            logits = self.lm_head(flat).float()
        else:
            logits = limited_logits(self.lm_head(flat, self.logit_vocab).float(), self.config.vocab_size)
        return logits.view(*rows.shape[:-1], logits.shape[-1])

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor | None, user_mask: torch.Tensor | None,
                shortest: int, cached: int, capture: Sequence[int], hidden: dict[int, list[torch.Tensor]]
                ) -> torch.Tensor:
        """Append ``input_ids`` [B, T] to the cache through every decoder layer; returns the last layer's output
        (before the final norm) and adds the captured layers' outputs to ``hidden``."""
        batch, new = input_ids.shape
        # [B, T] physical cache slots of the new tokens
        slots = self.cache_lens[:, None] + torch.arange(new, device=self.device)
        positions = slots if positions is None else positions
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale, self._dtype)  # [B, 1, T, D]
        aligned = shortest == cached
        write_index = cached if aligned else (torch.arange(batch, device=self.device)[:, None], slots)

        attend_len = cached + new
        mask, is_causal = None, False
        invariant: bool | GatheredKeys = self.batch_invariant
        if self.batch_invariant:  # always masked, over a padded length (see INVARIANT_KV_BLOCK)
            attend_len = -(-attend_len // INVARIANT_KV_BLOCK) * INVARIANT_KV_BLOCK
            mask = self._attention_mask(user_mask, slots, cached, new, attend_len)
            if user_mask is not None and batch == 1:
                invariant = gathered_keys(mask[0, 0]) or True
        elif user_mask is not None or not aligned or (new > 1 and cached > 0):
            mask = self._attention_mask(user_mask, slots, cached, new, attend_len)
        elif new > 1:
            # Fast paths when all rows are equally long and the mask is causal: decode needs no mask, a prefill
            # into an empty cache is plain causal attention (lets SDPA use flash kernels on CUDA).
            is_causal = True

        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = self.k_cache[i, :batch], self.v_cache[i, :batch]
            x = layer(x, cos, sin, k_cache, v_cache, write_index, attend_len, mask, is_causal, invariant)
            if i in capture:
                hidden[i].append(x)
        self.cache_lens = self.cache_lens + new
        return x


# ----------------------------------------------------------------------------------------------------------


class TransformersRunner:
    """The same interface over any transformers causal LM (its ``DynamicCache`` plus a custom 4D mask).

    Slower than :class:`ModelRunner`: transformers' per-call overhead, a float mask over the whole cache, and
    rejected tokens stay in the cache as masked-out slots until a commit/truncate compacts it by copying.
    Needs a model whose attention honours a custom 4D mask (``eager`` or ``sdpa`` attention, standard KV
    layers). Sliding windows are applied in that mask, by position (a query at position p sees keys at positions
    > p - window, as transformers does), per layer type where layers differ (transformers takes a mask per type);
    the cache keeps every token, so any context length up to ``max_seq_len`` works.
    """

    def __init__(self, model: nn.Module, *, max_batch_size: int = 1, max_seq_len: int = 2048):
        attn_impl = getattr(model.config, "_attn_implementation", None)
        if attn_impl not in ("eager", "sdpa", None):
            raise ValueError(f"TransformersRunner needs eager or sdpa attention, got {attn_impl!r}")
        self.windows = attention_windows(model.config)
        # transformers >= 5.24 names the cache argument `cache` (`past_key_values` is deprecated there).
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.model = model.eval()
        self.config = model.config
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = self.config.num_hidden_layers
        self.logit_vocab: int | None = None  # see with_logit_vocab
        self._decoder_layers = next(
            (m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == self.num_layers), None
        )
        self.reset(max_batch_size)

    @classmethod
    def from_hf_model(
        cls,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
    ) -> TransformersRunner:
        """Wrap ``model``; a ``device`` / ``dtype`` given moves the model itself (in place)."""
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        return cls(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len)

    # -- modules drafters reuse ------------------------------------------------------------------------------

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def norm(self) -> nn.Module | None:
        base = getattr(self.model, "base_model", self.model)
        return next((getattr(base, n) for n in ("norm", "ln_f", "final_layernorm") if hasattr(base, n)), None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def batch_size(self) -> int:
        return self._slot_valid.shape[0]

    # -- cache state -----------------------------------------------------------------------------------------
    # Physical layout: the DynamicCache holds S slots for every row; _slot_valid[b, s] says whether slot s
    # of row b holds one of its cached tokens. Row b's cached token i is its i-th valid slot.

    @property
    def cache_lens(self) -> torch.Tensor:
        return self._slot_valid.sum(dim=1)

    @property
    def lengths(self) -> list[int]:
        return self.cache_lens.tolist()

    def length(self, row: int = 0) -> int:
        return int(self._slot_valid[row].sum())

    def reset(self, batch_size: int | None = None) -> None:
        """Empty the cache; optionally change the active batch size (at most ``max_batch_size``)."""
        from transformers import DynamicCache  # transformers: a heavy import, deferred to first use

        if batch_size is None:
            batch_size = self.batch_size if hasattr(self, "_slot_valid") else self.max_batch_size
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size {batch_size} outside 1..max_batch_size={self.max_batch_size}")
        self._cache = DynamicCache()
        self._slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self._pending: int | None = None  # physical slot where the last forward's tokens start

    def truncate(self, n: int | torch.Tensor) -> None:
        """As :meth:`ModelRunner.truncate`."""
        new_lens = torch.as_tensor(n, dtype=torch.long, device=self.device).expand(self.batch_size)
        if bool(((new_lens < 0) | (new_lens > self.cache_lens)).any()):
            raise ValueError(f"truncate to {new_lens.tolist()} but lengths are {self.lengths}")
        self._slot_valid &= self._slot_valid.cumsum(dim=1) <= new_lens[:, None]
        self._pending = None
        self._compact()

    def commit(self, kept: KeptIndices) -> None:
        """As :meth:`ModelRunner.commit`."""
        if self._pending is None:
            raise ValueError("commit() needs a forward() first (and only one commit per forward)")
        start = self._pending
        new = self._slot_valid.shape[1] - start
        kept, counts = _kept_to_tensor(kept, self.batch_size, new, self.device)
        # Count-and-compare rather than scatter True: padding entries repeat a row's last index.
        real = (torch.arange(kept.shape[1], device=self.device) < counts[:, None]).long()
        keep = torch.zeros(self.batch_size, new, dtype=torch.long, device=self.device).scatter_add_(
            1, kept, real
        )
        self._slot_valid[:, start:] = keep > 0
        self._pending = None
        self._compact()

    def _compact(self) -> None:
        """Drop dead slots: crop when each row's valid slots are a prefix, else gather them to the front."""
        lens = self.cache_lens
        longest = int(lens.max()) if lens.numel() else 0
        slot = torch.arange(self._slot_valid.shape[1], device=self.device)
        is_prefix = bool((self._slot_valid == (slot < lens[:, None])).all())
        if is_prefix and longest == self._slot_valid.shape[1]:
            return
        # Stable sort puts each row's valid slots first, in order.
        order = torch.sort((~self._slot_valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for layer in getattr(self._cache, "layers", []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if getattr(layer, "is_sliding", False) or keys is None or keys.dim() != 4:
                raise ValueError(f"TransformersRunner cannot compact cache layer {type(layer).__name__}")
            if is_prefix:
                layer.keys, layer.values = keys[:, :, :longest], values[:, :, :longest]
            else:
                index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
                layer.keys, layer.values = keys.gather(2, index), values.gather(2, index)
        self._slot_valid = slot[:longest] < lens[:, None]

    # -- forward ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        capture_layers: Sequence[int] = (),
        return_last_hidden: bool = False,
        only_last_logits: bool = False,
        logit_rows: slice | None = None,
    ) -> RunnerOutput:
        """As :meth:`ModelRunner.forward`."""
        batch, new = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(
                f"input has batch {batch} but the runner's batch is {self.batch_size}; use reset()"
            )
        lens = self.cache_lens
        cached = int(lens.max())
        _overflow_check(cached + new, self.max_seq_len)
        capture = _normalize_layers(capture_layers, self.num_layers)
        device, physical = self.device, self._slot_valid.shape[1]

        arange_new = torch.arange(new, device=device)
        positions = (
            lens[:, None] + arange_new if positions is None else positions.to(device).expand(batch, new)
        )
        new_part = torch.ones(new, new, dtype=torch.bool, device=device).tril().expand(batch, new, new)
        cache_part = self._slot_valid[:, None, :].expand(batch, new, physical)
        if attention_mask is not None:
            user_mask = _full_user_mask(attention_mask.to(device), batch, new, cached)
            # Logical cache column i of row b -> its physical slot (the i-th valid one).
            order = torch.sort((~self._slot_valid).to(torch.int8), dim=1, stable=True).indices[:, :cached]
            mapped = torch.zeros(batch, new, physical, dtype=torch.bool, device=device)
            mapped.scatter_(2, order[:, None, :].expand(batch, new, cached), user_mask[:, :, :cached])
            cache_part = cache_part & mapped
            new_part = user_mask[:, :, cached:] | torch.eye(new, dtype=torch.bool, device=device)
        allowed = torch.cat([cache_part, new_part], dim=-1)[:, None]
        masks = {kind: self._float_mask(allowed, positions, window) for kind, window in self.windows.items()}
        # One mask for every layer, or (models with layer types) one per type, which transformers then uses as-is.
        float_mask = masks["all"] if "all" in masks else masks if len(set(self.windows.values())) > 1 else \
            next(iter(masks.values()))

        hidden: dict[int, torch.Tensor] = {}
        captured_last: list[torch.Tensor] = []
        hooks = []
        if capture:
            if self._decoder_layers is None:
                raise ValueError(f"cannot find the decoder layers of {type(self.model).__name__} to capture")
            for i in capture:
                hooks.append(self._decoder_layers[i].register_forward_hook(self._capture_hook(hidden, i)))
        if return_last_hidden:
            hooks.append(
                self.lm_head.register_forward_pre_hook(lambda m, args: captured_last.append(args[0]))
            )
        try:
            out = self.model(
                input_ids=input_ids.to(device),
                position_ids=positions,
                attention_mask=float_mask,
                **{self._cache_argument: self._cache},
                use_cache=True,
            )
        finally:
            for hook in hooks:
                hook.remove()
        self._cache = out.cache if hasattr(out, "cache") else out.past_key_values
        self._slot_valid = torch.cat([self._slot_valid, self._slot_valid.new_ones(batch, new)], dim=1)
        self._pending = physical
        logits = out.logits[:, _logit_rows(only_last_logits, logit_rows)].float()
        if self.logit_vocab is not None:  # transformers scored every id; the limit still holds exactly
            logits = limited_logits(logits[..., : self.logit_vocab], self.config.vocab_size)
        return RunnerOutput(
            logits=logits,
            hidden=dict(sorted(hidden.items())),
            last_hidden=captured_last[0] if captured_last else None,
        )

    __call__ = forward

    def _float_mask(self, allowed: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive float mask (honoured as-is by eager and sdpa attention in transformers) from ``allowed``
        [B, 1, T, S + T], narrowed to a sliding ``window`` by position: a cached token's position is its index in
        its row (the runner's contract), a new token's is ``positions``."""
        if window is not None:
            cache_positions = self._slot_valid.long().cumsum(dim=1) - 1  # valid slot -> its index in the row
            key_positions = torch.cat([cache_positions, positions], dim=1)
            allowed = allowed & (positions[:, :, None] - key_positions[:, None, :] < window)[:, None]
        float_mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return float_mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    @staticmethod
    def _capture_hook(store: dict[int, torch.Tensor], index: int):
        def hook(module, args, output):
            store[index] = output[0] if isinstance(output, tuple) else output

        return hook


# ----------------------------------------------------------------------------------------------------------


def load_runner(
    model_or_path,
    *,
    backend: str = "auto",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    max_batch_size: int = 1,
    max_seq_len: int = 2048,
    batch_invariant: bool | None = None,
) -> ModelRunner | TransformersRunner:
    """A runner for a transformers model instance (or a local HF model directory): :class:`ModelRunner` for
    supported model types (``backend="auto"`` or ``"native"``) whose sliding window, if any, is no shorter than
    ``max_seq_len``; :class:`TransformersRunner` otherwise or with ``backend="transformers"``. ``batch_invariant``: see :class:`ModelRunner` (None = its default)."""
    if backend not in ("auto", "native", "transformers"):
        raise ValueError(f"backend must be auto, native or transformers, got {backend!r}")
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM  # transformers: a heavy import, deferred to first use

        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype, local_files_only=True)
    kw = {"dtype": dtype, "max_batch_size": max_batch_size, "max_seq_len": max_seq_len}
    if device is not None:
        kw["device"] = device
    # ModelRunner has no sliding window: a config whose window is shorter than the context goes to transformers.
    native = getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES \
        and not window_matters(model.config, max_seq_len)
    if backend == "native" or (backend == "auto" and native):
        return ModelRunner.from_hf_model(model, batch_invariant=batch_invariant, **kw)
    return TransformersRunner.from_hf_model(model, **kw)


def with_logit_vocab(runner: ModelRunner | TransformersRunner, vocab: int | None) -> ModelRunner | TransformersRunner:
    """``runner``'s model (weights shared, not copied) with its own cache, whose logits score only the ``vocab``
    lowest token ids (the rest are -inf). For a draft LM: SmolLM2-style BPE vocabularies are ordered roughly by
    merge frequency, so the lowest ids hold most generated tokens, and on a CPU the lm_head is most of a small
    draft's forward. Lossless wherever the drafter is used: its proposals simply have probability 0 outside the
    range, and verification corrects to the target's token. ``vocab`` None / 0 returns ``runner`` itself."""
    vocab = check_logit_vocab(vocab, runner.config.vocab_size)
    if vocab == runner.logit_vocab:
        return runner
    if isinstance(runner, ModelRunner):
        view = ModelRunner.from_config(runner.config, runner.state_dict(), device=runner.device, dtype=runner.dtype,
                                       max_batch_size=runner.max_batch_size, max_seq_len=runner.max_seq_len,
                                       batch_invariant=runner.batch_invariant)
    else:
        view = TransformersRunner(runner.model, max_batch_size=runner.max_batch_size, max_seq_len=runner.max_seq_len)
    view.logit_vocab = vocab
    return view
