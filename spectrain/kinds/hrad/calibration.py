"""H-RAD's calibration after training: the softmax temperature fitted on validation logits (never worse than T=1)
and, for ``confidence_path=logit``, the late-fusion refit of the MLP's weight and the confidence path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.drafters.hrad import NUM_CLASSES


def minimise_lbfgs(params: list[torch.Tensor], loss_fn, max_iter: int) -> None:
    """Minimise ``loss_fn()`` over ``params`` in place (LBFGS, strong-Wolfe line search): the small convex fits
    done after training (temperature, late fusion)."""
    optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    optimizer.step(closure)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, max_iter: int = 100) -> float:
    """The softmax temperature minimising the NLL of ``labels`` (LBFGS over log T); 1.0 if that is no better."""
    logits, labels = logits.detach().double(), labels.long()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    minimise_lbfgs([log_t], lambda: F.cross_entropy(logits / log_t.exp(), labels), max_iter)
    temperature = float(log_t.detach().exp())
    if not math.isfinite(temperature):
        return 1.0
    with torch.no_grad():
        better = F.cross_entropy(logits / temperature, labels) <= F.cross_entropy(logits, labels)
    return temperature if better else 1.0


def fit_late_fusion(
    mlp_logits: torch.Tensor,
    confidence: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor | None = None,
    max_iter: int = 200,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``confidence_path=logit``'s stacking step: (α >= 0, W [3, 1], b [3]) minimising the (class-weighted) NLL of
    ``labels`` under logits = α·``mlp_logits`` + W·``confidence`` + b on held-out rows (LBFGS; ``confidence`` [n, 1]
    standardised). The MLP gets only the weight those rows support: where its logits do not generalise, α -> 0
    and the model is a logistic regression on the confidence (the rule's ranking)."""
    mlp_logits, confidence, labels = mlp_logits.detach().double(), confidence.detach().double(), labels.long()
    weight = None if weight is None else weight.detach().double()

    def fit(free_alpha: bool) -> tuple[float, torch.Tensor, torch.Tensor, float]:
        alpha = torch.tensor(1.0 if free_alpha else 0.0, dtype=torch.float64, requires_grad=free_alpha)
        w = torch.zeros(NUM_CLASSES, 1, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(NUM_CLASSES, dtype=torch.float64, requires_grad=True)
        params = [w, b] + ([alpha] if free_alpha else [])

        def loss_fn():
            return F.cross_entropy(alpha * mlp_logits + confidence @ w.T + b, labels, weight=weight)

        minimise_lbfgs(params, loss_fn, max_iter)
        with torch.no_grad():
            return float(alpha), w.detach(), b.detach(), float(loss_fn())

    alpha, w, b, loss = fit(True)
    if not (math.isfinite(loss) and alpha >= 0):  # a negative weight on the MLP is no model: confidence alone
        alpha, w, b, loss = fit(False)
    return alpha, w.float(), b.float()
