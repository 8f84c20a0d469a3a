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

It runs on the engine loop (``inference.engine.loop``) as :class:`BranchRows`, one row at a time (its draft side
forks one sequence into branches): the engine's target forward (the prefill, then each step's
``[last committed, *U]``) runs through ``beside``, which drafts the branches beside it on the executor; ``first`` /
``verify`` run Match at the forward's rows, and H-RAD reads the same forward's hidden states. The oracle policies'
extra target pass runs inside the strategy, on the one row's cache, which it leaves as it found it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core.drafters.hrad import load_hrad, stack_lastk
from core.errors import UserError
from inference.algorithms.options import SPECBRANCH_ORACLES as ORACLES
from inference.algorithms.options import SpecBranchOptions, oracle_temperature_error, with_fields
from inference.algorithms.overlapped import DraftFactory, OneRowStrategy, OverlappedDraftAlgorithm
from inference.draft_side import BranchDraft
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, T
from inference.match import match_round
from inference.runner_contract import RunnerOutput, as_batch
from inference.sampling import SamplingParams
from inference.verify import VerifyResult
from inference.runner_loading import limited_draft

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

    context = ("draft_path",)

    def __init__(
        self,
        target,
        draft,
        options: SpecBranchOptions | None = None,
        *,
        on_round: RoundHook | None = None,
        on_branch: BranchHook | None = None,
        branch_capture_layers: Sequence[int] = (),
        branch_seed: int = 0,
        draft_path: str | None = None,
        draft_factory: DraftFactory | None = None,
        max_seq_len: int | None = None,
        executor_kwargs: dict | None = None,
        **fields: Any,
    ):
        """``options.hrad``: an H-RAD export path or predictor object, or a policy of :data:`POLICIES` (None =
        "none"). ``on_branch`` receives a :class:`BranchPoint` with the target's hidden states of
        ``branch_capture_layers`` at every surviving branch; at T > 0 its realised count draws on its own generator
        (``branch_seed``), never on the generation's. ``draft_path`` / ``draft_factory`` / ``executor_kwargs``:
        :class:`OverlappedDraftAlgorithm`'s."""
        self.options = options = with_fields(SpecBranchOptions, options, fields)
        gamma, kmax, hrad, epsilon, cut_from = (
            options.gamma,
            options.kmax,
            options.hrad,
            options.epsilon,
            options.cut_from,
        )
        if gamma < 1 or kmax < 1:
            raise UserError(f"gamma and kmax must be >= 1 (branch length, most branches), got {gamma} and {kmax}")
        if cut_from not in (1, 2):
            raise UserError(
                f"specbranch.cut_from must be 1 (the confidence rule may keep no continuation token) or 2 "
                f"(it keeps at least one, as the authors' code), got {cut_from}"
            )
        self.cut_from = cut_from
        super().__init__(
            target,
            limited_draft(draft, options.draft_vocab),
            executor=options.executor,
            draft_path=draft_path,
            draft_factory=draft_factory,
            max_batch=kmax,
            max_seq_len=max_seq_len,
            executor_kwargs=executor_kwargs,
        )
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

    def lookahead(self) -> int:
        return 2 * self.gamma

    def _hrad_class(
        self, hidden: dict[int, torch.Tensor], last_hidden: torch.Tensor, token: int, confidence: list[float]
    ) -> int:
        """H-RAD's class for the survivor token, from the target's features at the position before it (``hidden``
        {layer: [H]}, ``last_hidden`` [H]) and, when the H-RAD reads it, the draft's confidence at the first
        continuation token."""
        layers = list(self.predictor.capture_layers)
        lastk = stack_lastk(hidden, last_hidden, layers)[None]
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

    def _decide(
        self,
        hidden: dict[int, torch.Tensor],
        last_hidden: torch.Tensor | None,
        survivor: list[int],
        confidence: list[float],
        realised: int | None,
    ) -> tuple[int, int]:
        """(class, continuation tokens to keep) for the surviving branch, by the predictor (on the target's features
        before it) or the policy."""
        gamma = len(survivor)
        if self.predictor is not None:
            cls = self._hrad_class(hidden, last_hidden, survivor[0], confidence)
        elif self.policy in ORACLES:
            cls = true_class(realised, gamma)
            if self.policy == "oracle_keep":
                return cls, realised
        else:
            cls = {"none": 1, "class0": 0, "class2": 2}[self.policy]
        return cls, continuation_to_keep(cls, confidence, self.epsilon, self.cut_from)

    def strategy(self) -> BranchRows:
        return BranchRows(self)

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


@dataclass
class _BranchRow:
    """A row's SpecBranch state: S (prompt and emitted tokens), U, this round's branches (drafted beside the target
    forward), what Match and H-RAD decided, and the prefill's output (for the first round's H-RAD)."""

    committed: list[int]
    pending: list[int]
    branch: BranchDraft | None = None
    rounds: int = 0
    judged: int = 0  # |U| of this round
    accepted: int = 0  # of U
    survivor: int | None = None
    hrad_class: int | None = None
    keep: int = 0
    prefill: Any = None


class BranchRows(OneRowStrategy):
    """SpecBranch as a strategy of the engine loop, one row at a time (its draft side forks one sequence)."""

    name = "specbranch"

    one_row_because = "its draft side forks one sequence"

    def __init__(self, algorithm: SpecBranch):
        super().__init__(algorithm)
        self.gamma = algorithm.gamma

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(self.algorithm.capture)

    @property
    def wants_last_hidden(self) -> bool:
        return self.algorithm.predictor is not None or self.algorithm.on_branch is not None

    def beside(self, states: Sequence[RowState], forward: Callable[[], T], *, prefill: bool = False) -> T:
        """The target forward, and beside it the draft side forking the branches at the point after S + U."""
        (state,) = states
        algorithm = self.algorithm
        if prefill:
            if error := oracle_temperature_error(algorithm.policy, state.sampling.temperature):
                raise UserError(error)
            algorithm.start_draft(state.generator)  # the draft side's seed: the row generator's first draw
            state.draft = _BranchRow(list(state.request.prompt), [])
        row = state.draft
        result, row.branch = self.executor.overlap(
            forward, "branches", row.committed + row.pending, algorithm.kmax, self.gamma
        )
        if prefill:
            row.prefill = result
        return result

    def first(self, state: RowState, logits: torch.Tensor) -> list[int]:
        """The prefill's round: Match at the prompt's last row (U is empty), H-RAD on the prefill's features."""
        row = state.draft
        result = self._match(state, logits[None])
        at = len(state.request.prompt) - 1
        prefill, row.prefill = row.prefill, None
        last = prefill.last_hidden[0]
        self._next(state, {layer: h[at] for layer, h in prefill.hidden[0].items()}, None if last is None else last[at])
        self.count_round(state, Proposal(), result)
        self._report(state)
        return result.tokens.tolist()

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        """U (argmax drafts: point masses), scored with the branch point after it."""
        return [Proposal(list(state.draft.pending)) for state in states]

    def verify(self, state: RowState, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        return self._match(state, logits)

    def _match(self, state: RowState, logits: torch.Tensor) -> VerifyResult:
        """U verified, then Match at the branch point, against ``logits`` [|U| + 1, V]."""
        row = state.draft
        target_probs = state.sampling.warp(logits).float().cpu()
        result = match_round(row.pending, [b[0] for b in row.branch.tokens], target_probs, state.generator)
        row.judged, row.accepted, row.survivor = len(row.pending), result.pending_accepted, result.survivor
        row.committed += result.tokens
        return VerifyResult(result.pending_accepted, torch.tensor(result.tokens, dtype=torch.long))

    def verified(
        self, state: RowState, proposal: Proposal, result: VerifyResult, forward: RunnerOutput, row: int
    ) -> None:
        """H-RAD (or the policy) on the forward's features before the branch point: the next U."""
        at = len(state.pending) - 1 + len(proposal.tokens)  # the feed's index of the position before it
        last = forward.last_hidden
        self._next(
            state, {layer: h[row, at] for layer, h in forward.hidden.items()}, None if last is None else last[row, at]
        )

    def _next(self, state: RowState, hidden: dict[int, torch.Tensor], last_hidden: torch.Tensor | None) -> None:
        """How much of the survivor's continuation becomes the next U (none after a rejection)."""
        row, algorithm = state.draft, self.algorithm
        row.hrad_class, row.keep, row.pending = None, 0, []
        if row.survivor is not None:
            tokens = list(row.branch.tokens[row.survivor])
            confidence = list(row.branch.confidence[row.survivor])
            realised = (
                algorithm._realised(tokens, state.sampling)
                if algorithm.policy in ORACLES or algorithm.on_branch is not None
                else None
            )
            row.hrad_class, row.keep = algorithm._decide(hidden, last_hidden, tokens, confidence, realised)
            if algorithm.on_branch is not None:
                algorithm.on_branch(
                    BranchPoint(
                        row.rounds,
                        len(row.committed) - 1,
                        row.survivor,
                        tuple(tokens),
                        tuple(confidence),
                        {layer: h.clone() for layer, h in hidden.items()},
                        last_hidden.clone(),
                        realised,
                        row.hrad_class,
                        row.keep,
                    )
                )
            row.pending = tokens[1 : 1 + row.keep]
        row.rounds += 1

    def count_round(self, state: RowState, proposal: Proposal, result: VerifyResult) -> None:
        """Every round judges U + the branch point; k·γ tokens were drafted (k - 1 branches discarded whatever
        happens)."""
        row, stats, counts = state.draft, state.stats, self.algorithm.branch_counts
        k = len(row.branch.tokens)
        stats.draft_forwards += row.branch.forwards
        stats.record_round(row.judged + 1, row.accepted + (row.survivor is not None))
        stats.drafted_tokens += k * self.gamma - (row.judged + 1)
        counts["siblings"] += (k - 1) * self.gamma
        counts["speculated"] += row.judged + 1

    def accepted(
        self, states: Sequence[RowState], proposals: Sequence[Proposal], results: Sequence[VerifyResult | None]
    ) -> None:
        for state, result in zip(states, results):
            if result is not None:
                self._report(state)

    def _report(self, state: RowState) -> None:
        """The round to ``on_round``, once the target cache holds S but its last token."""
        row, algorithm = state.draft, self.algorithm
        if algorithm.on_round is not None:
            algorithm.on_round(
                SpecBranchRound(
                    len(row.committed),
                    len(row.pending),
                    algorithm.target.length(),
                    len(row.branch.tokens),
                    row.accepted,
                    row.survivor,
                    row.hrad_class,
                    row.keep,
                    tuple(row.committed + row.pending),
                )
            )

    def release(self, state: RowState) -> None:
        if state.out.done:
            algorithm = self.algorithm
            algorithm.note_generation(time.perf_counter() - state.started, len(state.out.tokens))
            algorithm.branch_counts["drafted"] += state.stats.drafted_tokens
            algorithm.branch_counts["accepted"] += state.stats.accepted_draft_tokens
