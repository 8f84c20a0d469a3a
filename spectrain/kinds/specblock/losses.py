"""SpecBlock training losses (docs/algorithms/specblock.md §5): valid-prefix draft loss, rank labels and the
ordinal rank loss, and the cross-block unrolling that feeds later blocks with the drafter's own hidden states.

Row frame (docs/algorithms/eagle3.md §1). Everything here works on *rows*: row ``r`` holds the target's distribution
over the draft vocabulary at position ``r + 1`` (``teacher_probs[:, r]`` = P̃_r, the law of token ``x_{r+2}``)
and the position mask ``pm[:, r]`` (token ``x_{r+2}`` is supervised and the target's argmax at ``r + 1`` lies in
the draft vocabulary). Slot ``k`` of anchor ``i`` in a block with cumulative offset ``off`` is scored against
row ``i + off + k``; rows past the end count as masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from core.distributed import process_mean, process_sum
from core.drafters.eagle3 import shift_left
from core.drafters.specblock import rank_bucket
from core.errors import UserError

NUM_RANK_BUCKETS = 4
RANK_SEARCH = 10  # the label's rank is searched in the top-10 draft logits; outside => rank 11 ("> 10")
RANK_MASKS = ("rank_chain", "draft_chain")
# How slot k's draft loss weighs and normalises its rows (w = weight, n = normaliser; Σ over one block's rows):
#   chain      (the reference)  w = valid-prefix chain · valid,  n = Σ w     (each slot over its own surviving rows)
#   slot0_norm                  w = valid-prefix chain · valid,  n = Σ w_0   (every slot over slot 0's row count)
#   valid                       w = anchor · valid (no chain),   n = Σ w
VALID_PREFIX = ("chain", "slot0_norm", "valid")


def rows_ahead(x: torch.Tensor, n: int, fill: float | bool = 0) -> torch.Tensor:
    """``x`` [B, S, ...] with row ``r`` replaced by row ``r + n`` (rows past the end set to ``fill``)."""
    return shift_left(x, n, fill=fill)


# ---------------------------------------------------------------------------------------------------------
# Rank labels, smoothing, frequency weights


def rank_of(logits: torch.Tensor, target_ids: torch.Tensor, search: int = RANK_SEARCH) -> torch.Tensor:
    """1-based rank of ``target_ids`` [...] inside ``logits`` [..., V], searched in the top-``search``;
    ``search + 1`` when it is not there (the code's top-10 search, §5)."""
    top = logits.detach().topk(min(search, logits.shape[-1]), dim=-1).indices
    hits = top == target_ids.unsqueeze(-1)
    first = hits.float().argmax(-1) + 1
    return torch.where(hits.any(-1), first, torch.full_like(first, search + 1))


def rank_labels(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Rank-head label per slot: the bucket of the target token's rank in the draft logits (1 | 2–4 | 5–10 | >10)."""
    return rank_bucket(rank_of(logits, target_ids))


def smoothing_table(n: int = NUM_RANK_BUCKETS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Asymmetric ordinal label smoothing, row t = soft target s(·|t) ∝ 1 / (1 + |c−t| + max(t−c, 0))².
    Under-estimating the bucket (c < t) sits farther away than over-estimating: a too-narrow tree loses tokens."""
    t = torch.arange(n, dtype=torch.float64)[:, None]
    c = torch.arange(n, dtype=torch.float64)[None, :]
    raw = 1.0 / (1.0 + (c - t).abs() + (t - c).clamp(min=0)) ** 2
    return (raw / raw.sum(-1, keepdim=True)).to(dtype)


def frequency_weights(
    labels: torch.Tensor, valid: torch.Tensor, budget: float = 10.0, n: int = NUM_RANK_BUCKETS
) -> torch.Tensor:
    """Per-class weights ``min(1, budget / count_c)`` [n], ``count_c`` = valid samples with label c (one slot of
    the local batch); classes with no samples get 1. ``budget <= 0`` disables (all ones)."""
    if budget <= 0:
        return torch.ones(n, device=labels.device)
    # Counted over the global batch in data-parallel training, as one process with all of it counts.
    counts = process_sum(torch.bincount(labels[valid.bool()].flatten(), minlength=n).float())
    return torch.where(counts > 0, (budget / counts.clamp(min=1.0)).clamp(max=1.0), torch.ones_like(counts))


# ---------------------------------------------------------------------------------------------------------
# One block


@dataclass
class BlockLosses:
    """Losses and bookkeeping of one block. ``draft`` [K]: per-slot masked mean soft CE; ``rank``: scalar;
    ``correct`` [B, S, K] greedy slot matches; ``draft_weight`` [B, S, K] the draft loss's row weights
    (valid-prefix weights unless ``valid_prefix="valid"``); ``draft_count`` [K] each slot's normaliser (this
    process's rows); ``labels`` / ``rank_pred`` [B, S, K] rank buckets; ``slot_valid`` [B, S, K] anchor valid and
    target row supervised (the set acceptance and rank metrics count)."""

    draft: torch.Tensor
    rank: torch.Tensor
    correct: torch.Tensor
    draft_weight: torch.Tensor
    labels: torch.Tensor
    rank_pred: torch.Tensor
    slot_valid: torch.Tensor
    draft_count: torch.Tensor


def block_losses(
    logits: torch.Tensor,
    rank_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    position_mask: torch.Tensor,
    off: int,
    *,
    rank_mask: str = "rank_chain",
    freq_budget: float = 10.0,
    valid_prefix: str = "chain",
) -> BlockLosses:
    """§5 losses of one block: ``logits`` [B, S, K, Vd], ``rank_logits`` [B, S, K, 4], ``teacher_probs``
    [B, S, Vd] and ``position_mask`` [B, S] in the row frame, ``off`` the block's cumulative offset.
    ``valid_prefix``: how each slot's draft loss weighs and normalises its rows (``VALID_PREFIX``; ``chain`` is
    the reference). The rank loss's ``draft_chain`` mask is the valid-prefix chain in every mode."""
    if rank_mask not in RANK_MASKS:
        raise UserError(f"rank_mask must be one of {', '.join(RANK_MASKS)}, got '{rank_mask}'")
    if valid_prefix not in VALID_PREFIX:
        raise UserError(f"valid_prefix must be one of {', '.join(VALID_PREFIX)}, got '{valid_prefix}'")
    K = logits.shape[2]
    pm = position_mask.bool()
    anchor = pm.float()  # the chain starts from the offset-0 mask in every block (as the code does)
    chain, rank_chain = anchor, anchor
    table = smoothing_table(rank_logits.shape[-1]).to(rank_logits.device)
    draft, correct, weights, labels, preds, valid_slots, counts = [], [], [], [], [], [], []
    rank_num = logits.new_zeros((), dtype=torch.float32)
    rank_den = logits.new_zeros((), dtype=torch.float32)
    for k in range(K):
        target = rows_ahead(teacher_probs, off + k)
        valid = rows_ahead(pm, off + k, fill=False).float()
        student = logits[:, :, k]
        # valid-prefix: the slot counts only while every earlier slot of this anchor was greedy-correct
        prefix = chain * valid
        w = anchor * valid if valid_prefix == "valid" else prefix
        count = counts[0] if valid_prefix == "slot0_norm" and k > 0 else w.sum()
        log_q = F.log_softmax(student.float(), dim=-1)
        ce = -(target.float() * log_q).sum(-1)
        draft.append(process_mean((w * ce).sum(), count))
        counts.append(count)
        target_ids = target.argmax(-1)
        hit = student.detach().argmax(-1) == target_ids
        chain = chain * hit.float()

        label = rank_labels(student, target_ids)
        rank_k = rank_logits[:, :, k].float()
        pred = rank_k.detach().argmax(-1)
        sample = rank_chain * valid if rank_mask == "rank_chain" else prefix  # code's chain | paper: draft prefix
        class_w = frequency_weights(label, sample > 0, freq_budget, rank_k.shape[-1])[label]
        distance = 1.0 + (label - pred).abs() + (label - pred).clamp(min=0)  # under-estimates cost double
        rank_ce = -(table[label] * F.log_softmax(rank_k, -1)).sum(-1)
        rank_num = rank_num + (rank_ce * distance * class_w * sample).sum()
        rank_den = rank_den + (class_w * sample).sum()
        # the code's chain breaks after the first rank error, the erroneous slot included
        rank_chain = rank_chain * (pred == label).float()

        correct.append(hit)
        weights.append(w)
        labels.append(label)
        preds.append(pred)
        valid_slots.append((anchor * valid).bool())
    return BlockLosses(
        torch.stack(draft),
        process_mean(rank_num, rank_den),
        torch.stack(correct, -1),
        torch.stack(weights, -1),
        torch.stack(labels, -1),
        torch.stack(preds, -1),
        torch.stack(valid_slots, -1),
        torch.stack(counts),
    )


# ---------------------------------------------------------------------------------------------------------
# Cross-block unrolling


@dataclass
class Unrolled:
    """Per block: its ``BlockLosses``, the cumulative offset it was scored at, and the cut that left it."""

    blocks: list[BlockLosses]
    offsets: list[int]
    cuts: list[int]


def unroll_blocks(
    drafter: Any,
    aux_hidden: torch.Tensor,
    tokens: torch.Tensor,
    teacher_probs: torch.Tensor,
    position_mask: torch.Tensor,
    cuts: Sequence[int],
    *,
    rank_mask: str = "rank_chain",
    freq_budget: float = 10.0,
    attention: str = "block_sparse",
    valid_prefix: str = "chain",
) -> Unrolled:
    """Cross-block training (§5): ``len(cuts) + 1`` blocks. Block 1 reads target features ``aux_hidden``
    [B, S, 3·H_t] and ``tokens`` [B, S] in the row frame (row i holds x_{i+1}); leaving a block at cut ``M``
    (1..K, one value for the whole batch), the next block reads the pre-norm hidden of slot ``M − 1`` of every
    anchor and the tokens ``M`` rows further on, attends to this block's K/V (kept with gradient, TTT) over
    slots ``< M`` of the same anchor, and is scored ``M`` rows further on. No cross-block filtering.
    ``attention``: the drafter's ``forward_block`` attention (``block_sparse`` or the ``dense`` reference);
    ``valid_prefix``: the draft loss's row weights and normalisers (:func:`block_losses`)."""
    K = drafter.config.block_size
    if any(not 1 <= m <= K for m in cuts):
        raise ValueError(f"cross-block cuts must lie in 1..{K} (block_size), got {list(cuts)}")
    cond, toks, off = aux_hidden, tokens, 0
    first_kv, ttt_kv, ttt_valid = None, [], []
    blocks, offsets = [], []
    for b in range(len(cuts) + 1):
        out = drafter.forward_block(
            cond,
            toks,
            from_target=(b == 0),
            first_block_kv=first_kv,
            ttt_kv=tuple(ttt_kv),
            ttt_valid=tuple(ttt_valid),
            attention=attention,
        )
        blocks.append(
            block_losses(
                out.logits,
                out.rank_logits,
                teacher_probs,
                position_mask,
                off,
                rank_mask=rank_mask,
                freq_budget=freq_budget,
                valid_prefix=valid_prefix,
            )
        )
        offsets.append(off)
        if b < len(cuts):
            m = int(cuts[b])
            first_kv = first_kv if first_kv is not None else out.kv
            ttt_kv.append(out.kv)
            ttt_valid.append(m)
            cond, toks, off = out.hidden[:, :, m - 1], rows_ahead(toks, m), off + m
    return Unrolled(blocks, offsets, list(cuts))


def total_loss(unrolled: Unrolled, *, slot_weight: float = 0.8, rank_weight: float = 1.0) -> torch.Tensor:
    """``Σ_k slot_weight^k Σ_b L_draft[b, k] + rank_weight · Σ_b L_rank[b]`` (§5 total objective)."""
    draft = torch.stack([b.draft for b in unrolled.blocks]).sum(0)
    decay = slot_weight ** torch.arange(draft.numel(), device=draft.device, dtype=draft.dtype)
    loss = (decay * draft).sum()
    if rank_weight:
        loss = loss + rank_weight * torch.stack([b.rank for b in unrolled.blocks]).sum()
    return loss
