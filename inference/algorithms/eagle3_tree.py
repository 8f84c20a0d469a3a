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

``tree_total`` counts the tokens of the verification forward INCLUDING the root (EAGLE's ``total_token``).

``adapt=bandit`` (``spectrain.adapt``): after every verification the adapter receives the committed rows (their
features and the target's logits) and the drafter's distribution at the rejected position; after the query it
may update the drafter in place. The verifier and the emitted tokens are untouched, so output stays lossless.
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer
from inference.algorithms.feature_drafting import (FeatureDrafting, TreeVerification, adapt_options,
                                                   check_drafter_fits)
from inference.round_observers import check_observer
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams
from inference.tree import DraftTree, keep_best, subtree


class Eagle3Tree(FeatureDrafting, TreeVerification, Algorithm):
    name = "eagle3_tree"
    drafter = "features"

    def __init__(self, target, drafter, *, tree_depth: int = 6, tree_topk: int = 8, tree_total: int = 48,
                 max_seq_len: int | None = None, adapt: str = "none", adapt_settings=None):
        super().__init__(target, max_seq_len=max_seq_len)
        check_observer(adapt)
        if tree_depth < 1 or tree_topk < 1 or tree_total < 2:
            raise ValueError(f"need tree_depth >= 1, tree_topk >= 1 and tree_total >= 2 (root + one node), got "
                             f"{tree_depth}, {tree_topk}, {tree_total}")
        check_drafter_fits(target, drafter.config, "EAGLE-3")
        self.drafter = drafter.eval()
        self.tree_depth, self.tree_topk, self.tree_total = tree_depth, tree_topk, tree_total
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self._build_adapter(adapt, adapt_settings, verify_tokens=tree_total, max_accept=tree_depth + 1)

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"tree_depth": cfg.tree_depth, "tree_topk": cfg.tree_topk, "tree_total": cfg.tree_total,
                **adapt_options(cfg)}

    def lookahead(self) -> int:
        return self.tree_total

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        cache = self.drafter.new_cache(self.max_seq_len + self.tree_topk * self.tree_depth)
        self._generate_trees(prompt_ids, out, sampling, generator, stats, cache=cache, max_accept=self.tree_depth + 1)

    def _draft_tree(self, features, next_tokens, committed, cache, out, stats, child_logits) -> DraftTree:
        drafter, device = self.drafter, self.target.device
        first_row = committed - len(next_tokens)
        cache.truncate(first_row)  # drop last round's tree rows
        step = drafter.step(as_batch(next_tokens, device), drafter.project(features),
                            torch.arange(first_row, committed, device=device)[None], cache)
        stats.draft_forwards += 1
        depth = max(1, min(self.tree_depth, out.remaining - 1))  # never draft past the token budget
        return self._grow_tree(step.logits[0, -1], step.hidden[0, -1], committed, cache, depth, stats, child_logits)

    def _grow_tree(self, root_logits: torch.Tensor, root_hidden: torch.Tensor, committed: int, cache,
                   depth: int, stats: GenerationStats, expanded: dict[int, torch.Tensor] | None = None) -> DraftTree:
        """EAGLE-2 dynamic expansion by cumulative draft log-probability, then reranking to ``tree_total - 1``.
        ``expanded`` (a dict, for the adapter) receives the draft logits of every kept expanded node by its
        index in the returned tree (-1: the root)."""
        drafter, device = self.drafter, root_hidden.device
        k = min(self.tree_topk, drafter.config.draft_vocab_size)
        best = _log_probs(root_logits).topk(k)
        draft_ids, scores = best.indices.tolist(), best.values.tolist()
        parents, depths = [-1] * k, [1] * k
        frontier, frontier_hidden = list(range(k)), root_hidden.expand(k, -1)
        committed_rows = cache.length
        cache_row: dict[int, int] = {}  # frontier node -> its row in the drafter's cache

        for level in range(1, depth):
            width, cached = len(frontier), cache.length
            mask = torch.zeros(width, cached + width, dtype=torch.bool)
            mask[:, :committed_rows] = True
            for row, node in enumerate(frontier):
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[row, cache_row[ancestor]] = True
                    ancestor = parents[ancestor]
            tokens = drafter.to_target_ids(torch.tensor(draft_ids, device=device)[frontier])
            positions = torch.full((1, width), committed - 1 + level, dtype=torch.long, device=device)
            step = drafter.step(tokens[None], frontier_hidden[None], positions, cache, mask.to(device)[None])
            stats.draft_forwards += 1
            for row, node in enumerate(frontier):
                cache_row[node] = cached + row

            if expanded is not None:
                expanded.update({node: step.logits[0, row] for row, node in enumerate(frontier)})
            children = _log_probs(step.logits[0]).topk(k, dim=-1)  # [width, k]
            child_scores = torch.tensor([scores[n] for n in frontier], device=device)[:, None] + children.values
            first_child = len(draft_ids)
            draft_ids += children.indices.flatten().tolist()
            scores += child_scores.flatten().tolist()
            parents += [node for node in frontier for _ in range(k)]
            depths += [level + 1] * (width * k)
            # Next frontier: the k best children overall (stable sort: ties go to the earlier child).
            order = torch.sort(-child_scores.flatten(), stable=True).indices[:k]
            frontier = [first_child + int(i) for i in order]
            frontier_hidden = step.hidden[0][order // k]

        kept = keep_best(scores, parents, self.tree_total - 1)
        if expanded is not None:  # re-key by index in the kept tree
            index = {node: i for i, node in enumerate(kept)}
            logits_by_node = dict(expanded)
            expanded.clear()
            expanded.update({index[n]: row for n, row in logits_by_node.items() if n in index})
            expanded[-1] = root_logits
        target_ids = drafter.to_target_ids(torch.tensor(draft_ids, device=device)).tolist()
        return subtree(target_ids, parents, depths, kept)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    # clamp: a child's cumulative score can then never exceed its parent's (keeps reranking ancestor-closed)
    return logits.float().log_softmax(dim=-1).clamp_max(0.0)
