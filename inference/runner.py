"""The native target runner: a Llama-family decoder (``inference.llama``, sparse expert MLPs included) with a
preallocated static KV cache, modelled on gpt-fast (plain modules, no per-token Python loops, static cache tensors).
CUDA with ``scaled_dot_product_attention``; CPU rows (fp32 or bf16, one or a batch) run in exact mode
(``inference.llama.EXACT_ROWS``, ``inference.exactness``).
It implements the forward contract of ``inference.runner_contract``; ``inference.transformers_runner`` implements it
over any transformers model, and ``inference.runner_loading`` picks one.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from core.blocks.linear import Linear
from core.blocks.rope import rope_cos_sin, rope_inv_freq
from core.errors import UserError
from core.kernels import exact_cpu
from core.kernels.exact_cpu import KeyLists
from inference import exactness
from inference.exactness import Exactness
from inference.llama import EXACT_ROWS, Decoder, sparse_layers
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

    scores_every_row = False  # forward scores only the rows asked for (logit_rows); the rest on demand

    def __init__(
        self,
        config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        exact: bool | None = None,
    ):
        """``exact`` (default: on for CPU rows in fp32 or bf16, one or a batch) runs forwards in exact mode
        (``inference.llama.EXACT_ROWS``); :attr:`exactness` says which path runs and on what grounds."""
        super().__init__()
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"ModelRunner supports model_type in {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use TransformersRunner (or load_runner) for other architectures"
            )
        check_sliding_window(config, max_seq_len)
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        qkv_bias = (
            model_type == "qwen2"
            or bool(getattr(config, "qkv_bias", False))
            or bool(getattr(config, "attention_bias", False))
        )  # qkv_bias: Qwen2-MoE's flag
        out_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        with torch.device("meta"):  # weights come from the state dict; don't allocate them twice
            self.model = Decoder(config, qkv_bias, out_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"))
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        inv_freq, self.rope_scale = rope_inv_freq(config, self.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.exactness = self._choose_exactness(exact, device, dtype, max_batch_size)
        self.exact = self.exactness.path != exactness.APPROXIMATE
        self._dtype = dtype
        self._allocate_cache(device)
        self.cache_lens = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._pending: tuple[torch.Tensor, int] | None = None  # (lengths before the last forward, its T)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._double_lone_rows = dtype != torch.float32
        self.logit_vocab: int | None = None  # see with_logit_vocab

    def _allocate_cache(self, device: torch.device) -> None:
        """Empty K/V caches in the layout of the path: exact mode keeps fp32 caches (bf16 values convert exactly),
        keys transposed with slots padded to an odd number of 16-slot tiles (the exact kernel scores 16 slots at a
        time from contiguous memory)."""
        rows, seq = self.max_batch_size, self.max_seq_len
        if self.exact:
            # An odd number of 16-slot tiles: a key tile's D rows (one slot row apart) then fall on distinct L1 sets;
            # with 2048 slots they all fell on one and attention ran ~2x slower.
            tiles = -(-seq // 16)
            k_shape = (self.num_layers, rows, self.num_kv_heads, self.head_dim, (tiles + 1 - tiles % 2) * 16)
            v_shape = (self.num_layers, rows, self.num_kv_heads, seq, self.head_dim)
            cache_dtype = torch.float32
        else:
            k_shape = v_shape = (self.num_layers, rows, self.num_kv_heads, seq, self.head_dim)
            cache_dtype = self._dtype
        self.register_buffer("k_cache", torch.zeros(k_shape, device=device, dtype=cache_dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v_shape, device=device, dtype=cache_dtype), persistent=False)

    def _choose_exactness(
        self, exact: bool | None, device: torch.device, dtype: torch.dtype, max_batch_size: int
    ) -> Exactness:
        """The path before the probe: APPROXIMATE with the reason, or EXACT pending the probe (run once the
        weights are loaded). One row or a batch: each row's logits are those it gets alone."""
        wanted = exact if exact is not None else device.type == "cpu"
        if not wanted:
            return exactness.approximate("exact mode is off" if exact is False else f"{device.type} attention")
        problems = [
            f"it runs on a CPU, not {device.type}" if device.type != "cpu" else "",
            f"it computes in fp32 or bf16, not {dtype}" if dtype not in (torch.float32, torch.bfloat16) else "",
            f"it needs SiLU, not {self.config.hidden_act}"
            if getattr(self.config, "hidden_act", "silu") != "silu"
            else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            if exact:
                raise UserError(f"exact=true is not possible here: {'; '.join(problems)}; use exact=false")
            return exactness.approximate("; ".join(problems))
        try:
            exact_cpu.library()
        except (exact_cpu.KernelUnavailable, OSError) as error:
            warnings.warn(f"exact mode is off: {error}", exactness.ExactnessWarning, stacklevel=3)
            return exactness.approximate(str(error))
        return Exactness(exactness.EXACT, "not run", False, "probe pending")

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
        exact: bool | None = None,
        probe: bool = True,
    ) -> ModelRunner:
        """Build from a transformers config and its HF-named state dict
        (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight`` or tied to
        ``model.embed_tokens.weight``). Default dtype: fp32 on CPU, bf16 on CUDA. Weights already on
        ``device`` in ``dtype`` are shared with the state dict, not copied. In exact mode the probe
        (``inference.exactness``) runs here, unless ``probe=False``."""
        device = torch.device(device)
        dtype = dtype or default_dtype(device)
        runner = cls(
            config,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            exact=exact,
        )
        runner._load_weights(state_dict, device, dtype)
        if runner.exact and probe:
            runner._take_probe_result(exactness.probe(runner._kernel_key(), runner._probe_runner))
        return runner

    def _take_probe_result(self, result: Exactness) -> None:
        """Run the path the probe allows. Token by token keeps one row bitwise (every call a decode step's shape),
        but a batch's decode step is a call of as many rows as the batch, so batched rows then run the approximate
        path."""
        if result.path == exactness.PER_TOKEN and self.max_batch_size > 1:
            result = Exactness(exactness.APPROXIMATE, result.probe, False, exactness.BATCHED_ROWS, result.probe_seconds)
            warnings.warn(
                f"exact mode: {result.reason} (greedy equality only up to rounding; one row per runner stays bitwise)",
                exactness.ExactnessWarning,
                stacklevel=3,
            )
        self.exactness = result
        if result.path == exactness.APPROXIMATE:
            self.exact = False
            self._allocate_cache(self.device)
            for module in self.modules():
                if isinstance(module, Linear):
                    module.exact = False

    def _kernel_key(self) -> tuple:
        """What decides which kernels the host runs for this model: its shapes and dtype."""
        c = self.config
        attn = self.model.layers[0].self_attn
        return (
            c.model_type,
            self._dtype,
            c.hidden_size,
            c.intermediate_size,
            attn.num_heads,
            self.num_kv_heads,
            self.head_dim,
            c.vocab_size,
            attn.q_proj.bias is not None,
            attn.o_proj.bias is not None,
            *(
                getattr(c, name, None)
                for name in (
                    "moe_intermediate_size",
                    "num_experts",
                    "num_experts_per_tok",
                    "shared_expert_intermediate_size",
                )
            ),
        )

    def _probe_runner(self, path: str) -> ModelRunner:
        """A two-layer copy running ``path``, sharing this runner's first and last layers, embedding and head (with
        sparse expert MLPs, its first sparse layer in place of the first if neither is one: the probe checks that
        path too)."""
        config = copy.deepcopy(self.config)
        config.num_hidden_layers = 2
        sparse = sparse_layers(self.config)
        first = 0 if sparse[0] or sparse[-1] or not any(sparse) else sparse.index(True)
        layers = {0: self.model.layers[first], 1: self.model.layers[-1]}
        if any(sparse):
            config.decoder_sparse_step = 1
            config.mlp_only_layers = [i for i, source in enumerate((first, self.num_layers - 1)) if not sparse[source]]
        weights = {
            f"model.layers.{i}.{name}": t for i, layer in layers.items() for name, t in layer.state_dict().items()
        }
        weights.update(
            {f"model.{name}": t for name, t in self.model.state_dict().items() if not name.startswith("layers.")}
        )
        if not getattr(config, "tie_word_embeddings", False):
            weights["lm_head.weight"] = self.lm_head.weight
        runner = ModelRunner.from_config(
            config,
            weights,
            device=self.device,
            dtype=self._dtype,
            max_seq_len=exactness.PROBE_SEQ_LEN,
            exact=True,
            probe=False,
        )
        runner.exactness = Exactness(path, "not run", False, "the probe's own runner")
        return runner

    @classmethod
    def from_hf_model(cls, model: nn.Module, **kw) -> ModelRunner:
        """Build from a transformers ``PreTrainedModel`` (its config + state dict); ``device`` defaults to the
        model's device. Other keywords as :meth:`from_config`."""
        kw.setdefault("device", next(model.parameters()).device)
        return cls.from_config(model.config, model.state_dict(), **kw)

    def _load_weights(self, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
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
        if self.exact:  # see Linear.exact (fp32; bf16 runs oneDNN's packed linear, probed)
            for module in self.modules():
                if isinstance(module, Linear):
                    module.exact = True

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
        for cache in self._slots_first():
            cache[:, : len(rows), :length] = cache[:, index, :length]  # the gather copies before writing
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
            for cache in self._slots_first():
                cache[:, d, :n] = cache[:, s, :n]
        lens = self.cache_lens.clone()
        lens[torch.as_tensor(list(dst), dtype=torch.long, device=self.device)] = torch.as_tensor(
            list(lengths), dtype=torch.long, device=self.device
        )
        self.cache_lens = lens
        self._pending = None

    def _slots_first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K and V caches as [layers, B, slots, kv_heads, D], whatever their layout (exact mode keeps
        keys transposed)."""
        k = self.k_cache.permute(0, 1, 4, 2, 3) if self.exact else self.k_cache.transpose(2, 3)
        return k, self.v_cache.transpose(2, 3)

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
            for slots_first in self._slots_first():
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

    def _chunk_mask(
        self, user_mask: torch.Tensor, start: torch.Tensor, shortest: int, cached: int, lo: int, hi: int
    ) -> torch.Tensor:
        """The user mask [B, T, P + T] of new tokens ``lo..hi-1``, for a chunk run after tokens ``0..lo-1`` are
        cached: its columns over what the cache then holds, then the chunk's own. Rows shorter than the longest
        (lengths ``start`` before the forward) hold the earlier chunks' tokens at their own slots, right after their
        cached tokens, where a column is read as a slot."""
        mask = user_mask[:, lo:hi, : cached + hi]
        if not lo or shortest == cached:
            return mask
        column = torch.arange(cached + hi, device=self.device).expand(mask.shape[0], -1)
        earlier = (column >= start[:, None]) & (column < start[:, None] + lo)
        column = torch.where(earlier, cached + column - start[:, None], column)
        return mask.gather(2, column[:, None, :].expand(-1, hi - lo, -1))

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
        user_mask = (
            None if attention_mask is None else full_user_mask(attention_mask.to(self.device), batch, new, cached)
        )
        start = self.cache_lens
        # Exact mode: chunks of at most EXACT_ROWS tokens (one token per chunk on the per-token path), each appended
        # to the cache before the next reads it (a chunk's mask rows over columns up to its own end are the user's).
        step = new
        if self.exact:
            step = 1 if self.exactness.path == exactness.PER_TOKEN else EXACT_ROWS
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in capture}
        chunks = []
        for lo in range(0, new, step):
            hi = min(new, lo + step)
            chunks.append(
                self._layers(
                    input_ids[:, lo:hi],
                    None if positions is None else positions[:, lo:hi],
                    None if user_mask is None else self._chunk_mask(user_mask, start, shortest, cached, lo, hi),
                    shortest + lo,
                    cached + lo,
                    capture,
                    hidden,
                )
            )
        x = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        self._pending = (start, new)

        x = self.model.norm(x, exact=self.exact)
        logits = self.logits_from_hidden(x[:, logit_rows_slice(only_last_logits, logit_rows)])
        return RunnerOutput(
            logits=logits,
            hidden={i: torch.cat(h, dim=1) if len(h) > 1 else h[0] for i, h in hidden.items()},
            last_hidden=x if return_last_hidden else None,
        )

    @torch.no_grad()
    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., V] of final-normed hidden rows [..., H] (a forward's ``last_hidden``), computed as
        :meth:`forward` computes its own: in exact mode in calls of at most EXACT_ROWS rows (one on the per-token
        path) with a lone bf16 row doubled, and over ``logit_vocab`` ids when set. So a row computed later, alone
        or among others, has the bits AR's decode step gives it (those row counts are what the probe checks)."""
        # As one contiguous 2D matmul: a strided 3D input would take a batched path that copies the weight.
        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        step = flat.shape[0]
        if self.exact:
            step = 1 if self.exactness.path == exactness.PER_TOKEN else EXACT_ROWS
        if flat.shape[0] > step:
            logits = torch.cat([self._head(flat[lo : lo + step]) for lo in range(0, flat.shape[0], step)])
        else:
            logits = self._head(flat)
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def _head(self, flat: torch.Tensor) -> torch.Tensor:
        """The lm_head over [N, H] rows, N <= EXACT_ROWS in exact mode."""
        if self.exact and self._double_lone_rows and flat.shape[0] == 1:  # see _exact_layers
            return self._head(flat.expand(2, -1).contiguous())[:1]
        if self.logit_vocab is None:
            return self.lm_head(flat).float()
        return limited_logits(self.lm_head(flat, self.logit_vocab).float(), self.config.vocab_size)

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        user_mask: torch.Tensor | None,
        shortest: int,
        cached: int,
        capture: Sequence[int],
        hidden: dict[int, list[torch.Tensor]],
    ) -> torch.Tensor:
        """Append ``input_ids`` [B, T] to the cache through every decoder layer; returns the last layer's output
        (before the final norm) and adds the captured layers' outputs to ``hidden``."""
        batch, new = input_ids.shape
        # [B, T] physical cache slots of the new tokens
        slots = self.cache_lens[:, None] + torch.arange(new, device=self.device)
        positions = slots if positions is None else positions
        aligned = shortest == cached
        write_index = cached if aligned else (torch.arange(batch, device=self.device)[:, None], slots)

        if self.exact:
            return self._exact_layers(input_ids, positions, user_mask, slots, cached, write_index, capture, hidden)
        attend_len = cached + new
        mask, is_causal = None, False
        if user_mask is not None or not aligned or (new > 1 and cached > 0):
            mask = self._attention_mask(user_mask, slots, cached, new, attend_len)
        elif new > 1:
            # Fast paths when all rows are equally long and the mask is causal: decode needs no mask, a prefill
            # into an empty cache is plain causal attention (lets SDPA use flash kernels on CUDA).
            is_causal = True
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale, self._dtype)  # [B, 1, T, D]

        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = self.k_cache[i, :batch], self.v_cache[i, :batch]
            x = layer(x, cos, sin, k_cache, v_cache, write_index, attend_len, mask, is_causal)
            if i in capture:
                hidden[i].append(x)
        self.cache_lens = self.cache_lens + new
        return x

    def _exact_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        user_mask: torch.Tensor | None,
        slots: torch.Tensor,
        cached: int,
        write_index: tuple[torch.Tensor, torch.Tensor] | int,
        capture: Sequence[int],
        hidden: dict[int, list[torch.Tensor]],
    ) -> torch.Tensor:
        """:meth:`_layers` in exact mode: the rows' tokens run flattened through the linears (in calls of at most
        EXACT_ROWS rows, ``inference.llama.exact_linear``), each row attends over its own cache with its tokens' keys
        planned once for every layer, RoPE's angles come from one table, and in bf16 a lone token runs as a doubled
        row (oneDNN computes a one-row linear another way; fp32's exact linear needs no such care)."""
        batch, new = input_ids.shape
        if user_mask is None:
            keys = KeyLists.chain(cached, new) if batch == 1 else KeyLists.chains(self.cache_lens, new)
        else:
            allowed = self._attention_mask(user_mask, slots, cached, new, cached + new)[:, 0]
            keys = KeyLists.from_mask(allowed[0] if batch == 1 else allowed)
        cos, sin = self._rope_at(positions)
        tokens = batch * new
        x = self.model.embed_tokens(input_ids.reshape(1, tokens))
        if tokens == 1 and self._double_lone_rows:
            x = x.repeat(1, 2, 1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, self.k_cache[i], self.v_cache[i], write_index, None, None, False, exact=keys)
            if i in capture:
                hidden[i].append(x[:, :tokens].view(batch, new, -1))
        self.cache_lens = self.cache_lens + new
        return x[:, :tokens].view(batch, new, -1)

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, D] at ``positions`` [B, T], from a table computed once for every position: an
        element of a vectorised cos can depend on where it sits in the tensor, so each position's angles are
        computed exactly once."""
        if self._rope_table is None:
            every = torch.arange(self.max_seq_len, device=self.device)[None]
            cos, sin = rope_cos_sin(every, self.inv_freq, self.rope_scale, self._dtype)
            self._rope_table = (cos[0, 0], sin[0, 0])
        if int(positions.max()) >= self.max_seq_len or int(positions.min()) < 0:
            raise ValueError(
                f"positions must lie in 0..{self.max_seq_len - 1} (max_seq_len), got "
                f"{positions.min().item()}..{positions.max().item()}"
            )
        cos, sin = self._rope_table
        return cos[positions][:, None], sin[positions][:, None]
