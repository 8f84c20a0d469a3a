"""EAGLE-3's training-time-test loss: the teacher in the draft vocabulary, per-step targets and the weighted sum.

Shared by the LightningModule (``spectrain.kinds.eagle3.module``) and the serving-time adapter (``spectrain.adapt``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.distributed import process_mean
from core.drafters.eagle3 import shift_left
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import token_acceptance

# model.objective: the soft cross-entropy alone, or with the expected accepted length (docs/algorithms/eagle3.md §9)
OBJECTIVES = ("kl", "accept")


def teacher_in_draft_vocab(logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [..., V] restricted to the draft vocabulary [..., Vd], and whether the target's argmax is in
    it [...] (EAGLE-3's position mask)."""
    return logits[..., t2d], t2d[logits.argmax(-1)]


def ttt_targets(
    teacher_logits: torch.Tensor, in_vocab: torch.Tensor, supervised: torch.Tensor, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per TTT step j: (teacher probs [B, T, Vd], mask [B, T]) aligned with the drafter's rows.

    ``teacher_logits`` [B, T, Vd] / ``in_vocab`` [B, T]: the target's distribution at position t (over the draft
    vocabulary) and whether its argmax is drafted; ``supervised`` [B, T]: tokens that carry a loss. Row i at step
    j predicts token i+2+j from the target's distribution at position i+1+j. Shared by training and the online
    adapter (``spectrain.adapt``)."""
    targets = []
    for j in range(steps):
        teacher = shift_left(teacher_logits, j + 1).softmax(-1)
        mask = shift_left(supervised, j + 2, fill=False) & shift_left(in_vocab, j + 1, fill=False)
        targets.append((teacher, mask))
    return targets


def teacher_rows(
    project: Any, last_hidden: torch.Tensor, supervised: torch.Tensor, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher at the positions a training-time-test loss reads, computed once for every step.

    Step j's row i is scored against the target's distribution at p = i+1+j when token p+1 is supervised and the
    target's argmax at p is drafted, so the positions needed are the same for every j. Returns ``index`` [B, T]
    (teacher row of position p, -1 where p is never scored) and ``probs`` [N, Vd] (draft-vocabulary softmax).
    ``project`` maps final hidden states [N, H] to the target's logits [N, V]."""
    need = shift_left(supervised, 1, fill=False)
    b, p = need.nonzero(as_tuple=True)
    restricted, in_vocab = teacher_in_draft_vocab(project(last_hidden[b, p]), t2d)
    keep = in_vocab.nonzero(as_tuple=True)[0]
    index = torch.full(supervised.shape, -1, dtype=torch.long, device=supervised.device)
    index[b[keep], p[keep]] = torch.arange(len(keep), device=supervised.device)
    return index, restricted[keep].softmax(-1)


def scored_rows(index: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (batch b, row i) that step ``step`` scores, and their teacher rows n (``teacher_rows``' index): the
    same rows as ``ttt_targets``' mask, as index lists."""
    shifted = shift_left(index, step + 1, fill=-1)
    b, i = (shifted >= 0).nonzero(as_tuple=True)
    return b, i, shifted[b, i]


def ttt_loss(
    students: Sequence[torch.Tensor],
    teachers: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    step_weight: float,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ_j step_weight^j · soft-CE(student_j, teacher_j, mask_j), and the unweighted per-step losses."""
    losses = [soft_cross_entropy(s, t, m) for s, t, m in zip(students, teachers, masks)]
    return torch.stack([step_weight**j * loss for j, loss in enumerate(losses)]).sum(), losses


def expected_accepted_length(
    students: Sequence[torch.Tensor],
    teachers: Sequence[torch.Tensor],
    rows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    shape: torch.Size | tuple[int, int],
) -> torch.Tensor:
    """Mean over chain starts of Σ_k Π_{j≤k} α_j, differentiable in the students' logits.

    Per step j: ``students[j]`` [N_j, Vd], ``teachers[j]`` [N_j, Vd] and ``rows[j]`` (batch b, row i) [N_j] are the
    rows step j scores (``scored_rows``); α_j = Σ_v min(p_j(v), q_j(v)), the probability that a sampled draft at
    step j is accepted. The chain starting at row i reads step j at row i (it drafts token i+2+j); a chain starts
    at every row step 0 scores and ends at the first step that does not score its row (past the answer, or where
    the target's argmax is outside the draft vocabulary): that step's α counts as 0. With γ steps this is the
    sampled τ_sim − 1 of the batch (``spectrain.metrics``)."""
    total = torch.zeros((), device=students[0].device)
    product = None
    for student, teacher, (b, i) in zip(students, teachers, rows):
        alpha = torch.zeros(shape, device=student.device).index_put((b, i), token_acceptance(student, teacher, False))
        product = alpha if product is None else product * alpha
        total = total + product.sum()
    starts = torch.tensor(float(len(rows[0][0])), device=total.device)
    return process_mean(total, starts)


def acceptance_term(accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """−log(E[accepted] / γ), what ``objective=accept`` adds (times its weight) to the cross-entropy: ≥ 0, and 0 when
    every chain keeps all γ drafts. Its gradient is E's divided by E, so it does not vanish while every α is small
    (a young drafter's near-uniform q puts ~1/V on every token: E and its own gradient are tiny)."""
    return -(accepted / gamma).clamp_min(1e-6).log()
