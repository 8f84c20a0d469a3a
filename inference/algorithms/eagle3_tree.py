"""EAGLE-3 with a dynamic draft tree (docs/algorithms/eagle3.md §5–6): lossless, greedy and sampling.

Per round, with ``n`` committed tokens in the target's cache and the last emitted token ``r`` (the root) not yet
in it:

1. The drafter reads the rows the last verification committed (target features at position ``i`` paired with the
   token at ``i + 1``; the last pairs the root's predecessor features with ``r``) and predicts depth 1.
2. The tree grows EAGLE-2 style: ``tree_topk`` children of the root; then ``tree_depth - 1`` times the
   frontier (the ``tree_topk`` best nodes of the last level by cumulative draft log-probability) runs through
   the drafter in ONE forward (each row sees the committed rows, its ancestors and itself; a node at depth d
   sits at position ``n - 1 + d``), each frontier node proposing ``tree_topk`` children. The best
   ``tree_total - 1`` nodes by score are kept (ancestor-closed, see ``inference.tree.keep_best``).
3. The target verifies ``[r, nodes]`` in ONE forward (positions ``n + depth``, ancestor mask) and captures its
   aux layers on the way; ``verify.tree_walk`` picks the accepted path plus one token. Candidates are chosen
   deterministically, so the walk is exact for sampling (multi-candidate rule) and equals greedy decoding
   at temperature 0.
4. ``runner.commit`` keeps the root and the accepted path; their captured features become the drafter's next
   rows, and the drafter's cache drops the tree rows.

It runs on the engine loop (``inference.algorithms.feature_drafting.FeatureTrees``): steps 1 and 2 run for every
running row at once (one drafter call a step, each row in its own drafter-cache row), step 3 scores every row's
tree in the engine's one target forward, and step 4 commits per row.

``tree_total`` counts the tokens of the verification forward INCLUDING the root (EAGLE's ``total_token``).

``adapt=bandit`` (``spectrain.adapt``): after every verification the adapter receives the committed rows (their
features and the target's logits) and the drafter's distribution at the rejected position; after the query it
may update the drafter in place. The verifier and the emitted tokens are untouched, so output stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.algorithms.base import Algorithm, GenerationStats
from inference.algorithms.feature_drafting import FeatureDrafting, FeatureTrees, check_drafter_fits, row_exact_drafter
from inference.algorithms.options import Eagle3TreeOptions, with_fields
from inference.engine.state import RowState
from inference.round_observers import check_observer
from inference.tree import DraftTree, keep_best, subtree


class Eagle3Tree(FeatureDrafting, Algorithm):
    name = "eagle3_tree"
    drafter = "eagle3"
    batchable = True  # with an adapter too (it is told each round's request and its share of the step)

    context = ("adapt", "adapt_settings")

    def __init__(
        self,
        target,
        drafter,
        options: Eagle3TreeOptions | None = None,
        *,
        max_seq_len: int | None = None,
        adapt: str = "none",
        adapt_settings=None,
        **fields,
    ):
        """``adapt``: a round observer's name (``inference.round_observers``; none = no adaptation), with its
        ``adapt_settings`` (None: its defaults)."""
        super().__init__(target, max_seq_len=max_seq_len)
        check_observer(adapt)
        self.options = options = with_fields(Eagle3TreeOptions, options, fields)
        tree_depth, tree_topk, tree_total = options.tree_depth, options.tree_topk, options.tree_total
        if tree_depth < 1 or tree_topk < 1 or tree_total < 2:
            raise ValueError(
                f"need tree_depth >= 1, tree_topk >= 1 and tree_total >= 2 (root + one node), got "
                f"{tree_depth}, {tree_topk}, {tree_total}"
            )
        check_drafter_fits(target, drafter.config, "EAGLE-3")
        self.drafter = drafter.eval()
        self.tree_depth, self.tree_topk, self.tree_total = tree_depth, tree_topk, tree_total
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self._build_adapter(adapt, adapt_settings, verify_tokens=tree_total, max_accept=tree_depth + 1)
        # the served drafter (an adapter's copy too: it trains with torch's kernels, spectrain.adapt.adapter)
        row_exact_drafter(self.drafter, target)

    def lookahead(self) -> int:
        return self.tree_total

    def strategy(self) -> FeatureTrees:
        return FeatureTrees(self, max_accept=self.tree_depth + 1)

    def new_drafter_cache(self, rows: int):
        """The drafter's cache for ``rows`` engine rows: a row's committed rows plus one tree's expanded levels."""
        return self.drafter.new_cache(self.max_seq_len + self.tree_topk * self.tree_depth, batch_size=rows)

    def draft_trees(
        self, states: Sequence[RowState], cache, expanded: Sequence[dict[int, torch.Tensor] | None]
    ) -> list[DraftTree]:
        """Every running row's draft tree below its root, in batched drafter calls: each row reads the rows its
        last verification committed (step 1), then the trees grow level by level (step 2). ``expanded[k]`` (a
        dict, for the adapter) receives row k's drafter logits of every expanded node by tree index (-1: root)."""
        drafter, device = self.drafter, self.target.device
        firsts = [s.draft.committed - len(s.draft.next_tokens) for s in states]
        lens = [0] * cache.batch  # idle rows hold nothing; a running row drops last round's tree rows
        for state, first in zip(states, firsts):
            lens[state.row] = first
        cache.truncate(lens)
        counts = [0] * cache.batch
        for state in states:
            counts[state.row] = len(state.draft.next_tokens)
        width = max(counts)
        tokens = torch.zeros(cache.batch, width, dtype=torch.long, device=device)
        positions = torch.zeros(cache.batch, width, dtype=torch.long, device=device)
        features = states[0].draft.features.new_zeros(cache.batch, width, states[0].draft.features.shape[-1])
        for state, first in zip(states, firsts):
            n = counts[state.row]
            tokens[state.row, :n] = torch.tensor(state.draft.next_tokens, dtype=torch.long, device=device)
            positions[state.row, :n] = torch.arange(first, first + n, device=device)
            features[state.row, :n] = state.draft.features
        step = _step(drafter, tokens, drafter.project(features), positions, cache, None, counts)
        for state in states:
            state.stats.draft_forwards += 1
        # never draft past the token budget
        depths = [max(1, min(self.tree_depth, s.out.remaining - 1)) for s in states]
        return self._grow_trees(
            [step.logits[s.row, counts[s.row] - 1] for s in states],
            [step.hidden[s.row, counts[s.row] - 1] for s in states],
            [s.draft.committed for s in states],
            [s.row for s in states],
            cache,
            depths,
            [s.stats for s in states],
            expanded,
        )

    def _grow_tree(
        self,
        root_logits: torch.Tensor,
        root_hidden: torch.Tensor,
        committed: int,
        cache,
        depth: int,
        stats: GenerationStats,
        expanded: dict[int, torch.Tensor] | None = None,
    ) -> DraftTree:
        """One row's tree (a one-row drafter cache): :meth:`_grow_trees`."""
        return self._grow_trees([root_logits], [root_hidden], [committed], [0], cache, [depth], [stats], [expanded])[0]

    def _grow_trees(
        self,
        root_logits: Sequence[torch.Tensor],
        root_hidden: Sequence[torch.Tensor],
        committed: Sequence[int],
        rows: Sequence[int],
        cache,
        depths: Sequence[int],
        stats: Sequence[GenerationStats],
        expanded: Sequence[dict[int, torch.Tensor] | None],
    ) -> list[DraftTree]:
        """EAGLE-2 dynamic expansion by cumulative draft log-probability, then reranking to ``tree_total - 1``,
        for trees below the roots of drafter-cache rows ``rows`` at once (one drafter call a level; a row whose
        tree is deep enough sits the later levels out). ``expanded[k]`` (a dict, for the adapter) receives tree
        k's draft logits of every kept expanded node by its index in the returned tree (-1: the root)."""
        drafter, device = self.drafter, root_hidden[0].device
        k = min(self.tree_topk, drafter.config.draft_vocab_size)
        grow = [
            _Growing(logits, *_log_probs(logits).topk(k), k, hidden, cache.held[row])
            for logits, hidden, row in zip(root_logits, root_hidden, rows)
        ]

        for level in range(1, max(depths)):
            going = [t for t, depth in enumerate(depths) if level < depth]
            past = cache.longest
            tokens = torch.zeros(cache.batch, k, dtype=torch.long, device=device)
            hidden = root_hidden[0].new_zeros(cache.batch, k, root_hidden[0].shape[-1])
            positions = torch.zeros(cache.batch, k, dtype=torch.long, device=device)
            mask = torch.zeros(cache.batch, k, past + k, dtype=torch.bool)
            counts = [0] * cache.batch
            for t in going:
                tree, row = grow[t], rows[t]
                mask[row, :, : tree.committed_rows] = True
                for i, node in enumerate(tree.frontier):
                    ancestor = tree.parents[node]
                    while ancestor >= 0:
                        mask[row, i, tree.cache_row[ancestor]] = True
                        ancestor = tree.parents[ancestor]
                tokens[row] = drafter.to_target_ids(torch.tensor(tree.draft_ids, device=device)[tree.frontier])
                hidden[row] = tree.frontier_hidden
                positions[row] = committed[t] - 1 + level
                counts[row] = k
                for i, node in enumerate(tree.frontier):
                    tree.cache_row[node] = cache.held[row] + i
            step = _step(drafter, tokens, hidden, positions, cache, mask.to(device), counts)
            for t in going:
                stats[t].draft_forwards += 1
                grow[t].expand(step.logits[rows[t]], step.hidden[rows[t]], level, k, expanded[t])

        trees = []
        for tree, into in zip(grow, expanded):
            kept = keep_best(tree.scores, tree.parents, self.tree_total - 1)
            if into is not None:  # re-key by index in the kept tree
                index = {node: i for i, node in enumerate(kept)}
                logits_by_node = dict(into)
                into.clear()
                into.update({index[n]: row for n, row in logits_by_node.items() if n in index})
                into[-1] = tree.root_logits
            target_ids = drafter.to_target_ids(torch.tensor(tree.draft_ids, device=device)).tolist()
            trees.append(subtree(target_ids, tree.parents, tree.depths, kept))
        return trees


class _Growing:
    """One row's tree while it grows: every drafted node (draft id, cumulative score, parent, depth), the frontier
    that expands next and its hidden states, and the drafter-cache slot of each expanded node."""

    def __init__(
        self,
        root_logits: torch.Tensor,
        scores: torch.Tensor,
        ids: torch.Tensor,
        k: int,
        root_hidden: torch.Tensor,
        committed_rows: int,
    ):
        self.draft_ids, self.scores = ids.tolist(), scores.tolist()
        self.parents, self.depths = [-1] * k, [1] * k
        self.frontier, self.frontier_hidden = list(range(k)), root_hidden.expand(k, -1)
        self.committed_rows = committed_rows
        self.cache_row: dict[int, int] = {}
        self.root_logits = root_logits

    def expand(
        self, logits: torch.Tensor, hidden: torch.Tensor, level: int, k: int, expanded: dict[int, torch.Tensor] | None
    ) -> None:
        """The frontier's drafter outputs (``logits`` [k, Vd], ``hidden`` [k, H]): ``k`` children each; the next
        frontier is the ``k`` best children overall (stable sort: ties go to the earlier child)."""
        if expanded is not None:
            expanded.update({node: logits[i] for i, node in enumerate(self.frontier)})
        children = _log_probs(logits).topk(k, dim=-1)  # [width, k]
        child_scores = (
            torch.tensor([self.scores[n] for n in self.frontier], device=logits.device)[:, None] + children.values
        )
        first_child = len(self.draft_ids)
        width = len(self.frontier)
        self.draft_ids += children.indices.flatten().tolist()
        self.scores += child_scores.flatten().tolist()
        self.parents += [node for node in self.frontier for _ in range(k)]
        self.depths += [level + 1] * (width * k)
        order = torch.sort(-child_scores.flatten(), stable=True).indices[:k]
        self.frontier = [first_child + int(i) for i in order]
        self.frontier_hidden = hidden[order // k]


def _step(
    drafter,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cache,
    mask: torch.Tensor | None,
    counts: list[int],
):
    """``drafter.step`` over the cache's rows; a call where every row is real passes no ``counts`` (the one-row
    call it always was)."""
    if all(n == tokens.shape[1] for n in counts):
        return (
            drafter.step(tokens, hidden, positions, cache, mask)
            if mask is not None
            else drafter.step(tokens, hidden, positions, cache)
        )
    return drafter.step(tokens, hidden, positions, cache, mask, counts=counts)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    # clamp: a child's cumulative score can then never exceed its parent's (keeps reranking ancestor-closed)
    return logits.float().log_softmax(dim=-1).clamp_max(0.0)
