"""The same runner contract (``inference.runner_contract``) over any transformers causal LM: the fallback for
architectures :class:`inference.runner.ModelRunner` does not build, and for sliding windows shorter than the context.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from inference import exactness
from inference.runner_contract import (
    KeptIndices,
    RunnerOutput,
    attention_windows,
    check_batch,
    check_cache_room,
    full_user_mask,
    kept_to_tensor,
    limited_logits,
    logit_rows_slice,
    normalize_layers,
)


class TransformersRunner:
    """The same interface over any transformers causal LM (its ``DynamicCache`` plus a custom 4D mask).

    Slower than :class:`ModelRunner`: transformers' per-call overhead, a float mask over the whole cache, and
    rejected tokens stay in the cache as masked-out slots until a commit/truncate compacts it by copying.
    Needs a model whose attention honours a custom 4D mask (``eager`` or ``sdpa`` attention, standard KV
    layers). Sliding windows are applied in that mask, by position (a query at position p sees keys at positions
    > p - window, as transformers does), per layer type where layers differ (transformers takes a mask per type);
    the cache keeps every token, so any context length up to ``max_seq_len`` works.
    """

    # transformers' forward scores every row whatever logit_rows asks: verification reads its rows, computing none
    # again (inference.row_logits)
    scores_every_row = True
    # what transformers' *ForCausalLM heads do after the lm_head, by config attribute (Gemma-2/3 soft-cap their
    # logits, Cohere scales them, Granite divides them)
    LOGIT_SOFTCAP, LOGIT_SCALE, LOGIT_DIVISOR = "final_logit_softcapping", "logit_scale", "logits_scaling"

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
        # transformers' own attention and GEMMs over batched rows: greedy equality with AR holds up to rounding
        self.exact = False
        self.exactness = exactness.approximate(exactness.TRANSFORMERS_BACKEND)
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
        kept, counts = kept_to_tensor(kept, self.batch_size, new, self.device)
        # Count-and-compare rather than scatter True: padding entries repeat a row's last index.
        real = (torch.arange(kept.shape[1], device=self.device) < counts[:, None]).long()
        keep = torch.zeros(self.batch_size, new, dtype=torch.long, device=self.device).scatter_add_(1, kept, real)
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
        check_batch(batch, self.batch_size)
        lens = self.cache_lens
        cached = int(lens.max())
        check_cache_room(cached + new, self.max_seq_len)
        capture = normalize_layers(capture_layers, self.num_layers)
        device, physical = self.device, self._slot_valid.shape[1]

        arange_new = torch.arange(new, device=device)
        positions = lens[:, None] + arange_new if positions is None else positions.to(device).expand(batch, new)
        new_part = torch.ones(new, new, dtype=torch.bool, device=device).tril().expand(batch, new, new)
        cache_part = self._slot_valid[:, None, :].expand(batch, new, physical)
        if attention_mask is not None:
            user_mask = full_user_mask(attention_mask.to(device), batch, new, cached)
            # Logical cache column i of row b -> its physical slot (the i-th valid one).
            order = torch.sort((~self._slot_valid).to(torch.int8), dim=1, stable=True).indices[:, :cached]
            mapped = torch.zeros(batch, new, physical, dtype=torch.bool, device=device)
            mapped.scatter_(2, order[:, None, :].expand(batch, new, cached), user_mask[:, :, :cached])
            cache_part = cache_part & mapped
            new_part = user_mask[:, :, cached:] | torch.eye(new, dtype=torch.bool, device=device)
        allowed = torch.cat([cache_part, new_part], dim=-1)[:, None]
        masks = {kind: self._float_mask(allowed, positions, window) for kind, window in self.windows.items()}
        # One mask for every layer, or (models with layer types) one per type, which transformers then uses as-is.
        float_mask = (
            masks["all"]
            if "all" in masks
            else masks
            if len(set(self.windows.values())) > 1
            else next(iter(masks.values()))
        )

        hidden: dict[int, torch.Tensor] = {}
        captured_last: list[torch.Tensor] = []
        hooks = []
        if capture:
            if self._decoder_layers is None:
                raise ValueError(f"cannot find the decoder layers of {type(self.model).__name__} to capture")
            for i in capture:
                hooks.append(self._decoder_layers[i].register_forward_hook(self._capture_hook(hidden, i)))
        if return_last_hidden:
            hooks.append(self.lm_head.register_forward_pre_hook(lambda m, args: captured_last.append(args[0])))
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
        logits = out.logits[:, logit_rows_slice(only_last_logits, logit_rows)].float()
        if self.logit_vocab is not None:  # transformers scored every id; the limit still holds exactly
            logits = limited_logits(logits[..., : self.logit_vocab], self.config.vocab_size)
        return RunnerOutput(
            logits=logits,
            hidden=dict(sorted(hidden.items())),
            last_hidden=captured_last[0] if captured_last else None,
        )

    __call__ = forward

    @torch.no_grad()
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., V] of final-normed hidden rows [..., H] (``last_hidden``), as transformers' head
        computes them in :meth:`forward`: the lm_head, then the soft-cap or scale the config names, then the
        ``logit_vocab`` limit. Equal to the forward's rows up to rounding (this backend claims no more)."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, self.LOGIT_SOFTCAP, None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        scale = getattr(self.config, self.LOGIT_SCALE, None)
        if scale is not None:
            logits = logits * scale
        divisor = getattr(self.config, self.LOGIT_DIVISOR, None)
        if divisor is not None:
            logits = logits / divisor
        logits = logits.float()
        if self.logit_vocab is not None:
            logits = limited_logits(logits[..., : self.logit_vocab], self.config.vocab_size)
        return logits

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
