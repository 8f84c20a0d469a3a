"""Logit warping and token sampling shared by every drafter and target.

Losslessness needs the draft and the target distributions to be warped the same way, so both go through
`warp_probs`. Every random draw takes an injected `torch.Generator` so runs are reproducible.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from core.errors import UserError


def validate_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ValueError (one line) unless temperature >= 0, top_k >= 0 (0 = off) and 0 < top_p <= 1."""
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise UserError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
        raise UserError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; temperature 0 means greedy (top_k/top_p are then irrelevant)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warp(self, logits: Tensor) -> Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)


def warp_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Turn logits [..., V] into probabilities [..., V]: temperature, then top-k, then top-p (HF order).

    Temperature 0 gives a one-hot at the argmax (ties go to the lowest id, as torch.argmax does).
    """
    validate_sampling(temperature, top_k, top_p)
    if not logits.is_floating_point():
        logits = logits.float()
    if temperature == 0:  # (a scatter into zeros: one_hot's int64 tensor and its cast cost twice as much)
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # Shifted by the max before dividing: logits / 1e-45 overflow to inf and softmax gives NaN, while the shifted
    # scores are <= 0, so a tiny temperature gives the argmax's one-hot (softmax ignores the shift).
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if 0 < top_k < scores.shape[-1]:
        scores = _keep_top_k(scores, top_k)
    if top_p < 1.0:
        scores = _keep_top_p(scores, top_p)
    return scores.softmax(dim=-1)


def _keep_top_k(scores: Tensor, k: int) -> Tensor:
    # Tokens tied with the k-th score are kept: deterministic, and matches HF's TopKLogitsWarper.
    kth_best = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth_best, float("-inf"))


def _keep_top_p(scores: Tensor, top_p: float) -> Tensor:
    # Keep the smallest high-probability set whose mass reaches top_p; the best token always survives.
    probs = scores.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def is_point_mass(probs: Tensor) -> bool:
    """True when every row [..., V] has exactly one nonzero entry (e.g. greedy one-hot rows)."""
    return bool((torch.count_nonzero(probs, dim=-1) == 1).all())


def random_device(generator: torch.Generator | None, device: torch.device) -> torch.device:
    """Where a random draw runs: on the injected generator's device (a CPU generator gives the same stream whatever
    device the model is on; a CUDA tensor cannot take it), else on ``device``."""
    return generator.device if generator is not None else device


def sample(probs: Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """Draw one token id per row of probs [..., V] -> ids [...].

    Point-mass rows (greedy) are resolved by argmax without touching the generator, so greedy decoding
    consumes no randomness. Otherwise torch.multinomial with the injected generator (None = default RNG).
    """
    if is_point_mass(probs):
        return probs.argmax(dim=-1)
    rows = probs.reshape(-1, probs.shape[-1])
    ids = torch.multinomial(rows.to(random_device(generator, rows.device)), 1, generator=generator).to(rows.device)
    return ids.reshape(probs.shape[:-1])
