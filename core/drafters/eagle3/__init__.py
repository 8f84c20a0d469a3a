"""The EAGLE-3 drafter (docs/algorithms/eagle3.md): one module, one code path for training and serving.

Architecture. Parameter names are SGLang's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so
the module's state dict *is* the SGLang weight layout::

    g      = fc(concat(aux_0, aux_1, aux_2))                # target features 3·H_t -> H (no bias), or a drafted g'
                                                            # (fc_norm: each aux_k through its own RMSNorm first)
    e      = embed_tokens(token)                            # the target's embedding, frozen
    x      = concat(input_layernorm(e), hidden_norm(g))     # 2H: the attention input (embeddings FIRST)
    r      = hidden_norm(g) if norm_before_residual else g  # residual stream (SGLang: False; speculators: True)
    r      = r + self_attn(x)                               # q/k/v read 2H, o_proj writes H
    g'     = r + mlp(post_attention_layernorm(r))           # the next hidden state (pre-norm)
    logits = lm_head(norm(g'))                              # over the draft vocabulary (Vd rows)
    (norm_output: g' := norm(g'), logits = lm_head(g'): the normed state is what a drafted row reads next)
    draft id i -> target id i + d2t[i]                      # EAGLE-3 offsets; t2d[v]: v is in the draft vocab

Rows (the "EAGLE shift", §1). Row ``i`` pairs the target's features at position ``i`` with the token at
``i + 1`` and predicts the token at ``i + 2`` (the target's distribution at position ``i + 1``). Its RoPE
position is ``i``. A drafted row one step further along (training-time test step ``j``, or a tree node ``j``
levels below committed row ``i``) reads ``g'`` of its parent row instead of target features, the token at
``i + 1 + j``, sits at position ``i + j``, and attends to the committed rows ``<= i`` plus its own chain.

Training (:meth:`Eagle3Drafter.forward`): whole sequences, ``steps`` unrolled training-time-test steps; step ``j``
feeds its own step ``j - 1`` hidden states and attends causally to step-0 keys plus the same row's keys of steps
``1..j`` (the "diagonal" keys). Serving (:meth:`Eagle3Drafter.step`): new rows of B ragged rows against a small KV cache
(:class:`Eagle3Cache`, one length per row) with an explicit mask; both call :meth:`Eagle3Drafter._rows`.

EAGLE-3.1 (docs/algorithms/eagle3.md §7): ``fc_norm`` adds one RMSNorm per aux layer before ``fc`` (tensors
``fc_norm.{0,1,2}.weight``); ``norm_output`` feeds the final norm's output, not the pre-norm state, to the next
drafted row (no new tensor). Both off: EAGLE-3 exactly as before (no module, no op added).

Sliding window (docs/algorithms/eagle3.md §8): ``attention_window = W`` lets a row at position ``p`` read only
the rows at positions ``> p - W`` (training: step-0 keys and training-time-test keys by their positions; serving:
a cached row's position is its slot, as committed rows sit at slot = position and a round's drafted rows after
them). 0 = off: no op added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UserError
from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import apply_rope
from core.drafters.row_kv import RowKV
from core.drafters.target_tied import TargetTiedDrafter

NUM_AUX_LAYERS = 3  # the fc input is three target layers wide in every engine's EAGLE-3
EAGLE31_FLAGS = ("fc_norm", "norm_output")  # Eagle3Config fields of EAGLE-3.1, off by default
# The narrowest sliding window: the rows one round drafts (training-time-test steps, tree levels, P-EAGLE's chains;
# never this deep) then always lie inside it, so training and serving count the window alike.
MIN_WINDOW = 32
# (q [B, heads, T, D], keys, values [B, kv_heads, P + T, D]) -> attention output [B, heads, T, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TargetShapedConfig:
    """The fields and (de)serialisation every target-shaped drafter config shares (EAGLE-3, SpecBlock): decoder
    layers with a target's per-layer shapes, its embedding rows, a draft vocabulary and three aux layers.
    ``aux_layer_ids`` are OUTPUT-of-decoder-layer ids, 0-based (``core.layer_ids`` convention; the runner's
    capture convention)."""

    KIND = "drafter"  # names the drafter in errors

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the TARGET vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows, d2t length
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # the DRAFTER's RoPE base
    rope_scaling: dict[str, Any] | None = None  # transformers-4 style scaling dict (rope_type, factor, ...)
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    @property
    def resolved_head_dim(self) -> int:
        return int(self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            name = cls.KIND.lower().replace("-", "")
            raise UserError(f"unknown {name} config fields {unknown}; known: {', '.join(sorted(known))}")
        return cls(**values)


@dataclass
class Eagle3Config(TargetShapedConfig):
    """Everything that shapes an EAGLE-3 drafter (one decoder layer)."""

    KIND = "EAGLE-3"

    norm_before_residual: bool = False
    own_embedding: bool = False  # True: the drafter carries its own embed_tokens (exported); False: the target's
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: drafted rows read the final norm's output (post-norm g')
    attention_window: int = 0  # sliding window: a row at position p reads positions > p - window (0: all of them)

    def __post_init__(self) -> None:
        check_drafter_config(self, self.KIND)
        self.attention_window = window = int(self.attention_window)
        if window and window < MIN_WINDOW:
            raise UserError(
                f"{self.KIND} attention_window={window} is narrower than a round's drafted rows may "
                f"reach; give attention_window=0 (every position) or attention_window >= {MIN_WINDOW}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields; the EAGLE-3.1 flags and the window only when set, so an EAGLE-3 drafter's record (exports,
        checkpoints) stays what it was before they existed and older readers still accept it."""
        values = asdict(self)
        for flag in (*EAGLE31_FLAGS, "attention_window"):
            if not values[flag]:
                del values[flag]
        return values

    @classmethod
    def for_target(
        cls, target_config, *, draft_vocab_size: int, aux_layer_ids: list[int], **overrides: Any
    ) -> Eagle3Config:
        """A drafter shaped like one layer of ``target_config`` (a transformers config), as EAGLE-3 recipes do."""
        values = target_layer_shape(target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)
        values.update(overrides)
        return cls(**values)

    def llama_config(self):
        """The transformers ``LlamaConfig`` of the drafter's decoder layer (RoPE, MLP, norms read it)."""
        return layer_llama_config(self, num_layers=1)


def check_drafter_config(config: Any, kind: str, extra_positive: tuple[str, ...] = ()) -> None:
    """Normalise and check what every target-shaped drafter config (EAGLE-3, SpecBlock) shares: the aux layer
    triple, positive sizes, a draft vocabulary inside the target's, grouped-query heads. Resolves ``head_dim``."""
    config.aux_layer_ids = [int(i) for i in config.aux_layer_ids]
    if config.head_dim is None:  # stored resolved, so configs compare equal whatever their source wrote
        config.head_dim = config.hidden_size // config.num_attention_heads
    if len(config.aux_layer_ids) != NUM_AUX_LAYERS or any(i < 0 for i in config.aux_layer_ids):
        raise UserError(f"{kind} needs {NUM_AUX_LAYERS} non-negative aux layer ids, got {config.aux_layer_ids}")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
        *extra_positive,
    ):
        if int(getattr(config, name)) < 1:
            raise UserError(f"{kind} config: {name} must be >= 1, got {getattr(config, name)}")
    if config.draft_vocab_size > config.vocab_size:
        raise UserError(f"draft_vocab_size {config.draft_vocab_size} exceeds the target vocab_size {config.vocab_size}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UserError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )


def norm_eps(target_config) -> float:
    """The target's norm epsilon, whatever its family calls it (the drafter's own norms are RMSNorms)."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon"):
        value = getattr(target_config, name, None)
        if value is not None:
            return float(value)
    return 1e-5


def target_layer_shape(target_config, *, draft_vocab_size: int, aux_layer_ids: list[int]) -> dict[str, Any]:
    """Config fields of a drafter whose decoder layers have ``target_config``'s per-layer shapes (EAGLE-3 and
    SpecBlock both do), reading its aux layers and predicting over ``draft_vocab_size`` ids."""
    theta, scaling = rope_of(target_config)
    return dict(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
        head_dim=getattr(target_config, "head_dim", None),
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_config.hidden_size,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=norm_eps(target_config),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=target_config.max_position_embeddings,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
    )


def layer_llama_config(config: Any, *, num_layers: int):
    """The transformers ``LlamaConfig`` of a drafter's decoder layers (RoPE, MLP and norms read it)."""
    from transformers import LlamaConfig  # transformers: a heavy import, deferred to first use

    return LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.resolved_head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        max_position_embeddings=config.max_position_embeddings,
        hidden_act=config.hidden_act,
        tie_word_embeddings=False,
    )


def rope_of(config) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` of a transformers config (or its dict), from its v5
    ``rope_parameters`` or v4 ``rope_theta`` / ``rope_scaling``."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    params = dict(get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
    if not params:
        params = dict(get("rope_scaling") or {})
    if params.get("rope_type", params.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), params


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """``x`` moved ``n`` places left along dim 1 (row i gets row i + n), the last ``n`` rows set to ``fill``.
    Training-time test step ``j`` reads its tokens as ``shift_left(input_ids, j + 1)``; a trainer shifts its
    targets and masks with the same helper."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


# ----------------------------------------------------------------------------------------------------------
# Modules


class Eagle3Attention(nn.Module):
    """Llama attention (no biases) over explicit past K/V, returning this call's K/V (for caches and TTT). For
    EAGLE-3 q/k/v read the 2H-wide ``[embeddings ; hidden]`` input; SpecBlock's layers pass ``input_width=H``."""

    def __init__(self, config: Any, input_width: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        width = input_width or 2 * config.hidden_size
        self.q_proj = Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        mask: torch.Tensor | Attend,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, input width]; past K/V [B, kv_heads, P, D] or None; mask bool [B, T, P + T] (True = attend), or
        an :data:`Attend` function (a training layout that never builds its dense mask, e.g. P-EAGLE's chains).
        Returns (output [B, T, H], this call's K, V [B, kv_heads, T, D])."""
        q, k, v = self.project(x, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        if callable(mask):
            return self.merge(mask(q, keys, values)), k, v
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.merge(out), k, v

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, input width] -> RoPE'd q [B, heads, T, D] and k, v [B, kv_heads, T, D]."""
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, heads, T, D] -> o_proj output [B, T, H]."""
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Eagle3DecoderLayer(nn.Module):
    """SGLang's ``midlayer``: one decoder layer over ``[input_layernorm(e) ; hidden_norm(g)]``."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = Eagle3Attention(config)
        self.mlp = MLP(config.llama_config())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, *attn_args) -> tuple[torch.Tensor, ...]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn, k, v = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), *attn_args)
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


@dataclass
class Eagle3Output:
    """``logits`` over the draft vocabulary [B, T, Vd] and the next hidden states ``hidden`` (pre-norm; post-norm
    under ``norm_output``) [B, T, H] per step (training: one entry per training-time-test step)."""

    logits: list[torch.Tensor]
    hidden: list[torch.Tensor]


@dataclass
class Eagle3Step:
    """One serving call: ``logits`` over the draft vocabulary [B, T, Vd], next hidden states [B, T, H]."""

    logits: torch.Tensor
    hidden: torch.Tensor


class Eagle3Cache(RowKV):
    """The drafter's KV cache for serving: one layer of per-row K/V [B, kv_heads, max_len, D] and ``lengths`` [B]
    (:class:`core.drafters.row_kv.RowKV`; ``length`` and ``truncate(int)`` serve single-row callers)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__([k], [v], name="drafter cache", unit="rows")


class Eagle3Drafter(TargetTiedDrafter):
    """The EAGLE-3 drafter; see the module docstring for the architecture and the row/position convention."""

    ROW_EXACT_SERVING = True

    def __init__(self, config: Eagle3Config, embed_weight: torch.Tensor | None = None):
        """``embed_weight`` [V, H]: the target's token embedding, shared (not copied) and frozen."""
        super().__init__()
        self._init_target_tied(config, embed_weight)
        hidden = config.hidden_size
        self.fc = Linear(NUM_AUX_LAYERS * config.target_hidden_size, hidden, bias=False)
        if config.fc_norm:  # absent when off: an EAGLE-3 drafter's modules and state dict are unchanged
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(NUM_AUX_LAYERS)
            )
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)

    def new_cache(self, max_len: int, batch_size: int = 1) -> Eagle3Cache:
        ref = self.fc.weight
        shape = (batch_size, self.config.num_key_value_heads, max_len, self.config.resolved_head_dim)
        return Eagle3Cache(ref.new_zeros(shape), ref.new_zeros(shape))

    # -- the one code path -----------------------------------------------------------------------------------

    def _rows(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        mask: torch.Tensor | Attend,
        heads: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (token [B, T], hidden [B, T, H]) at ``positions`` [B, T] against past K/V under ``mask``
        [B, T, P + T] (or an :data:`Attend` function) -> (logits [B, T, Vd] or None without ``heads``, next hidden
        [B, T, H], K, V of these rows)."""
        dtype = hidden.dtype
        cos, sin = self._rope(positions, dtype)
        embeds = self.embed_tokens(tokens).to(dtype)
        out, k, v = self.midlayer(embeds, hidden, cos, sin, past_k, past_v, mask)
        if self.config.norm_output:
            out = self.norm(out)
        return (self.head(out) if heads else None), out, k, v

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next hidden states [..., H] (pre-norm; post-norm under ``norm_output``) -> logits over the draft
        vocabulary [..., Vd]."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    # -- training --------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        *,
        steps: int = 1,
        attention_mask: torch.Tensor | None = None,
        heads: bool = True,
    ) -> Eagle3Output:
        """Training forward over whole sequences, ``steps`` training-time-test steps.

        ``input_ids`` [B, T] and ``aux_hidden`` [B, T, 3·H_t] are UNshifted (row t = token t and the target's
        features at t, as ``data_prep.features`` stores them); ``attention_mask`` [B, T] marks real tokens.
        Step ``j``, row ``i`` reads token ``i + 1 + j`` and predicts token ``i + 2 + j`` (the target's
        distribution at position ``i + 1 + j``); rows past the sequence end read token 0 and must be masked
        out of the loss by the caller (``shift_left`` its targets and masks by ``j + 1``). ``heads=False`` leaves
        ``logits`` empty: a trainer that scores only some rows applies :meth:`head` to those (on a CPU the
        draft-vocabulary head and its softmax over every padded or prompt row are a large share of a step).
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1 (training-time-test steps), got {steps}")
        batch, length = input_ids.shape
        device = input_ids.device
        rows = torch.arange(length, device=device)
        causal = (rows[None, :] <= rows[:, None]).expand(batch, length, length)
        if attention_mask is not None:
            causal = causal & attention_mask.bool()[:, None, :]
        diagonal = torch.eye(length, dtype=torch.bool, device=device).expand(batch, length, length)
        causal = causal | diagonal  # padded rows still see themselves: no empty softmax row
        positions = rows.expand(batch, length)

        hidden = self.project(aux_hidden)
        past_k = past_v = None
        logits_steps, hidden_steps = [], []
        for j in range(steps):
            # step-0 keys causally, then the same row's keys of steps 1..j (diagonal blocks)
            mask = self._step_mask(causal, diagonal, j)
            logits, hidden, k, v = self._rows(
                shift_left(input_ids, j + 1), hidden, positions + j, past_k, past_v, mask, heads
            )
            past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
            past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
            if heads:
                logits_steps.append(logits)
            hidden_steps.append(hidden)
        return Eagle3Output(logits_steps, hidden_steps)

    def _step_mask(self, causal: torch.Tensor, diagonal: torch.Tensor, j: int) -> torch.Tensor:
        """Training-time-test step ``j``'s mask [B, T, (j + 1)·T]: step-0 keys ``causal``, then the row's own keys of
        steps 1..j. Under a window the row (at position i + j) reads step-0 rows k > i + j - W and its step-j' key
        (at i + j') while j - j' < W."""
        window = self.config.attention_window
        if not window:
            return torch.cat([causal] + [diagonal] * j, dim=-1)
        rows = torch.arange(causal.shape[-1], device=causal.device)
        first = causal & (rows[None, :] > rows[:, None] + j - window)
        return torch.cat(
            [first] + [diagonal if j - earlier < window else torch.zeros_like(diagonal) for earlier in range(1, j + 1)],
            dim=-1,
        )

    # -- serving ---------------------------------------------------------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3·H_t] -> the drafter's hidden input [..., H] (``fc_norm``: each aux layer's
        H_t-wide slice through its own norm first)."""
        if self.config.fc_norm:
            slices = aux_hidden.chunk(NUM_AUX_LAYERS, dim=-1)
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, slices, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Eagle3Cache,
        attention_mask: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> Eagle3Step:
        """Serve new rows of B cache rows at once, then append their K/V to ``cache``.

        ``tokens`` [B, T], ``hidden`` [B, T, H] (``project``-ed target features or a parent's ``g'``), ``positions``
        [B, T] (or [1, T] for every row). ``counts`` [B]: row b's first ``counts[b]`` new rows are real, the rest pads
        whose K/V are never kept (None: all T). ``attention_mask`` bool, True = attend: None = causal over the row's
        cache and its new rows; [B, T, T] = the row's whole cache plus the new rows it allows (short form);
        [B, T, P + T], P = ``cache.longest`` = slot j of the row's own cache, then the new rows (full form, as a tree
        over cached tree rows needs). Whatever it says, a row reads only its own cache's held slots and its own real
        new rows, and each row sees itself. Pad rows' outputs are meaningless."""
        batch, new = tokens.shape
        if cache.batch != batch:
            raise ValueError(
                f"step got {batch} rows but the drafter cache holds {cache.batch}; build the cache with "
                f"new_cache(max_len, batch_size={batch})"
            )
        counts = cache.counts(new, counts)
        positions = positions.expand(batch, new)
        mask = self._serving_mask(cache, new, counts, attention_mask)
        if self.config.attention_window:
            mask = mask & in_window(positions, mask.shape[-1] - new, self.config.attention_window)
        past_k, past_v = cache.view()[0] if mask.shape[-1] > new else (None, None)
        attend = per_row_attention(mask, cache.held, counts) if self.row_exact else mask
        logits, out, k, v = self._rows(tokens, hidden, positions, past_k, past_v, attend)
        cache.append([(k, v)], counts)
        return Eagle3Step(logits, out)

    def _serving_mask(
        self, cache: RowKV, new: int, counts: list[int], attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """bool [B, T, P + T] of :meth:`step`: the caller's mask limited to held slots and real rows, plus self.
        (Rows of one length and no pads skip the limiting: a one-row call builds the mask it always did.)"""
        batch, past, device = cache.batch, cache.longest, cache.device
        if attention_mask is None:
            mask = torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past).expand(batch, new, -1)
        else:
            mask = attention_mask.to(device=device, dtype=torch.bool)
            if (
                mask.dim() != 3
                or mask.shape[0] not in (1, batch)
                or mask.shape[1] != new
                or mask.shape[2] not in (new, past + new)
            ):
                raise ValueError(
                    f"drafter mask must be [B, {new}, {new}] (new rows) or [B, {new}, {past + new}] "
                    f"(cache slots, then new rows), B = {batch}, got {tuple(attention_mask.shape)}"
                )
            mask = mask.expand(batch, new, -1)
            if mask.shape[2] == new and past:  # short form: the row's whole cache
                mask = torch.cat([mask.new_ones(batch, new, past), mask], dim=-1)
        if not cache.uniform:
            mask = torch.cat([mask[..., :past] & cache.key_mask(new), mask[..., past:]], dim=-1)
        if any(c != new for c in counts):
            real = torch.arange(new, device=device) < torch.tensor(counts, device=device)[:, None]  # pad keys out
            mask = torch.cat([mask[..., :past], mask[..., past:] & real[:, None, :]], dim=-1)
        own = torch.zeros(new, past + new, dtype=torch.bool, device=device)
        own[:, past:] = torch.eye(new, dtype=torch.bool, device=device)
        return mask | own


def in_window(positions: torch.Tensor, past: int, window: int) -> torch.Tensor:
    """bool [B, T, past + T]: which keys of a serving call the rows at ``positions`` [B, T] read under a sliding
    ``window``: cache slot s counts as position s (committed rows sit at slot = position; rows a round drafts sit
    after them, inside any window of at least ``MIN_WINDOW``), a new row as its own position."""
    slots = torch.arange(past, device=positions.device).expand(positions.shape[0], past)
    keys = torch.cat([slots, positions], dim=-1)
    return keys[:, None, :] > positions[:, :, None] - window


def per_row_attention(mask: torch.Tensor, lengths: list[int], counts: list[int]) -> Attend:
    """An :data:`Attend` that runs one SDPA per cache row over exactly its held slots and its real new rows, under
    ``mask`` [B, T, P + T]: the call a row gets alone, so its result does not depend on the other rows (row-exact
    serving). Pad rows come out zero."""
    past = mask.shape[-1] - mask.shape[1]
    spans = list(zip(lengths, counts))

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = q.new_zeros(q.shape)
        gqa = q.shape[1] != keys.shape[1]
        for b, (held, count) in enumerate(spans):
            if count == 0:
                continue
            cols = torch.cat([torch.arange(held), torch.arange(past, past + count)]).to(mask.device)
            row_keys = torch.cat([keys[b : b + 1, :, :held], keys[b : b + 1, :, past : past + count]], dim=2)
            row_values = torch.cat([values[b : b + 1, :, :held], values[b : b + 1, :, past : past + count]], dim=2)
            row_mask = mask[b : b + 1, :count, cols][:, None]
            out[b : b + 1, :, :count] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :count], row_keys, row_values, attn_mask=row_mask, enable_gqa=gqa
            )
        return out

    return attend
