"""What both runners share (docs/architecture.md §6.1): the forward contract, its output, the mask and commit-index
conventions, and the config checks. :class:`inference.runner.ModelRunner` and
:class:`inference.transformers_runner.TransformersRunner` implement it.

The contract
------------
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
layer there). ``last_hidden`` is the final hidden AFTER the final norm, and ``logits_from_hidden(rows of
last_hidden)`` gives those rows' logits as the forward computes them (in exact mode bit for bit: the same calls, a
lone bf16 row doubled, at most ``EXACT_ROWS`` rows each). ``scores_every_row`` says whether the forward scores every
row whatever ``logit_rows`` asks (then computing rows again on demand only costs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.errors import UserError

# the architectures ModelRunner builds natively
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
KeptIndices = torch.Tensor | Sequence[Sequence[int]]


@dataclass
class RunnerOutput:
    """``logits``: float32 [B, T, V] (or the requested rows only); ``hidden``: captured layer
    outputs {layer index: [B, T, H]}; ``last_hidden``: final-normed hidden [B, T, H] when requested."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    last_hidden: torch.Tensor | None = None


def logit_rows_slice(only_last: bool, rows: slice | None) -> slice:
    if only_last and rows is not None:
        raise ValueError("pass only_last_logits or logit_rows, not both")
    return slice(-1, None) if only_last else rows if rows is not None else slice(None)


def default_dtype(device: torch.device) -> torch.dtype:
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
        raise UserError(
            f"{config.model_type} has {unknown} attention layers, which spectrain's runners do not "
            f"serve (they serve {', '.join(ATTENTION_LAYER_TYPES)})"
        )
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(layer_types)}


def window_matters(config, max_seq_len: int) -> bool:
    """Whether some layer's sliding window is shorter than the context, so it changes the result."""
    return any(w is not None and w < max_seq_len for w in attention_windows(config).values())


def check_sliding_window(config, max_seq_len: int) -> None:
    """ModelRunner uses full attention; refuse configs where a sliding window would change the result."""
    if window_matters(config, max_seq_len):
        window = min(w for w in attention_windows(config).values() if w is not None)
        raise UserError(
            f"{config.model_type} uses a sliding window of {window} < max_seq_len={max_seq_len}, which ModelRunner "
            f"does not implement; load it with backend=auto or backend=transformers (TransformersRunner applies it)"
        )


def normalize_layers(capture_layers: Sequence[int], num_layers: int) -> list[int]:
    layers = []
    for layer in capture_layers:
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"capture layer {layer} out of range for a {num_layers}-layer model")
        layers.append(layer % num_layers)
    return layers


def check_batch(batch: int, runner_batch: int) -> None:
    if batch != runner_batch:
        raise ValueError(f"input has batch {batch} but the runner's batch is {runner_batch}; use reset()")


def check_cache_room(needed: int, max_seq_len: int) -> None:
    if needed > max_seq_len:
        raise ValueError(
            f"forward needs {needed} cache slots but the runner has max_seq_len={max_seq_len}; "
            f"build it with max_seq_len={needed} or more"
        )


def full_user_mask(mask: torch.Tensor, batch: int, new: int, cached: int) -> torch.Tensor:
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


def kept_to_tensor(kept: KeptIndices, batch: int, new: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


def check_logit_vocab(vocab: int | None, vocab_size: int) -> int | None:
    """``None`` / 0 = the whole vocabulary; otherwise 1..vocab_size."""
    if not vocab:
        return None
    if not 1 <= vocab <= vocab_size:
        raise UserError(f"draft_vocab={vocab} is outside 1..{vocab_size} (the model's vocabulary); use 0 for all ids")
    return None if vocab == vocab_size else int(vocab)


def limited_logits(scored: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 logits over the whole vocabulary from ``scored`` (the lowest ids); ids beyond it get -inf, so their
    probability is exactly 0 under any temperature, top-k or top-p."""
    full = scored.new_full((*scored.shape[:-1], vocab_size), float("-inf"), dtype=torch.float32)
    full[..., : scored.shape[-1]] = scored
    return full


def as_batch(tokens: Sequence[int], device) -> torch.Tensor:
    """One row of token ids, as ``forward`` takes them."""
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


def check_same_vocab(target, draft) -> None:
    """Refuse a drafter whose vocabulary differs from the target's (its token ids would mean other tokens)."""
    t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
    if t_vocab != d_vocab:
        raise UserError(
            f"drafter vocab_size {d_vocab} differs from the target's {t_vocab}: the drafter must share "
            "the target's tokenizer (train one with recipe=draftlm_* for this target)"
        )
