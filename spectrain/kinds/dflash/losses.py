"""DFlash training: anchors sampled in answer positions, the slots each block is scored on, and the loss.

Following vLLM's ``speculators`` (``models/dflash/utils.py:select_anchors``, ``losses/utils.py``), which the paper
(arXiv 2602.06036 §3.3) describes the same way:

* anchors: up to ``max_anchors`` distinct positions per sequence, uniformly without replacement among the
  answer tokens (``loss_mask``) that are not in the last ``block_size`` positions of the batch's width, sorted;
* slot ``k >= 1`` of anchor ``p`` is scored when token ``p + k`` is an answer token, against the target's
  distribution at ``p + k - 1`` restricted to the draft vocabulary (its softmax over those ids);
* loss = Σ w_k · KL(p_target ‖ q_draft) over the scored slots ÷ their number, with the per-position weight
  ``w_k = exp(-(k - 1) / γ)`` (slot 0, the anchor, 0): early slots matter most, because a rejection at slot k
  discards every later one. speculators' default γ = 4 (its ``fixed-exp-decay``; the paper uses 7 for blocks of
  16, 5 for 10, 4 for 8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.distributed import process_mean


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size]: 0 for the anchor slot, then exp(-(k - 1) / gamma)."""
    weights = torch.tensor([math.exp(-(k - 1) / gamma) for k in range(block_size)])
    weights[0] = 0.0
    return weights


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A], valid [B, A]) with A = the most any row got (<= ``max_anchors``). Each row's anchors are
    sorted; rows with fewer are padded at the FRONT with position 0 (``valid`` False), so every row stays sorted
    (the chunked attention reads less context that way)."""
    eligible = loss_mask.bool().clone()
    eligible[:, -block_size:] = False
    rows = []
    for row in eligible.cpu():
        candidates = row.nonzero().flatten()
        order = torch.randperm(len(candidates), generator=generator)[:max_anchors]
        rows.append(torch.sort(candidates[order]).values)
    width = max([len(r) for r in rows] + [1])
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, chosen in enumerate(rows):
        anchors[i, width - len(chosen) :] = chosen
        valid[i, width - len(chosen) :] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def scored_slots(
    anchors: torch.Tensor, valid: torch.Tensor, supervised: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, ...]:
    """The slots that carry a loss, as index lists: (row b, anchor a, slot k, position p + k) with k >= 1, the anchor
    valid and token p + k supervised."""
    slots = torch.arange(1, block_size, device=anchors.device)
    positions = anchors[..., None] + slots  # [B, A, K - 1]
    inside = positions < supervised.shape[1]
    rows = torch.arange(len(anchors), device=anchors.device)[:, None, None]
    scored = valid[..., None] & inside & supervised[rows, positions.clamp_max(supervised.shape[1] - 1)]
    b, a, k = scored.nonzero(as_tuple=True)
    return b, a, k + 1, positions[b, a, k]


def weighted_kl(student_logits: torch.Tensor, teacher_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_n w_n KL(teacher_n ‖ student_n) ÷ N over the global batch (``core.distributed.process_mean``)."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    p = teacher_probs.float()
    kl = (torch.special.xlogy(p, p) - p * log_q).sum(-1)
    return process_mean((weights.to(kl.dtype) * kl).sum(), torch.tensor(float(len(kl)), device=kl.device))
