"""What tree algorithms over feature-conditioned drafters (``eagle3_tree``, ``specblock_tree``) share: the checks
that a drafter fits the target, reading its input features from the target's captured hidden states, the
serving-time adapter's set-up and what it is told after each round, and :class:`FeatureTrees`, the strategy of the
engine loop that runs their rounds (draft a tree for every running row, verify every row's tree in one target
forward, commit per row)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.kernels.exact_cpu import KernelUnavailable
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, Strategy
from inference.round_observers import observer_kind
from inference.row_logits import RowLogits, WarpedRows, lazy_rows_on
from inference.verify import TreeWalkResult, tree_walk


def check_drafter_fits(target, config, what: str) -> None:
    """Refuse a ``what`` drafter (EAGLE-3, SpecBlock) built for another target shape (one line each)."""
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"{what} drafter vocab_size {config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}: it was trained for another tokenizer"
        )
    if config.target_hidden_size != target.config.hidden_size:
        raise ValueError(
            f"{what} drafter reads features of width {config.target_hidden_size} but the target's "
            f"hidden_size is {target.config.hidden_size}: it was trained for another target"
        )
    if max(config.aux_layer_ids) >= target.num_layers:
        raise ValueError(
            f"{what} drafter aux layers {config.aux_layer_ids} do not exist in a {target.num_layers}-layer target"
        )


def row_exact_drafter(drafter, target) -> None:
    """Where the target's rows are exact (a CPU in exact mode), make the drafter's batched rows bitwise its rows
    alone too (``set_row_exact``), so a request's drafts, and so its tokens, do not depend on its neighbours. Where
    the kernels cannot load, the drafter stays as it is: still lossless, rows just not bitwise their runs alone."""
    if (
        getattr(target, "exact", False)
        and getattr(drafter, "ROW_EXACT_SERVING", False)
        and drafter.fc.weight.device.type == "cpu"
        and drafter.config.hidden_act == "silu"
    ):
        try:
            drafter.set_row_exact(True)
        except KernelUnavailable:
            pass


class FeatureDrafting:
    """Mixin for algorithms whose drafter reads the target's aux layers (``self.drafter``, ``self.aux_layers``,
    ``self.adapter``); they implement ``new_drafter_cache`` and ``draft_trees`` for :class:`FeatureTrees`."""

    def _build_adapter(self, adapt: str, settings, *, verify_tokens: int, max_accept: int) -> None:
        """``self.adapter``: None, or the round observer ``adapt=`` names (:mod:`inference.round_observers`; for
        ``adapt=bandit`` the serving-time adapter, which measures its costs now, at start-up, on this target and
        drafter). It adapts a private copy of the drafter, so algorithms sharing the loaded one (variants in one
        evaluate run) never see its updates."""
        self.adapter = None
        if adapt != "none":
            self.drafter, self.adapter = observer_kind(adapt).attach(
                self.target, self.drafter, settings, verify_tokens=verify_tokens, max_accept=max_accept
            )

    def _features(self, output) -> torch.Tensor:
        """[1, T, 3·H_t]: the aux layers concatenated in the drafter's order, in the drafter's dtype."""
        return torch.cat([output.hidden[i] for i in self.aux_layers], dim=-1).to(self.drafter.fc.weight.dtype)


@dataclass
class FeatureRow:
    """A row's drafter-side state between rounds: the target features of the rows the last verification committed
    (the prompt, after prefill) paired with the token after each, and the target's cache length."""

    features: torch.Tensor  # [n, 3·H_t] in the drafter's dtype
    next_tokens: list[int]
    committed: int
    root: int  # the last emitted token (the adapter's end of query)


@dataclass
class DraftedTree:
    """What a tree proposal keeps for the hooks: the drafter's logits of every expanded node by tree index (-1:
    the root; for the adapter, else None), the target's rows the walk read, and the verified round."""

    child_logits: dict[int, torch.Tensor] | None
    rows: RowLogits | None = None
    verified: tuple | None = None  # (root, walk, committed features): the round the adapter is told of


class FeatureTrees(Strategy):
    """A feature drafter's draft trees as a strategy of the engine loop: every running row's tree is drafted in
    batched drafter calls (``algorithm.draft_trees``), the target scores each row's tree under its ancestor mask in
    the step's one forward, ``tree_walk`` walks it per row with the row's generator, and the captured features of
    the kept rows become the row's next drafter input. The drafter's cache holds one row per engine row.

    ``draft_s``: each row is charged the wall time of the step's batched drafting (a row alone: its own).

    The serving-time adapter (``adapt=``) is told each row's round under the row's request key, once the step is
    over (``accepted``), with the row's share of the step's wall seconds: the step (drafting, the target forward,
    verification) times the target rows the row's tree was scored on over all the rows the step scored. Why that
    rule: the adapter weighs the seconds an update saves (``H`` future tokens at the round's cost, ``spectrain.adapt
    .cost.saving``) against the seconds the update takes; an update stops the whole engine, and the next ``H``
    tokens are served by steps shared with other rows, so both sides are engine seconds only if a round costs its
    row's share of its step. Charging each row the whole step (its run alone's rule) would count a step once per
    row, so ``B`` rows side by side would make updates look ``B`` times more worth it. The share is by rows scored
    because a CPU step's cost grows with them (``inference.engine.widths``); a row alone is charged its whole step,
    as before."""

    clock = staticmethod(time.perf_counter)  # the step's wall clock

    def __init__(self, algorithm, *, max_accept: int):
        self.algorithm, self.drafter, self.adapter = algorithm, algorithm.drafter, algorithm.adapter
        self.aux_layers = tuple(algorithm.aux_layers)
        self.capture_layers = self.aux_layers
        self.lazy_tree_rows = lazy_rows_on(algorithm.target)  # the walk reads ~τ rows of a tree's
        self.max_accept = max_accept
        self.cache = None

    def lookahead(self) -> int:
        return self.algorithm.lookahead()

    def open(self, rows: int) -> None:
        self.cache = self.algorithm.new_drafter_cache(rows)

    def features(self, hidden: dict[int, torch.Tensor], rows) -> torch.Tensor:
        """[n, 3·H_t]: the aux layers at ``rows`` (of one target row), concatenated in the drafter's order."""
        return torch.cat([hidden[i][rows] for i in self.aux_layers], dim=-1).to(self.drafter.fc.weight.dtype)

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        lens = list(self.cache.held)
        for state, prompt_hidden in zip(states, hidden):
            prompt = list(state.request.prompt)
            state.draft = FeatureRow(
                self.features(prompt_hidden, slice(None)), prompt[1:] + state.pending, len(prompt), state.pending[-1]
            )
            lens[state.row] = 0
            if self.adapter is not None:
                self.adapter.begin_query(
                    state.request.key, prompt, state.draft.features, state.first_logits, max_accept=self.max_accept
                )
        self.cache.truncate(lens)

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        started = self.step_started = self.clock()
        expanded = [None if self.adapter is None else {} for _ in states]
        trees = self.algorithm.draft_trees(states, self.cache, expanded)
        elapsed = self.clock() - started  # the drafter's cost per round (CPU work is synchronous)
        for state in states:
            state.stats.draft_s += elapsed
        return [
            Proposal(tokens=list(tree.tokens), tree=tree, extra=DraftedTree(child_logits))
            for tree, child_logits in zip(trees, expanded)
        ]

    def verify(self, state: RowState, proposal: Proposal, logits: RowLogits) -> TreeWalkResult:
        proposal.extra.rows = logits
        tree = proposal.tree
        return tree_walk(tree.tokens, tree.parents, WarpedRows(logits, state.sampling.warp), state.generator)

    def verified(self, state: RowState, proposal: Proposal, result: TreeWalkResult, forward, row: int) -> None:
        pending = len(state.pending)
        kept = list(range(pending)) + [pending + node for node in result.path]
        row_hidden = {layer: forward.hidden[layer][row] for layer in self.aux_layers}
        emitted = result.tokens.tolist()
        draft = state.draft
        draft.features, draft.next_tokens = self.features(row_hidden, kept), state.pending[1:] + emitted
        draft.committed += len(kept)
        if self.adapter is not None:  # told once the step is over (``accepted``), when its seconds are known
            proposal.extra.verified = (draft.root, result, draft.features)
        draft.root = emitted[-1]

    def accepted(self, states: Sequence[RowState], proposals: Sequence[Proposal], results) -> None:
        """The adapter is told each verified row's round (a row whose callback failed after its verification
        too: its round happened), with the row's share of the step's seconds (class docstring)."""
        if self.adapter is None:
            return
        step_s = self.clock() - self.step_started
        scored = sum(proposal.width for proposal in proposals)
        for state, proposal in zip(states, proposals):
            if proposal.extra.verified is not None:
                root, walk, features = proposal.extra.verified
                share = step_s * proposal.width / scored
                self._observe(state.request.key, root, proposal, walk, features, share)

    def _observe(
        self, query, root: int, proposal: Proposal, walk: TreeWalkResult, features: torch.Tensor, seconds: float
    ) -> None:
        """The adapter's view of a round: the committed rows and, where the walk stopped at a node with drafted
        children, the drafter's distribution there with the target's token (the rejected position)."""
        tree, child_logits = proposal.tree, proposal.extra.child_logits
        end = walk.path[-1] if walk.path else -1
        drafted_below = end in child_logits and any(parent == end for parent in tree.parents)
        rejected = (child_logits[end], int(walk.tokens[-1])) if drafted_below else None
        self.adapter.observe_round(
            query,
            [root] + [tree.tokens[n] for n in walk.path],
            features,
            proposal.extra.rows.stack([0] + [node + 1 for node in walk.path]),
            walk.num_accepted,
            rejected,
            seconds,
        )

    def release(self, state: RowState) -> None:
        if self.adapter is not None and isinstance(state.draft, FeatureRow):
            self.adapter.end_query(state.request.key, state.draft.root)

    def close(self) -> None:
        self.cache = None
