"""Verifiers: decide how much of a draft the target keeps, without changing the target's output law.

Chain verifiers (docs/architecture.md §6.3) share one call signature, batch 1:

    verifier(draft_tokens [γ], draft_probs [γ, V] | None, target_probs [γ+1, V], generator) -> VerifyResult

- `draft_probs` are the (warped) draft distributions the tokens were sampled from. None means the tokens were
  chosen deterministically (argmax / top-k): q is a point mass at each drafted token (docs/algorithms/verify.md §3).
- `target_probs[t]` is the target's (identically warped) distribution after the first t draft tokens;
  row γ is the bonus distribution.
- The result holds the accepted draft prefix plus exactly one correction/bonus token.
- Greedy decoding needs no special path: with one-hot target rows every verifier returns exactly the target's
  greedy tokens and consumes no randomness.
- EOS is the caller's job: truncate the emitted tokens after the first EOS (and drop the bonus after an
  accepted EOS) before committing them.

Each chain verifier first builds a `VerifyPlan` (per-position stop probabilities plus the distribution of
the emitted token at each stop). The plan gives both the exact output law (used by the enumeration tests)
and the sampling path (used by the engine), so the tests check the code that runs.

Spec: docs/algorithms/verify.md §2, §3; docs/algorithms/hsd.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import UserError
from inference.sampling import random_device, sample

FinalRatio = Literal["capped", "uncapped"]
_TINY = 1e-300  # stands in for q(x) = 0 so ratios stay finite (such a draft has zero probability anyway)


class LossyVerifierWarning(UserWarning):
    """A verifier whose output does not follow the target distribution was constructed."""


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    tokens: torch.LongTensor  # accepted draft tokens + one correction/bonus token: len = num_accepted + 1


# --------------------------------------------------------------------------------------------------------
# Plans: the exact law of (τ = number accepted, emitted token), and sampling from it
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyPlan:
    """What a chain verifier will do with one draft (leading batch dims allowed for the law methods).

    stop_probs [..., γ+1]: probability of stopping at level t when the scan reaches it.
        Forward scan (tokenwise): t = 0, 1, .., γ; stop_probs[t] = 1 − accept prob of x_{t+1}; [γ] = 1.
        Backward scan (block/HSD): t = γ, γ−1, .., 0; stop_probs[t] = h_t; [0] = 1.
    residuals [..., γ+1, V]: law of the emitted token when stopping at t (row γ = bonus distribution).
    """

    stop_probs: Tensor
    residuals: Tensor
    backward: bool

    def tau_law(self) -> Tensor:
        """P(τ = t) for t = 0..γ, shape [..., γ+1]."""
        stops = self.stop_probs.flip(-1) if self.backward else self.stop_probs
        survive = torch.cumprod(1.0 - stops, dim=-1)
        reached = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
        law = stops * reached
        return law.flip(-1) if self.backward else law

    def outcome_law(self) -> Tensor:
        """P(τ = t, emitted token = v), shape [..., γ+1, V]; sums to 1 over the last two dims."""
        return self.tau_law().unsqueeze(-1) * self.residuals

    def draw(
        self, generator: torch.Generator | None = None, num_samples: int = 1
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Sample (τ [n], emitted token [n]) for an unbatched plan by running the scan on uniforms."""
        if self.stop_probs.dim() != 1:
            raise ValueError(f"draw needs an unbatched plan, got stop_probs of shape {tuple(self.stop_probs.shape)}")
        stops = self.stop_probs.flip(0) if self.backward else self.stop_probs
        if bool(((stops > 0) & (stops < 1)).any()):
            u = torch.rand(
                (num_samples, stops.numel()),
                generator=generator,
                dtype=stops.dtype,
                device=random_device(generator, stops.device),
            ).to(stops.device)
            stopped = u < stops  # P(u < s) = s for u ~ U[0, 1)
        else:  # every decision is certain (e.g. greedy): no randomness needed
            stopped = (stops == 1).expand(num_samples, -1)
        # The scan's last level always stops (bonus at γ, or h_0 = 1), so a first stop always exists.
        first_stop = stopped.to(torch.uint8).argmax(dim=-1)
        tau = stops.numel() - 1 - first_stop if self.backward else first_stop
        return tau, sample(self.residuals[tau], generator)


def _check_chain_shapes(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> None:
    gamma = draft_tokens.shape[-1]
    shape_ok = target_probs.dim() >= 2 and target_probs.shape[:-1] == (*draft_tokens.shape[:-1], gamma + 1)
    if not shape_ok:
        raise ValueError(
            f"target_probs must be [..., γ+1, V] with γ={gamma}, got {tuple(target_probs.shape)} "
            f"for draft_tokens {tuple(draft_tokens.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (*draft_tokens.shape, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [..., γ, V] = {(*draft_tokens.shape, target_probs.shape[-1])}, "
            f"got {tuple(draft_probs.shape)}"
        )


def _as_float64(
    draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(p [..., γ+1, V], q [..., γ, V], x [..., γ, 1]) in float64; q = one-hot at x for deterministic drafts."""
    _check_chain_shapes(draft_tokens, draft_probs, target_probs)
    p = target_probs.to(torch.float64)
    x = draft_tokens.long().unsqueeze(-1)
    if draft_probs is None:
        q = F.one_hot(draft_tokens.long(), p.shape[-1]).to(torch.float64)
    else:
        q = draft_probs.to(torch.float64)
    return p, q, x


def _normalise_or(mass: Tensor, fallback: Tensor) -> Tensor:
    # A residual with zero mass can only be selected through round-off; the spec says sample from p then.
    total = mass.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, mass / torch.where(total > 0, total, 1.0), fallback)


def tokenwise_plan(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> VerifyPlan:
    """Tokenwise speculative sampling (docs/algorithms/verify.md §2); draft_probs None: the rule of §3."""
    p, q, x = _as_float64(draft_tokens, draft_probs, target_probs)
    p_draft = p[..., :-1, :]
    p_x = p_draft.gather(-1, x).squeeze(-1)
    q_x = q.gather(-1, x).squeeze(-1)
    accept = (p_x / q_x.clamp_min(_TINY)).clamp_max(1.0)
    stop_probs = torch.cat([1.0 - accept, accept.new_ones((*accept.shape[:-1], 1))], dim=-1)
    rejected_law = _normalise_or((p_draft - q).clamp_min(0.0), p_draft)  # = p with x zeroed if q is one-hot
    residuals = torch.cat([rejected_law, p[..., -1:, :]], dim=-2)
    return VerifyPlan(stop_probs, residuals, backward=False)


def block_plan(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    final_ratio: FinalRatio = "capped",
) -> VerifyPlan:
    """Block Verification = HSD with the capped final ratio (docs/algorithms/hsd.md §2–4), float64 in log-ratio space.

    final_ratio="uncapped" uses h_γ = min(1, r_γ) (the HSD authors' code): lossy for sampled drafts.
    """
    if final_ratio not in ("capped", "uncapped"):
        raise UserError(f"final_ratio must be 'capped' or 'uncapped', got {final_ratio!r}")
    p, q, x = _as_float64(draft_tokens, draft_probs, target_probs)
    p_draft = p[..., :-1, :]
    p_x = p_draft.gather(-1, x).squeeze(-1)
    q_x = q.gather(-1, x).squeeze(-1)
    # log r_t = Σ_{i≤t} log(p_i(x_i)/q_i(x_i)); raw products of probabilities underflow on long drafts.
    log_a = p_x.log() - q_x.clamp_min(_TINY).log()
    log_r = torch.cat([log_a.new_zeros((*log_a.shape[:-1], 1)), log_a.cumsum(dim=-1)], dim=-1)  # t = 0..γ
    log_cap = log_r.clamp_min(0.0).cummax(dim=-1).values  # log M_t, M_t = max(1, r_1..r_t)
    r_star = (log_r - log_cap).exp()  # capped prefix ratio r*_t = min(1, r*_{t-1}·a_t)

    deficit = (r_star[..., :-1, None] * p_draft - q).clamp_min(0.0)  # [.., γ, V] unnormalised residuals
    d_plus = deficit.sum(dim=-1)
    denom = d_plus + (1.0 - r_star[..., :-1])  # = max(d⁺, d⁻) since d⁻ = d⁺ + 1 − r*
    h = torch.where(denom > 0, d_plus / torch.where(denom > 0, denom, 1.0), 1.0)  # 0/0: stop
    if h.shape[-1] > 0:
        h[..., 0] = 1.0  # exact at the root (r*_0 = 1); pinned so the backward scan always terminates
    if final_ratio == "capped":
        h_final = r_star[..., -1:]
    else:
        h_final = log_r[..., -1:].exp().clamp_max(1.0)
    stop_probs = torch.cat([h, h_final], dim=-1)
    residuals = torch.cat([_normalise_or(deficit, p_draft), p[..., -1:, :]], dim=-2)
    return VerifyPlan(stop_probs, residuals, backward=True)


def tokenwise_outcome_law(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> Tensor:
    """Exact law of (τ, emitted token) [..., γ+1, V] under tokenwise verification."""
    return tokenwise_plan(draft_tokens, draft_probs, target_probs).outcome_law()


def block_outcome_law(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    final_ratio: FinalRatio = "capped",
) -> Tensor:
    """Exact law of (τ, emitted token) [..., γ+1, V] under block verification / HSD."""
    return block_plan(draft_tokens, draft_probs, target_probs, final_ratio).outcome_law()


# --------------------------------------------------------------------------------------------------------
# Chain verifiers (callables) and the registry
# --------------------------------------------------------------------------------------------------------


class ChainVerifier:
    """Base: subclasses define `plan`; calling the verifier samples from that plan."""

    name: str = "chain"
    lossless: bool = True

    def plan(self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> VerifyPlan:
        raise NotImplementedError

    def outcome_law(self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> Tensor:
        return self.plan(draft_tokens, draft_probs, target_probs).outcome_law()

    def __call__(
        self,
        draft_tokens: Tensor,
        draft_probs: Tensor | None,
        target_probs: Tensor,
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        if draft_tokens.dim() != 1:
            raise ValueError(f"verifiers take one sequence (1-D draft_tokens), got {tuple(draft_tokens.shape)}")
        tau, token = self.plan(draft_tokens, draft_probs, target_probs).draw(generator)
        num_accepted = int(tau.item())
        tokens = torch.cat([draft_tokens[:num_accepted].long(), token.to(draft_tokens.device)])
        return VerifyResult(num_accepted, tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TokenwiseVerifier(ChainVerifier):
    name = "tokenwise"

    def plan(self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> VerifyPlan:
        return tokenwise_plan(draft_tokens, draft_probs, target_probs)


class BlockVerifier(ChainVerifier):
    name = "block"

    def plan(self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> VerifyPlan:
        return block_plan(draft_tokens, draft_probs, target_probs, "capped")


class HSDVerifier(ChainVerifier):
    """Hierarchical Speculative Decoding. "capped" (default) is exactly Block Verification (lossless).

    "uncapped" reproduces the authors' final-step rule, lossy for sampled drafts (docs/algorithms/hsd.md §10).
    """

    name = "hsd"

    def __init__(self, final_ratio: FinalRatio = "capped") -> None:
        if final_ratio not in ("capped", "uncapped"):
            raise UserError(f"final_ratio must be 'capped' or 'uncapped', got {final_ratio!r}")
        self.final_ratio = final_ratio
        self.lossless = final_ratio == "capped"
        if not self.lossless:
            warnings.warn(
                "hsd final_ratio='uncapped' is the HSD authors' lossy rule: its output does not follow the "
                "target distribution and it is excluded from lossless claims",
                LossyVerifierWarning,
                stacklevel=2,
            )

    def plan(self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> VerifyPlan:
        return block_plan(draft_tokens, draft_probs, target_probs, self.final_ratio)

    def __repr__(self) -> str:
        return f"HSDVerifier(final_ratio={self.final_ratio!r})"


tokenwise = TokenwiseVerifier()
block = BlockVerifier()
hsd = HSDVerifier()

_VERIFIERS: dict[str, type[ChainVerifier]] = {
    "tokenwise": TokenwiseVerifier,
    "block": BlockVerifier,
    "hsd": HSDVerifier,
}


def get_verifier(name: str, **kwargs: object) -> ChainVerifier:
    """Build a chain verifier by name, e.g. get_verifier("hsd") (the lossless capped rule by default)."""
    if name not in _VERIFIERS:
        raise UserError(f"unknown verifier {name!r}; valid names: {', '.join(_VERIFIERS)}")
    return _VERIFIERS[name](**kwargs)


# --------------------------------------------------------------------------------------------------------
# Deterministic candidates: several drafted tokens at one position, and token trees
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateMatch:
    candidate_index: int | None  # which candidate survived, None if the emitted token matches none
    token: int  # the emitted token (always distributed as the target row)


def _first_match(candidate_tokens: Sequence[int], token: int) -> int | None:
    for i, candidate in enumerate(candidate_tokens):
        if candidate == token:
            return i
    return None


def _token_list(tokens: Tensor | Sequence[int]) -> list[int]:
    return tokens.tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]


def multi_candidate(
    candidates: Tensor | Sequence[int], target_probs: Tensor, generator: torch.Generator | None = None
) -> CandidateMatch:
    """Verify deterministic candidates y_1..y_k at one position (docs/algorithms/verify.md §3; the "Match").

    Draw z ~ p and keep the first candidate equal to z, otherwise emit z. Equivalent to testing the
    candidates one by one with p(y) and zeroing rejected ones; the emitted token is exactly z ~ p.
    Greedy (one-hot p) draws no randomness.
    """
    token = int(sample(target_probs, generator).item())
    return CandidateMatch(_first_match(_token_list(candidates), token), token)


@dataclass(frozen=True)
class TreeWalkResult:
    path: list[int]  # accepted node indices, root to deepest
    tokens: torch.LongTensor  # tokens of `path` followed by one correction/bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _children_by_row(parents: list[int]) -> list[list[int]]:
    """children[i + 1] = child node ids of node i in index order; children[0] = children of the root."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        if not -1 <= parent < len(parents) or parent == node:
            raise ValueError(f"node {node} has invalid parent {parent} (use -1 for the root, else a node index)")
        children[parent + 1].append(node)
    return children


def _check_tree(tree_tokens: list[int], parents: list[int], target_probs) -> None:
    is_tensor = isinstance(target_probs, Tensor)
    if (
        len(parents) != len(tree_tokens)
        or (is_tensor and target_probs.dim() != 2)
        or len(target_probs) != len(parents) + 1
    ):
        rows = tuple(target_probs.shape) if is_tensor else f"{len(target_probs)} rows"
        raise ValueError(
            f"need tree_tokens [N], parents [N], target_probs [N+1, V]; got {len(tree_tokens)}, {len(parents)}, {rows}"
        )


def tree_walk(
    tree_tokens: Tensor | Sequence[int],
    parents: Tensor | Sequence[int],
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> TreeWalkResult:
    """Walk a deterministic draft tree from the root with the multi-candidate rule at every node.

    target_probs[0] is the distribution after the committed context (the root), target_probs[i + 1] the
    distribution after node i: a [N+1, V] tensor, or rows computed on demand (``inference.row_logits``:
    anything with ``len``, ``[row]`` and ``.device``), since the walk reads only the root and its path. At each node z ~ p is drawn; a child carrying z is accepted and the walk goes
    on, otherwise z is the correction (or, at a leaf, the bonus) token. Exact for sampling; greedy (one-hot
    rows) gives the target's argmax path. EOS handling is the caller's job.
    """
    tokens, parent_list = _token_list(tree_tokens), _token_list(parents)
    _check_tree(tokens, parent_list, target_probs)
    children = _children_by_row(parent_list)
    path: list[int] = []
    row = 0
    while True:
        kids = children[row]
        match = multi_candidate([tokens[c] for c in kids], target_probs[row], generator)
        if match.candidate_index is None:
            break
        node = kids[match.candidate_index]
        path.append(node)
        row = node + 1
    emitted = [tokens[n] for n in path] + [match.token]
    return TreeWalkResult(path, torch.tensor(emitted, dtype=torch.long, device=target_probs.device))


def tree_walk_law(
    tree_tokens: Tensor | Sequence[int], parents: Tensor | Sequence[int], target_probs: Tensor
) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted token sequence of `tree_walk` (for tests; enumerates V at every node)."""
    tokens, parent_list = _token_list(tree_tokens), _token_list(parents)
    _check_tree(tokens, parent_list, target_probs)
    children = _children_by_row(parent_list)
    probs = target_probs.to(torch.float64).tolist()
    law: dict[tuple[int, ...], float] = {}
    pending: list[tuple[int, tuple[int, ...], float]] = [(0, (), 1.0)]  # (row, emitted so far, probability)
    while pending:
        row, prefix, weight = pending.pop()
        kids = children[row]
        kid_tokens = [tokens[c] for c in kids]
        for token, p in enumerate(probs[row]):
            if p == 0:
                continue
            index = _first_match(kid_tokens, token)
            if index is None:
                law[prefix + (token,)] = law.get(prefix + (token,), 0.0) + weight * p
            else:
                pending.append((kids[index] + 1, prefix + (token,), weight * p))
    return law
