"""The native target runner: a Llama-family decoder (``inference.llama``) with a preallocated static KV cache,
modelled on gpt-fast (plain modules, no per-token Python loops, static cache tensors). CPU fp32 for tests, CUDA bf16
with ``scaled_dot_product_attention``; bf16 on a CPU of one row runs batch-invariant (``inference.llama.INVARIANT_ROWS``).
It implements the forward contract of ``inference.runner_contract``; ``inference.transformers_runner`` implements it
over any transformers model, and ``inference.runner_loading`` picks one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from core.blocks.linear import Linear
from core.blocks.rope import rope_cos_sin, rope_inv_freq
from inference.llama import INVARIANT_KV_BLOCK, INVARIANT_ROWS, Decoder, GatheredKeys, gathered_keys
from inference.runner_contract import (
    SUPPORTED_MODEL_TYPES,
    KeptIndices,
    RunnerOutput,
    check_batch,
    check_cache_room,
    check_sliding_window,
    default_dtype,
    full_user_mask,
    kept_to_tensor,
    limited_logits,
    logit_rows_slice,
    normalize_layers,
)


class ModelRunner(nn.Module):
    """Llama-family decoder with a static KV cache; ``inference.runner_contract`` states the forward contract.

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
        check_sliding_window(config, max_seq_len)
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
        dtype = dtype or default_dtype(device)
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
        kept, counts = kept_to_tensor(kept, batch, new, self.device)
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
        check_batch(batch, self.batch_size)
        shortest, cached = (int(x) for x in torch.aminmax(self.cache_lens))  # the one host sync per forward
        check_cache_room(cached + new, self.max_seq_len)
        capture = normalize_layers(capture_layers, self.num_layers)
        input_ids = input_ids.to(self.device)
        if positions is not None:
            positions = positions.to(self.device).expand(batch, new)
        user_mask = None if attention_mask is None else full_user_mask(attention_mask.to(self.device), batch, new,
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
        rows = x[:, logit_rows_slice(only_last_logits, logit_rows)]
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
