"""SAGUARO sampling (docs/algorithms/ssd.md §6) and the proposals SSD's verifier checks draft tokens against.

SAGUARO scales the draft probability of the ``top`` best tokens by ``C`` and renormalises, so a rejection's
residual ``(p − q')⁺`` lands more often on the tokens the speculation cache forked on. Any such rule is lossless
as long as the verifier uses the very ``q'`` the token was drawn from, so the sampler (draft side) and the verifier
(target side) both call :func:`proposal_probs` on the same raw logits with the same ``top`` and ``C``.

Proposal kinds per drafted token (one int per token, travelling with the speculation):

* ``NEURAL`` -- drawn from ``saguaro(warp(logits), top, C)``: a cache hit or the JIT fallback.
* ``POINT`` -- a deterministic token (the n-gram fast fallback): the proposal is a point mass at the token.
* ``UNIFORM`` -- a uniformly random token (the random fast fallback): the proposal is uniform over the vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import SamplingParams, sample

NEURAL, POINT, UNIFORM = 0, 1, 2


def check_c(c: float) -> None:
    if not 0.0 < c <= 1.0:
        raise ValueError(f"SAGUARO C must be in (0, 1] (1 = plain sampling), got {c}")


def saguaro_probs(probs: Tensor, rank_logits: Tensor, top: Tensor | int, c: float) -> Tensor:
    """``σ_{F,C}``: probs [..., V] with the ``top`` [...] highest-ranked tokens (by ``rank_logits``) scaled by
    ``c``, renormalised. ``top`` = 0 leaves a row unchanged. Ranking by raw logits keeps the set identical under
    temperature and top-k/top-p (which only rescale or zero the tail)."""
    check_c(c)
    top = torch.as_tensor(top, device=probs.device).expand(probs.shape[:-1])
    if c == 1.0 or not bool((top > 0).any()):
        return probs
    width = int(top.max())
    order = rank_logits.topk(min(width, probs.shape[-1]), dim=-1).indices  # [..., width]
    in_top = torch.arange(order.shape[-1], device=probs.device) < top.unsqueeze(-1)  # first `top` of each row
    scale = torch.ones_like(probs).scatter(-1, order, torch.where(in_top, c, 1.0).to(probs.dtype))
    scaled = probs * scale
    return scaled / scaled.sum(dim=-1, keepdim=True)


def proposal_probs(
    tokens: Tensor, logits: Tensor, kinds: Tensor, tops: Tensor, c: float, sampling: SamplingParams
) -> Tensor:
    """The distribution each drafted token [..., K] was drawn from, [..., K, V] (float64 for the verifier).
    ``logits`` [..., K, V] are the raw draft logits (ignored for POINT / UNIFORM tokens)."""
    vocab = logits.shape[-1]
    neural = saguaro_probs(sampling.warp(logits.double()), logits, tops, c)
    point = torch.nn.functional.one_hot(tokens.long(), vocab).to(neural.dtype)
    uniform = torch.full_like(neural, 1.0 / vocab)
    kinds = kinds.to(neural.device).unsqueeze(-1)
    return torch.where(kinds == NEURAL, neural, torch.where(kinds == POINT, point, uniform))


def saguaro_sample(
    logits: Tensor, top: Tensor | int, c: float, sampling: SamplingParams, generator: torch.Generator | None
) -> Tensor:
    """Draw one token per row of raw draft logits [..., V] from ``σ_{top,C}(warp(logits))``. Greedy decoding is
    the argmax (the scaling never changes a point mass) and draws nothing."""
    probs = saguaro_probs(sampling.warp(logits.double()), logits, top, c)  # bit-identical to the verifier's q'
    return sample(probs, generator)
