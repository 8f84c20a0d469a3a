"""SpecBranch: branch-parallel speculative decoding with rollback-aware draft lengths (spec §2.2–2.7).

Each round, concurrently:

- target: scores the pending segment U (after the last committed token) and the branch point after it, and
  (with H-RAD) captures its last-K hidden states;
- draft side: forks k = max(1, ⌊kmax(1 − max q_b)⌋) branches at the branch point, the Top-k draft tokens, each
  continued by γ-1 argmax tokens in one batched forward per step over the shared prefix K/V.

At the join: U is verified with the deterministic-draft rule (§1.2; its tokens are argmax drafts), then the
lossless **Match** at the branch point (§2.6): z ~ p_b is always the emitted token and the branch whose token
equals z (if any) survives. Then H-RAD, on the target's features at the position before the survivor's token
(posterior: the newest target pass), decides how much of the survivor's continuation becomes the next U:
class 0 none, class 1 up to the first low-confidence token (max q < ε, checked from the 2nd on), class 2 all.
``hrad=none`` applies the confidence rule (class 1) every round: the "w/o H-RAD" ablation; ``kmax=1`` is
"w/o branching".

The public code's survivor rule (best p_b(y) then min(1, p/q)) is biased under sampling (§0.3 item 2); it is not
used here. Draft-cache bookkeeping (survivor row, rollback, cached branch-point q) lives in the draft side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core.drafters.hrad import load_hrad, stack_lastk
from inference.algorithms.base import GenerationStats, OutputBuffer
from inference.algorithms.overlapped import OverlappedDraftAlgorithm
from inference.draft_side import common_prefix
from inference.match import match_round
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams

DEFAULT_EPSILON = 0.3  # §2.3, when the H-RAD export does not store one


class ClassPredictor(Protocol):
    """What SpecBranch needs from H-RAD (``core.drafters.hrad.HRADPredictor``)."""

    capture_layers: list[int]

    def predict(self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        ...


@dataclass(frozen=True)
class SpecBranchRound:
    """One round, handed to ``SpecBranch(on_round=...)`` (tests, traces)."""

    committed: int  # |S| after the round (prompt included)
    pending: int  # |U| after the round
    target_len: int  # target cache length after the round
    branches: int  # k
    pending_accepted: int  # tokens of the previous U kept
    survivor: int | None  # branch index that survived Match, None on a rejection
    hrad_class: int | None
    keep: int  # continuation tokens kept as the next U
    context: tuple[int, ...]  # S + U after the round: what the next round's draft job continues


RoundHook = Callable[[SpecBranchRound], None]


def continuation_to_keep(hrad_class: int, confidence: list[float], epsilon: float) -> int:
    """Survivor continuation tokens kept (§2.3 table); ``confidence`` [γ] is the survivor's, index 0 = the branch
    token. Class 1 stops before the first continuation token (from the 2nd on) with confidence < ε."""
    gamma = len(confidence)
    if hrad_class == 0:
        return 0
    if hrad_class == 2:
        return gamma - 1
    for j in range(2, gamma):
        if confidence[j] < epsilon:
            return j - 1
    return gamma - 1


def load_predictor(hrad: str | ClassPredictor | None, target) -> ClassPredictor | None:
    if hrad is None or (isinstance(hrad, str) and hrad.lower() in ("", "none", "auto")):
        return None  # "auto" reaches here only when no H-RAD export was found (evaluate resolves it)
    if isinstance(hrad, str):
        return load_hrad(hrad, target)
    return hrad


class SpecBranch(OverlappedDraftAlgorithm):
    name = "specbranch"

    def __init__(self, target, draft, *, gamma: int = 4, kmax: int = 3, hrad: str | ClassPredictor | None = None,
                 epsilon: float | None = None, executor: str = "sequential", on_round: RoundHook | None = None,
                 **kwargs: Any):
        """``hrad``: None / "none" (confidence rule every round), an H-RAD export path, or a predictor object."""
        if gamma < 1 or kmax < 1:
            raise ValueError(f"gamma and kmax must be >= 1 (branch length, most branches), got {gamma} and {kmax}")
        super().__init__(target, draft, executor=executor, max_batch=kmax, **kwargs)
        self.gamma, self.kmax = gamma, kmax
        self.predictor = load_predictor(hrad, target)
        stored = getattr(self.predictor, "epsilon", None)
        self.epsilon = epsilon if epsilon is not None else stored if stored is not None else DEFAULT_EPSILON
        self.capture = list(getattr(self.predictor, "capture_layers", [])) if self.predictor is not None else []
        self.on_round = on_round
        self.branch_counts = {"drafted": 0, "accepted": 0, "siblings": 0, "speculated": 0}  # since extra_metrics()

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"gamma": cfg.gamma, "kmax": cfg.specbranch_kmax, "hrad": cfg.hrad, "epsilon": cfg.specbranch_eps,
                "executor": cfg.executor, "draft_path": cfg.drafter}

    def lookahead(self) -> int:
        return 2 * self.gamma

    def _hrad_class(self, output, position: int, token: int) -> int:
        """H-RAD's class for the survivor token, from the target's features at ``position`` (the one before it)."""
        if self.predictor is None:
            return 1

        hidden = {layer: h[0, position] for layer, h in output.hidden.items()}
        lastk = stack_lastk(hidden, output.last_hidden[0, position], self.capture)[None]
        emb = self.target.embed_tokens(torch.tensor([token], device=self.target.device))
        return int(self.predictor.predict(lastk, emb).argmax(-1)[0])

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        target, executor = self.target, self.executor  # built (a process started) before the clock starts
        start = time.perf_counter()
        target.reset(1)
        self.start_draft(generator)
        committed, pending = list(prompt_ids), []
        want_hidden = self.predictor is not None
        while not out.done:
            context = committed + pending
            feed = context[target.length():]

            def target_job(feed=feed):
                return target.forward(as_batch(feed, target.device), capture_layers=self.capture,
                                      return_last_hidden=want_hidden)

            output, branch = executor.overlap(target_job, "branches", context, self.kmax, self.gamma)
            k = len(branch.tokens)
            stats.target_forwards += 1
            stats.draft_forwards += branch.forwards
            stats.drafted_tokens += k * self.gamma
            self.branch_counts["siblings"] += (k - 1) * self.gamma  # k-1 branches are discarded whatever happens
            first = len(feed) - len(pending) - 1  # block index of the last committed token
            target_probs = sampling.warp(output.logits[0, first:]).float().cpu()  # [|U| + 1, V]

            result = match_round(pending, [b[0] for b in branch.tokens], target_probs, generator)
            new, accepted, survivor = result.tokens, result.pending_accepted, result.survivor
            hrad_class, keep = None, 0
            stats.record_round(len(pending) + 1, accepted + (survivor is not None))
            self.branch_counts["speculated"] += len(pending) + 1
            stats.drafted_tokens -= len(pending) + 1  # counted when drafted (above)
            if survivor is not None:
                hrad_class = self._hrad_class(output, first + len(pending), new[-1])
                keep = continuation_to_keep(hrad_class, branch.confidence[survivor], self.epsilon)
                pending = branch.tokens[survivor][1:1 + keep]
            else:
                pending = []
            out.extend(new)
            committed += new
            target.truncate(min(common_prefix(context, committed), len(committed) - 1))
            if self.on_round is not None:
                self.on_round(SpecBranchRound(len(committed), len(pending), target.length(), k, accepted, survivor,
                                              hrad_class, keep, tuple(committed + pending)))
        self.note_generation(time.perf_counter() - start, len(out.tokens))
        self.branch_counts["drafted"] += stats.drafted_tokens
        self.branch_counts["accepted"] += stats.accepted_draft_tokens

    def extra_metrics(self) -> dict[str, Any]:
        metrics = super().extra_metrics()
        counts = self.branch_counts
        # Three denominators, since the paper's is unverified (spec §1.3). rollback_rate: every drafted token,
        # sibling branches and the continuation H-RAD cut included. Without siblings: the path that could have
        # been kept. Speculated: only what the algorithm bet on, i.e. the branch-point token and the continuation
        # H-RAD kept, the tokens a rejection rolls back; the only reading under which the paper's SpecBranch
        # (39.6 %) can sit below SpS (76.6 %). SpS and PEARL keep every drafted token as their speculation, so
        # for them all three equal rollback_rate.
        path = counts["drafted"] - counts["siblings"]
        metrics["sibling_branch_tokens"] = counts["siblings"]
        metrics["rollback_rate_without_siblings"] = round(1 - counts["accepted"] / path, 4) if path else 0.0
        speculated = counts["speculated"]
        metrics["rollback_rate_speculated"] = round(1 - counts["accepted"] / speculated, 4) if speculated else 0.0
        self.branch_counts = dict.fromkeys(counts, 0)
        return metrics
