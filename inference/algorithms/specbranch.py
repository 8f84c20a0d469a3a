"""SpecBranch (docs/algorithms/specbranch.md §2–7): branch-parallel speculative decoding, rollback-aware draft lengths.

Each round, concurrently:

- target: scores the pending segment U (after the last committed token) and the branch point after it, and
  (with H-RAD) captures its last-K hidden states;
- draft side: forks k = max(1, ⌊kmax(1 − max q_b)⌋) branches at the branch point, the Top-k draft tokens, each
  continued by γ-1 argmax tokens in one batched forward per step over the shared prefix K/V.

At the join: U is verified by the deterministic-draft rule (docs/algorithms/verify.md §3: argmax drafts), then the
lossless **Match** at the branch point (§6): z ~ p_b is always the emitted token and the branch whose token
equals z (if any) survives. Then H-RAD, on the target's features at the position before the survivor's token
(posterior: the newest target pass), decides how much of the survivor's continuation becomes the next U:
class 0 none, class 1 up to the first low-confidence token (max q < ε, checked from the 2nd on, or from the
1st with ``specbranch_cut_from=1``), class 2 all.
``hrad=none`` applies the confidence rule (class 1) every round: the "w/o H-RAD" ablation; ``kmax=1`` is
"w/o branching". Measurement policies (T = 0 only for the oracles): ``hrad=class0`` keeps no continuation (always
class 0), ``hrad=class2`` keeps it all; ``hrad=oracle`` takes the true class, and ``hrad=oracle_keep`` keeps exactly
the continuation tokens the target accepts, both from one extra greedy target pass over the survivor's continuation
(cache rolled back after it, so the output is unchanged; counted in ``oracle_target_forwards``, not in τ).

``on_branch`` (serving-position acceptance traces, ``data_prep.traces positions=specbranch``) receives a
:class:`BranchPoint` at every surviving branch: H-RAD's inputs there and the realised class, from the same extra
target pass.

The public code's survivor rule (best p_b(y) then min(1, p/q)) is biased under sampling (§12 item 2); it is not
used here. Draft-cache bookkeeping (survivor row, rollback, cached branch-point q) lives in the draft side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core.drafters.hrad import load_hrad, stack_lastk
from core.errors import UserError
from inference.algorithms.base import GenerationStats, OutputBuffer
from inference.algorithms.options import SPECBRANCH_ORACLES as ORACLES
from inference.algorithms.options import oracle_temperature_error
from inference.algorithms.overlapped import OverlappedDraftAlgorithm
from inference.draft_side import common_prefix
from inference.match import match_round
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams

DEFAULT_EPSILON = 0.3  # §3, when the H-RAD export does not store one
# hrad= values that are a policy, not an H-RAD export: what each keeps of the survivor's continuation
POLICIES = {
    "none": "the confidence rule (class 1) every round",
    "class0": "none of it (class 0 every round)",
    "class2": "all of it (class 2 every round)",
    "oracle": "the true class's share (one extra greedy target pass per surviving branch; T = 0 only)",
    "oracle_keep": "exactly the tokens the target accepts (one extra greedy target pass; T = 0 only)",
}


class ClassPredictor(Protocol):
    """What SpecBranch needs from H-RAD (``core.drafters.hrad.HRADPredictor``)."""

    capture_layers: list[int]

    def predict(self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """Class probabilities [n, 3]; a predictor with ``confidence_feature = True`` also takes ``confidence=``
        [n], the draft's confidence at the first continuation token."""
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


@dataclass(frozen=True)
class BranchPoint:
    """A surviving branch where H-RAD is asked, handed to ``SpecBranch(on_branch=...)`` (serving-position traces)."""

    round: int  # round number within the generation, from 0
    position: int  # sequence position of the survivor token (its branch token)
    rank: int  # which branch survived (0 = the draft's most probable token)
    tokens: tuple[int, ...]  # the survivor: branch token + γ-1 argmax continuation tokens
    confidence: tuple[float, ...]  # max_v q(v) of the distribution each of those tokens came from (temperature 1)
    hidden: dict[int, torch.Tensor]  # {captured layer: [d]} target hidden states at position - 1
    last_hidden: torch.Tensor  # [d] final-normed target hidden state at position - 1
    realised: int  # continuation tokens the target accepts (the extra target pass; greedy at T = 0)
    hrad_class: int  # the class the policy chose
    keep: int  # continuation tokens kept as the next pending segment


RoundHook = Callable[[SpecBranchRound], None]
BranchHook = Callable[[BranchPoint], None]


def true_class(realised: int, gamma: int) -> int:
    """SpecBranch's class of a survivor whose first ``realised`` of γ-1 continuation tokens the target accepts:
    0 none, 2 all, 1 some (``data_prep.traces.hrad_class`` of ``realised + 1`` accepted)."""
    return 0 if realised == 0 else 2 if realised >= gamma - 1 else 1


def continuation_to_keep(hrad_class: int, confidence: list[float], epsilon: float, cut_from: int = 2) -> int:
    """Survivor continuation tokens kept (§3 table); ``confidence`` [γ] is the survivor's, index 0 = the branch
    token. Class 1 stops before the first continuation token with confidence < ε, checked from continuation token
    ``cut_from`` on: 2 (the authors' code) always keeps the first, 1 lets the rule keep none."""
    gamma = len(confidence)
    if hrad_class == 0:
        return 0
    if hrad_class == 2:
        return gamma - 1
    for j in range(cut_from, gamma):
        if confidence[j] < epsilon:
            return j - 1
    return gamma - 1


def policy_name(hrad: str | ClassPredictor | None) -> str | None:
    """The :data:`POLICIES` name ``hrad`` selects, or None for an H-RAD (an export path or a predictor)."""
    if hrad is None:
        return "none"
    if isinstance(hrad, str):
        name = hrad.strip().lower()
        if name in ("", "auto"):  # "auto" reaches here only when no H-RAD export was found (evaluate resolves it)
            return "none"
        return name if name in POLICIES else None
    return None


def load_predictor(hrad: str | ClassPredictor | None, target) -> ClassPredictor | None:
    if policy_name(hrad) is not None:
        return None
    if isinstance(hrad, str):
        return load_hrad(hrad, target)
    return hrad


class SpecBranch(OverlappedDraftAlgorithm):
    name = "specbranch"

    def __init__(self, target, draft, *, gamma: int = 4, kmax: int = 3, hrad: str | ClassPredictor | None = None,
                 epsilon: float | None = None, executor: str = "sequential", on_round: RoundHook | None = None,
                 on_branch: BranchHook | None = None, branch_capture_layers: Sequence[int] = (),
                 branch_seed: int = 0, cut_from: int = 2, **kwargs: Any):
        """``hrad``: an H-RAD export path or predictor object, or a policy of :data:`POLICIES` (None = "none").
        ``on_branch`` receives a :class:`BranchPoint` with the target's hidden states of ``branch_capture_layers``
        at every surviving branch; at T > 0 its realised count draws on its own generator (``branch_seed``), never
        on the generation's."""
        if gamma < 1 or kmax < 1:
            raise UserError(f"gamma and kmax must be >= 1 (branch length, most branches), got {gamma} and {kmax}")
        if cut_from not in (1, 2):
            raise UserError(f"specbranch_cut_from must be 1 (the confidence rule may keep no continuation token) or 2 "
                             f"(it keeps at least one, as the authors' code), got {cut_from}")
        self.cut_from = cut_from
        super().__init__(target, draft, executor=executor, max_batch=kmax, **kwargs)
        self.gamma, self.kmax = gamma, kmax
        self.policy = policy_name(hrad)
        self.predictor = load_predictor(hrad, target)
        stored = getattr(self.predictor, "epsilon", None)
        self.epsilon = epsilon if epsilon is not None else stored if stored is not None else DEFAULT_EPSILON
        own = list(getattr(self.predictor, "capture_layers", [])) if self.predictor is not None else []
        self.capture = sorted(set(own) | set(branch_capture_layers)) if on_branch is not None else own
        self.on_round, self.on_branch = on_round, on_branch
        self.branch_generator = torch.Generator().manual_seed(branch_seed)
        # since extra_metrics(); oracle: target forwards of the extra pass, not in the run's target_forwards
        self.branch_counts = {"drafted": 0, "accepted": 0, "siblings": 0, "speculated": 0, "oracle": 0}

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"gamma": cfg.gamma, "kmax": cfg.specbranch_kmax, "hrad": cfg.hrad, "epsilon": cfg.specbranch_eps,
                "cut_from": cfg.specbranch_cut_from, "executor": cfg.executor, "draft_path": cfg.drafter}

    def lookahead(self) -> int:
        return 2 * self.gamma

    def _hrad_class(self, output, position: int, token: int, confidence: list[float]) -> int:
        """H-RAD's class for the survivor token, from the target's features at ``position`` (the one before it)
        and, when the H-RAD reads it, the draft's confidence at the first continuation token."""
        hidden = {layer: h[0, position] for layer, h in output.hidden.items()}
        layers = list(self.predictor.capture_layers)
        lastk = stack_lastk(hidden, output.last_hidden[0, position], layers)[None]
        emb = self.target.embed_tokens(torch.tensor([token], device=self.target.device))
        if getattr(self.predictor, "confidence_feature", False):
            first = confidence[1] if len(confidence) > 1 else confidence[0]
            probs = self.predictor.predict(lastk, emb, confidence=torch.tensor([first]))
        else:
            probs = self.predictor.predict(lastk, emb)
        return int(probs.argmax(-1)[0])

    def _realised(self, survivor: list[int], sampling: SamplingParams) -> int:
        """Continuation tokens of ``survivor`` (branch token first) the target accepts, from one extra target pass
        over its first γ-1 tokens appended to the cache, which is rolled back afterwards (nothing else changes).
        Greedy: equal to the target's argmax; T > 0: the rule of docs/algorithms/verify.md §3 on this object's own
        generator."""
        if len(survivor) < 2:
            return 0
        base = self.target.length()
        logits = self.target.forward(as_batch(survivor[:-1], self.target.device)).logits[0]
        self.target.truncate(base)
        self.branch_counts["oracle"] += 1
        probs = sampling.warp(logits).float().cpu()  # row j: the target's law of survivor[j + 1]
        accepted = 0
        for j, token in enumerate(survivor[1:]):
            p = float(probs[j, token])
            keep = p > 0.5 if sampling.greedy else float(torch.rand((), generator=self.branch_generator)) < p
            if not keep:
                break
            accepted += 1
        return accepted

    def _decide(self, output, position: int, survivor: list[int], confidence: list[float], realised: int | None
                ) -> tuple[int, int]:
        """(class, continuation tokens to keep) for the surviving branch, by the predictor or the policy."""
        gamma = len(survivor)
        if self.predictor is not None:
            cls = self._hrad_class(output, position, survivor[0], confidence)
        elif self.policy in ORACLES:
            cls = true_class(realised, gamma)
            if self.policy == "oracle_keep":
                return cls, realised
        else:
            cls = {"none": 1, "class0": 0, "class2": 2}[self.policy]
        return cls, continuation_to_keep(cls, confidence, self.epsilon, self.cut_from)

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        if error := oracle_temperature_error(self.policy, sampling.temperature):
            raise UserError(error)
        target, executor = self.target, self.executor  # built (a process started) before the clock starts
        start = time.perf_counter()
        target.reset(1)
        self.start_draft(generator)
        committed, pending = list(prompt_ids), []
        want_hidden = self.predictor is not None or self.on_branch is not None
        round_index = 0
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
                tokens, confidence = list(branch.tokens[survivor]), list(branch.confidence[survivor])
                position = first + len(pending)  # block index of the position before the survivor token
                realised = self._realised(tokens, sampling) \
                    if self.policy in ORACLES or self.on_branch is not None else None
                hrad_class, keep = self._decide(output, position, tokens, confidence, realised)
                if self.on_branch is not None:
                    self.on_branch(BranchPoint(
                        round_index, len(committed) + len(new) - 1, survivor, tuple(tokens), tuple(confidence),
                        {layer: h[0, position].clone() for layer, h in output.hidden.items()},
                        output.last_hidden[0, position].clone(), realised, hrad_class, keep))
                pending = tokens[1:1 + keep]
            else:
                pending = []
            round_index += 1
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
        # Three denominators (the paper's is unknown: docs/algorithms/verify.md §5). rollback_rate: every drafted token,
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
        metrics["hrad_policy"] = self.policy or "hrad"
        if self.policy in ORACLES or self.on_branch is not None:  # the extra passes, outside τ's target forwards
            metrics["oracle_target_forwards"] = counts["oracle"]
        self.branch_counts = dict.fromkeys(counts, 0)
        return metrics
