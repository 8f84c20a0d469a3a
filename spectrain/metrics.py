"""torchmetrics for drafters: simulated acceptance, the training-time proxy for what the engine will see.

Per token t, with target distribution p_t and draft distribution q_t (teacher forcing):
- greedy: α_t = 1[argmax q_t == argmax p_t]; sampling (T=1): α_t = Σ_v min(p_t(v), q_t(v)).
A chain of γ drafts starting at t keeps its first k tokens with probability Π_{i<k} α_{t+i}, so
``tau_sim = 1 + Σ_{k=1..γ} E[Π_{i<k} α_{t+i}] = 1 + Σ_k Π_{i≤k} acc_i`` where ``acc_k`` is the per-position
(conditional) acceptance logged as ``acc_k``.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def token_acceptance(student_logits: torch.Tensor, teacher_probs: torch.Tensor, greedy: bool) -> torch.Tensor:
    """α_t per position, shape [...] from [..., V] inputs."""
    if greedy:
        return (student_logits.argmax(-1) == teacher_probs.argmax(-1)).float()
    q = student_logits.float().softmax(-1)
    return torch.minimum(q, teacher_probs.float()).sum(-1)


class SimulatedAcceptance(Metric):
    """Accumulates E[Π_{i<k} α_{t+i}] for k = 1..γ over chain starts whose whole window is valid."""

    full_state_update = False

    def __init__(self, gamma: int = 4):
        super().__init__()
        self.gamma = gamma
        self.add_state("chain_sums", default=torch.zeros(gamma, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("starts", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, alpha: torch.Tensor | list[torch.Tensor], valid: torch.Tensor | list[torch.Tensor]) -> None:
        """``alpha`` [B, T] per-token acceptance along the sequence, ``valid`` [B, T] where the token counts;
        or lists of γ such tensors for chains read across training-time-test steps (``_update_chains``)."""
        if isinstance(alpha, (list, tuple)):
            self._update_chains(alpha, valid)
            return
        alpha = alpha.double() * valid
        length = alpha.shape[1] - self.gamma + 1
        if length <= 0:
            return
        window_valid = torch.ones_like(alpha[:, :length], dtype=torch.bool)
        for k in range(self.gamma):  # a start counts only if its whole γ-window is inside the sequence
            window_valid &= valid[:, k : k + length].bool()
        product = torch.ones_like(alpha[:, :length])
        for k in range(self.gamma):
            product = product * alpha[:, k : k + length]
            self.chain_sums[k] += (product * window_valid).sum()
        self.starts += window_valid.sum()

    def _update_chains(self, alpha_steps: list[torch.Tensor], valid_steps: list[torch.Tensor]) -> None:
        """Chains read across training-time-test steps: ``alpha_steps[k]`` [B, T] is the acceptance of chain
        position k+1 for the chain starting at row t (EAGLE-3: step k at row t drafts token t+2+k)."""
        product = torch.ones_like(alpha_steps[0], dtype=torch.float64)
        window_valid = torch.ones_like(alpha_steps[0], dtype=torch.bool)
        for k in range(self.gamma):
            window_valid &= valid_steps[k].bool()
        for k in range(self.gamma):
            product = product * alpha_steps[k].double()
            self.chain_sums[k] += (product * window_valid).sum()
        self.starts += window_valid.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        chains = self.chain_sums / self.starts.clamp(min=1.0)  # E[Π_{i<k} α] for k = 1..γ
        previous = torch.cat([torch.ones(1, dtype=chains.dtype, device=chains.device), chains[:-1]])
        per_position = torch.where(previous > 0, chains / previous, torch.zeros_like(chains))
        out = {"tau_sim": 1.0 + chains.sum()}
        out.update({f"acc_{k + 1}": per_position[k] for k in range(self.gamma)})
        return out
