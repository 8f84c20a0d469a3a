"""SpecBlock with a rank-guided block tree (docs/algorithms/specblock.md §6): lossless, greedy and sampling.

Bookkeeping (training-consistent, §6 / §9 item 9): every committed token ``x_{j+1}`` appears in exactly one
drafter anchor ``(h_j, x_{j+1})`` whose slots sit at positions ``j + 1 + k``; the cross cache holds all K slots of
every committed anchor, so ``cache.anchors`` always equals the number of tokens in the target's cache.

Per iteration, with ``n`` committed tokens and the root ``r`` (last emitted, not yet in the target's cache):

1. ONE drafter forward over the anchors the last verification committed (target features of ``[r_prev] +
   accepted``, each paired with the next emitted token; at the start the prompt's anchors, the last paired with
   the first generated token) appends their K slots to the cross cache and returns the LAST anchor's block 1.
2. ``inference.specblock_tree_builder`` turns block 1 into a tree (greedy chain, rank-guided alternatives,
   pending leaves), running ``specblock_blocks - 1`` batched later-block forwards, pruned to ``specblock_budget``.
3. The target verifies ``[r, nodes]`` in ONE forward (positions ``n + depth``, ancestor mask) capturing its aux
   layers; ``verify.tree_walk`` accepts a path plus one token (exact multi-candidate rule; greedy at T=0).
4. ``runner.commit`` keeps the root and the accepted path; their features become the next anchors.

``draft_forwards`` counts drafter calls: ``specblock_blocks`` per iteration (block 1 merged with the cache
update), vs ``1 + depth`` for EAGLE-3.

It runs on the engine loop (``inference.algorithms.feature_drafting.FeatureTrees``): steps 1 and 2 run for every
running row at once (one drafter call for step 1 and one per later block, each row in its own cross-cache row with
its own anchor count), step 3 scores every row's tree in the engine's one target forward, and
step 4 commits per row.

``adapt=bandit`` (``spectrain.adapt``), as in ``eagle3_tree``: after every verification the adapter receives the
committed rows and the drafter's distribution where the walk stopped; after the query it may update the drafter.
The verifier and the emitted tokens are untouched, so output stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.drafters.specblock import BlockKV, BlockOutput
from inference.algorithms.base import Algorithm
from inference.algorithms.feature_drafting import FeatureDrafting, FeatureTrees, check_drafter_fits, row_exact_drafter
from inference.algorithms.options import SpecBlockTreeOptions, with_fields
from inference.engine.state import RowState
from inference.round_observers import check_observer
from inference.specblock_tree_builder import SpecBlockTreeBuilder, TreeShape
from inference.tree import DraftTree


class SpecBlockTree(FeatureDrafting, Algorithm):
    name = "specblock_tree"
    drafter = "specblock"
    batchable = True  # with an adapter too (it is told each round's request and its share of the step)

    context = ("adapt", "adapt_settings")

    def __init__(
        self,
        target,
        drafter,
        options: SpecBlockTreeOptions | None = None,
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
        self.options = options = with_fields(SpecBlockTreeOptions, options, fields)
        width, budget, widths, blocks, prob_caps = (
            options.width,
            options.budget,
            options.widths,
            options.blocks,
            options.prob_caps,
        )
        if not hasattr(drafter, "forward_leaves"):
            raise ValueError(
                f"specblock_tree needs a SpecBlock drafter, got {type(drafter).__name__}: pass "
                "drafter.specblock=PATH (a SpecBlock export for this target)"
            )
        check_drafter_fits(target, drafter.config, "SpecBlock")
        self.drafter = drafter.eval()
        widths = list(drafter.config.widths if widths is None else widths)
        self.shape = TreeShape(width=width, budget=budget, widths=tuple(widths), blocks=blocks, prob_caps=prob_caps)
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.max_accept = blocks * drafter.config.block_size + 1
        self._build_adapter(adapt, adapt_settings, verify_tokens=budget + 1, max_accept=self.max_accept)
        # the served drafter (an adapter's copy too: it trains with torch's kernels, spectrain.adapt.adapter)
        row_exact_drafter(self.drafter, target)
        self.builder = SpecBlockTreeBuilder(self.drafter, self.shape)  # after: adaptation may copy the drafter

    def lookahead(self) -> int:
        return self.shape.budget + 1

    def strategy(self) -> FeatureTrees:
        return FeatureTrees(self, max_accept=self.max_accept)

    def new_drafter_cache(self, rows: int):
        """The cross cache for ``rows`` engine rows: one anchor per token of a row's target cache."""
        return self.drafter.new_cache(self.max_seq_len + 1, batch_size=rows)

    def draft_trees(
        self, states: Sequence[RowState], cache, expanded: Sequence[dict[int, torch.Tensor] | None]
    ) -> list[DraftTree]:
        """Every running row's draft tree below its root: ONE drafter call commits each row's new anchors (the
        rows its last verification committed) and drafts its block 1 (step 1), then every row's tree grows in
        one later-block call a round, each row against its own row of the cross cache (step 2). ``expanded[k]``
        (a dict, for the adapter) receives row k's drafter logits its tree's children were drawn from, by tree
        index (-1: root)."""
        device = self.target.device
        counts = [0] * cache.batch
        for state in states:
            counts[state.row] = len(state.draft.next_tokens)
        width = max(counts)
        tokens = torch.zeros(cache.batch, width, dtype=torch.long, device=device)
        features = states[0].draft.features.new_zeros(cache.batch, width, states[0].draft.features.shape[-1])
        for state in states:
            n = counts[state.row]
            tokens[state.row, :n] = torch.tensor(state.draft.next_tokens, dtype=torch.long, device=device)
            features[state.row, :n] = state.draft.features
        if all(n == width for n in counts):  # every row real: the one-row call it always was
            first = self.drafter.extend_and_draft(features, tokens, cache)
        else:
            first = self.drafter.extend_and_draft(features, tokens, cache, counts=counts)
        built = self.builder.build_rows(
            [_row_of(first, s.row) for s in states],
            cache,
            [s.row for s in states],
            [max(1, s.out.remaining - 1) for s in states],  # never past the budget
            expanded,
        )
        trees = []
        for state, (tree, later) in zip(states, built):
            state.stats.draft_forwards += 1 + later
            trees.append(tree)
        return trees


def _row_of(block: BlockOutput, row: int) -> BlockOutput:
    """Row ``row`` of a batched block output, as a one-row output."""
    one = slice(row, row + 1)
    return BlockOutput(
        block.logits[one],
        block.rank_logits[one],
        block.hidden[one],
        BlockKV([k[one] for k in block.kv.k], [v[one] for v in block.kv.v]),
    )
