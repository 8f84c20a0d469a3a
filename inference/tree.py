"""Draft token trees: pruning to a budget, and the mask/positions of their one verification forward.

A tree's nodes are kept in creation order (every parent before its children). The root is implicit: it is the
last emitted token, which the target has not seen yet, so a verification forward feeds ``[root, node_0, ...]``
(row 0 = root, row ``i + 1`` = node ``i``); ``parents[i] == -1`` means a child of the root. This matches
``inference.verify.tree_walk`` (``target_probs[0]`` after the root, ``target_probs[i + 1]`` after node ``i``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # target token ids
    parents: list[int]  # -1 = the root
    depths: list[int]  # children of the root have depth 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """BoolTensor [N+1, N+1]: row r may attend to column c iff c is r, the root, or an ancestor of r (the
        runner's short-form mask: the committed cache stays visible to every row)."""
        size = len(self) + 1
        mask = torch.eye(size, dtype=torch.bool)
        mask[:, 0] = True
        for node, parent in enumerate(self.parents):
            if parent >= 0:  # parents come first, so their rows are already complete
                mask[node + 1] |= mask[parent + 1]
        return mask.to(device)

    def positions(self, root_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """LongTensor [N+1]: the root at ``root_position``, a node at ``root_position + depth``."""
        return root_position + torch.tensor([0, *self.depths], dtype=torch.long, device=device)


def keep_best(scores: Sequence[float], parents: Sequence[int], budget: int) -> list[int]:
    """The ``budget`` highest-scoring nodes (ties: the earlier node), in creation order.

    With scores that never increase from a parent to its child (cumulative log-probabilities), the kept set is
    ancestor-closed: a parent scores at least as high as its child and was created earlier."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: max(budget, 0)]
    kept = sorted(ranked)
    chosen = set(kept)
    for node in kept:
        if parents[node] >= 0 and parents[node] not in chosen:
            raise ValueError(
                f"node {node} scores above its parent {parents[node]}: tree scores must not increase "
                "along a path (use cumulative log-probabilities)"
            )
    return kept


def subtree(tokens: Sequence[int], parents: Sequence[int], depths: Sequence[int], kept: Sequence[int]) -> DraftTree:
    """The tree of the ancestor-closed node set ``kept`` (increasing), re-indexed."""
    index = {node: i for i, node in enumerate(kept)}
    return DraftTree(
        tokens=[int(tokens[n]) for n in kept],
        parents=[index[parents[n]] if parents[n] >= 0 else -1 for n in kept],
        depths=[int(depths[n]) for n in kept],
    )
