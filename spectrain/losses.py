"""Training losses shared by every drafter (the online adapter reuses these, never a copy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.distributed import process_mean


def soft_cross_entropy(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -Σ_v p_teacher(v) log q_student(v) (= KL(p‖q) + H(p): same gradients).

    ``student_logits`` [..., V], ``teacher_probs`` [..., V], ``mask`` [...] (bool or 0/1). In data-parallel
    training the mean is over the global batch's masked positions (``core.distributed.process_mean``)."""
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    per_position = -(teacher_probs.float() * log_q).sum(dim=-1)
    mask = mask.to(per_position.dtype)
    return process_mean((per_position * mask).sum(), mask.sum())
