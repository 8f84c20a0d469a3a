"""The SpecBlock draft tree (docs/algorithms/specblock.md §6, the released reference path).

Block 1 (the current anchor's first block, drafted when the anchor was committed) gives per slot ``k`` the draft
log-probs, the greedy token ``g_k`` with probability ``p_k`` and the rank bucket ``c_k``:

* the greedy chain ``g_0 -> ... -> g_{K-1}`` hangs below the root; scores are cumulative draft log-probs;
* slot widths (candidates incl. the greedy one): slot 0 of block 1 uses ``W`` shrunk by confidence
  (``p_0 >= .9 -> 3``, ``>= .8 -> 5``, ``>= .6 -> 8``); every other slot uses ``widths[c_k]`` capped by confidence
  (``p >= .95 -> 2``, ``>= .85 -> 3``); with a table whose last entry is 0, a bucket-3 slot stops branching there
  and after; tokens ranked ``2..w`` become siblings of the greedy node;
* pending leaves (starts of later blocks): every branching slot's greedy node, every alternative and the chain
  end unless the block gives up (its first non-zero bucket is 3). Each leaf carries its source slot ``s``, the
  pre-norm hidden ``G_s`` of that slot (its condition) and its lineage's TTT validity (slots ``<= s``).

Each further round runs ONE batched drafter forward over all pending leaves (later-block mode), appends each
leaf's greedy chain below it with the same width rule (slot 0 included) and, when another round follows, keeps
the ``min(W, max(1, (N - |nodes|) // K))`` best new leaves by score. Finally the tree is pruned to ``N`` nodes:
nodes are visited by descending score and added together with their missing ancestors while the total fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.drafters.specblock import BlockKV, BlockOutput, SpecBlockCache, SpecBlockDrafter
from inference.tree import DraftTree, subtree

SLOT0_CAPS = ((0.9, 3), (0.8, 5), (0.6, 8))  # block-1 slot 0: p_0 threshold -> width cap
SLOT_CAPS = ((0.95, 2), (0.85, 3))  # every other slot
GIVE_UP = 3  # the "> 10" rank bucket


@dataclass(frozen=True)
class TreeShape:
    """The tree knobs of §6 (released defaults: W=10, N=90, TOPK=[2, 4, 6, 4], caps on, 2 blocks)."""

    width: int = 10  # W: slot-0 width of block 1; beam of leaves for rounds after block 2
    budget: int = 90  # N: nodes, root excluded
    widths: tuple[int, ...] = (2, 4, 6, 4)  # TOPK[bucket]: candidates per slot incl. the greedy one
    blocks: int = 2  # N_blk_inf: blocks per tree (block 1 + blocks - 1 batched later-block rounds)
    prob_caps: bool = True

    def __post_init__(self) -> None:
        if self.width < 1 or self.budget < 1 or self.blocks < 1:
            raise ValueError(
                f"SpecBlock tree needs width >= 1, budget >= 1 and blocks >= 1, got width={self.width}, "
                f"budget={self.budget}, blocks={self.blocks}"
            )
        if len(self.widths) != 4 or any(w < 0 for w in self.widths) or min(self.widths[:3]) < 1:
            raise ValueError(
                f"specblock widths must be 4 candidate counts (rank buckets 0-3), >= 1 for buckets 0-2 "
                f"and >= 0 for bucket 3 (0 = stop branching), got {list(self.widths)}"
            )


@dataclass
class Leaf:
    """A node that starts a later block: its tree node, source slot, condition G_s and lineage visibility."""

    node: int
    slot: int
    hidden: torch.Tensor  # [H]
    score: float
    current_valid: int  # first-block slots of the current anchor it may see (source slot of block 1, + 1)
    visible: list[int] = field(default_factory=list)  # TTT entries (earlier later-blocks) of its lineage


@dataclass
class Nodes:
    draft_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, draft id) -> node

    def add(self, draft_id: int, parent: int, depth: int, score: float) -> int:
        """A new node, or the existing child of ``parent`` with this token (a later block's chain often repeats
        block 1's next greedy token: it continues below that node, keeping the better score) [ours]."""
        existing = self.index.get((parent, int(draft_id)))
        if existing is not None:
            self.scores[existing] = max(self.scores[existing], float(score))
            return existing
        self.index[(parent, int(draft_id))] = len(self.draft_ids)
        self.draft_ids.append(int(draft_id))
        self.parents.append(parent)
        self.depths.append(depth)
        self.scores.append(float(score))
        return len(self.draft_ids) - 1


def slot_widths(
    top_probs: Sequence[float], buckets: Sequence[int], shape: TreeShape, *, first_block: bool
) -> list[int]:
    """Candidates per slot (incl. the greedy token) for one block; 0 = the table says stop branching."""
    widths, stopped = [], False
    for k, (p, c) in enumerate(zip(top_probs, buckets)):
        if first_block and k == 0:  # block-1 slot 0: W shrunk by confidence, rank ignored
            w = shape.width
            for threshold, cap in SLOT0_CAPS if shape.prob_caps else ():
                if p >= threshold:
                    w = min(w, cap)
                    break
            widths.append(w)
            continue
        stopped = stopped or (shape.widths[GIVE_UP] == 0 and c == GIVE_UP)
        w = 0 if stopped else shape.widths[c]
        for threshold, cap in SLOT_CAPS if shape.prob_caps else ():
            if p >= threshold:
                w = min(w, cap)
                break
        widths.append(w)
    return widths


def gives_up(buckets: Sequence[int]) -> bool:
    """The block's first non-zero bucket is the give-up bucket: its chain end starts no later block."""
    return next((c for c in buckets if c != 0), 0) == GIVE_UP


def prune(nodes: Nodes, budget: int, max_depth: int) -> list[int]:
    """Visit nodes by descending score (ties: earlier first); add a node with its missing ancestors while the
    total stays <= ``budget``; nodes deeper than ``max_depth`` are dropped. Returns kept nodes in creation order
    (ancestor-closed)."""
    kept: set[int] = set()
    for node in sorted(range(len(nodes.scores)), key=lambda i: (-nodes.scores[i], i)):
        if node in kept or nodes.depths[node] > max_depth:
            continue
        missing, walk = [], node
        while walk >= 0 and walk not in kept:
            missing.append(walk)
            walk = nodes.parents[walk]
        if len(kept) + len(missing) <= budget:
            kept.update(missing)
        if len(kept) == budget:
            break
    return sorted(kept)


@dataclass
class _Growing:
    """One tree while it is built: its nodes, pending leaves, TTT entries (its later blocks' K/V, one row) and
    later-block forwards, and the drafter logits its children were drawn from (for the adapter, else None)."""

    nodes: Nodes
    leaves: list[Leaf]
    child_logits: dict[int, torch.Tensor] | None
    ttt: BlockKV | None = None
    forwards: int = 0


class SpecBlockTreeBuilder:
    """Builds one tree per iteration from the current anchor's block-1 outputs; later blocks run through
    ``drafter.forward_leaves`` against the cross cache (one batched forward per round, for every row's tree)."""

    def __init__(self, drafter: SpecBlockDrafter, shape: TreeShape):
        self.drafter, self.shape = drafter, shape
        self.k = drafter.config.block_size

    def build(
        self,
        first: BlockOutput,
        cache: SpecBlockCache,
        *,
        max_depth: int | None = None,
        child_logits: dict[int, torch.Tensor] | None = None,
    ) -> tuple[DraftTree, int]:
        """(tree in target ids, later-block drafter forwards run). ``first``: block-1 outputs of the current
        anchor ([1, 1, K, ...]); ``max_depth`` caps node depth (no drafting past the token budget).
        ``child_logits`` (a dict, for the serving-time adapter) receives, by index in the returned tree (-1: the
        root), the draft logits its children were drawn from."""
        return self.build_rows([first], cache, [0], [max_depth], [child_logits])[0]

    def build_rows(
        self,
        firsts: Sequence[BlockOutput],
        cache: SpecBlockCache,
        rows: Sequence[int],
        max_depths: Sequence[int | None],
        child_logits: Sequence[dict[int, torch.Tensor] | None],
    ) -> list[tuple[DraftTree, int]]:
        """:meth:`build` for the trees of cache rows ``rows`` at once (``firsts[t]``: row ``rows[t]``'s block 1,
        one row): each round's later blocks of every tree's pending leaves run in ONE drafter forward."""
        trees = []
        for first, into in zip(firsts, child_logits):
            tree = _Growing(Nodes(), [], {} if into is not None else None)
            tree.leaves = self._expand(
                tree,
                first.logits[0, 0],
                first.rank_logits[0, 0],
                first.hidden[0, 0],
                parent=-1,
                score=0.0,
                depth=0,
                first_block=True,
                lineage=None,
                entries=None,
            )
            trees.append(tree)
        for round_index in range(1, self.shape.blocks):
            going = [t for t, tree in enumerate(trees) if tree.leaves]
            if not going:
                break
            outs = self._forward([trees[t] for t in going], [rows[t] for t in going], cache)
            last_round = round_index == self.shape.blocks - 1
            for t, out in zip(going, outs):
                tree = trees[t]
                tree.forwards += 1
                base = 0 if tree.ttt is None else tree.ttt.entries
                tree.ttt = out.kv if tree.ttt is None else BlockKV.cat([tree.ttt, out.kv])
                new_leaves = []
                for row, leaf in enumerate(tree.leaves):
                    entries = list(range(base + row * self.k, base + (row + 1) * self.k))
                    new_leaves += self._expand(
                        tree,
                        out.logits[0, row],
                        out.rank_logits[0, row],
                        out.hidden[0, row],
                        parent=leaf.node,
                        score=leaf.score,
                        depth=tree.nodes.depths[leaf.node],
                        first_block=False,
                        lineage=leaf,
                        entries=entries,
                    )
                if last_round:
                    continue
                beam = min(self.shape.width, max(1, (self.shape.budget - len(tree.nodes.scores)) // self.k))
                unique = {leaf.node: leaf for leaf in reversed(new_leaves)}  # a merged node starts one block
                tree.leaves = sorted(unique.values(), key=lambda lf: (-lf.score, lf.node))[:beam]
        return [self._finish(tree, max_depth, into) for tree, max_depth, into in zip(trees, max_depths, child_logits)]

    def _finish(
        self, tree: _Growing, max_depth: int | None, child_logits: dict[int, torch.Tensor] | None
    ) -> tuple[DraftTree, int]:
        nodes = tree.nodes
        kept = prune(nodes, self.shape.budget, max_depth if max_depth is not None else 1 << 30)
        if child_logits is not None:  # re-key by index in the kept tree
            index = {node: i for i, node in enumerate(kept)} | {-1: -1}
            child_logits.clear()
            child_logits.update({index[n]: row for n, row in tree.child_logits.items() if n in index})
        draft = torch.tensor(nodes.draft_ids, dtype=torch.long, device=self.drafter.d2t.device)
        target_ids = self.drafter.to_target_ids(draft).tolist()
        return subtree(target_ids, nodes.parents, nodes.depths, kept), tree.forwards

    def _forward(self, trees: Sequence[_Growing], rows: Sequence[int], cache: SpecBlockCache) -> list[BlockOutput]:
        """One later-block forward over the pending leaves of ``trees`` (of cache rows ``rows``): each tree's
        outputs as a one-row :class:`BlockOutput` (its leaves; ``kv`` its entries). A one-row cache gets the
        one-row call."""
        device = self.drafter.d2t.device
        if cache.batch == 1:
            (tree,) = trees
            leaves = tree.leaves
            draft = torch.tensor([tree.nodes.draft_ids[leaf.node] for leaf in leaves], dtype=torch.long, device=device)
            visible = None
            if tree.ttt is not None:
                visible = torch.zeros(len(leaves), tree.ttt.entries, dtype=torch.bool)
                for row, leaf in enumerate(leaves):
                    visible[row, leaf.visible] = True
            return [
                self.drafter.forward_leaves(
                    torch.stack([leaf.hidden for leaf in leaves])[None],
                    self.drafter.to_target_ids(draft)[None],
                    cache,
                    current_valid=torch.tensor([leaf.current_valid for leaf in leaves]),
                    ttt=tree.ttt,
                    ttt_visible=visible,
                )
            ]
        batch, width = cache.batch, max(len(tree.leaves) for tree in trees)
        hidden = trees[0].leaves[0].hidden
        cond = hidden.new_zeros(batch, width, hidden.shape[-1])
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        valid = torch.zeros(batch, width, dtype=torch.long)
        counts, ttt_counts = [0] * batch, [0] * batch
        with_ttt = [tree for tree in trees if tree.ttt is not None]
        entries = max((tree.ttt.entries for tree in with_ttt), default=0)
        ttt = visible = None
        if with_ttt:
            layers, like = len(with_ttt[0].ttt.k), with_ttt[0].ttt.k[0]
            shape = (batch, like.shape[1], entries, like.shape[3])
            ttt = BlockKV(
                [like.new_zeros(shape) for _ in range(layers)], [like.new_zeros(shape) for _ in range(layers)]
            )
            visible = torch.zeros(batch, width, entries, dtype=torch.bool)
        for tree, row in zip(trees, rows):
            n = counts[row] = len(tree.leaves)
            cond[row, :n] = torch.stack([leaf.hidden for leaf in tree.leaves])
            draft = torch.tensor(
                [tree.nodes.draft_ids[leaf.node] for leaf in tree.leaves], dtype=torch.long, device=device
            )
            tokens[row, :n] = self.drafter.to_target_ids(draft)
            valid[row, :n] = torch.tensor([leaf.current_valid for leaf in tree.leaves])
            if tree.ttt is not None:
                e = ttt_counts[row] = tree.ttt.entries
                for layer in range(len(ttt.k)):
                    ttt.k[layer][row, :, :e] = tree.ttt.k[layer][0]
                    ttt.v[layer][row, :, :e] = tree.ttt.v[layer][0]
                for index, leaf in enumerate(tree.leaves):
                    visible[row, index, leaf.visible] = True
        out = self.drafter.forward_leaves(
            cond,
            tokens,
            cache,
            current_valid=valid,
            ttt=ttt,
            ttt_visible=visible,
            counts=counts,
            ttt_counts=ttt_counts if with_ttt else None,
        )
        outputs = []
        for tree, row in zip(trees, rows):
            n, one = len(tree.leaves), slice(row, row + 1)
            kv = BlockKV([k[one, :, : n * self.k] for k in out.kv.k], [v[one, :, : n * self.k] for v in out.kv.v])
            outputs.append(BlockOutput(out.logits[one, :n], out.rank_logits[one, :n], out.hidden[one, :n], kv))
        return outputs

    def _expand(
        self,
        tree: _Growing,
        logits: torch.Tensor,
        rank_logits: torch.Tensor,
        hidden: torch.Tensor,
        *,
        parent: int,
        score: float,
        depth: int,
        first_block: bool,
        lineage: Leaf | None,
        entries: list[int] | None,
    ) -> list[Leaf]:
        """Append one block's chain and alternatives below ``parent``; return the leaves it makes pending."""
        nodes = tree.nodes
        # clamp: a child's cumulative score never exceeds its parent's (pruning stays ancestor-closed)
        log_probs = logits.float().log_softmax(dim=-1).clamp_max(0.0)
        greedy = log_probs.argmax(dim=-1)
        top_probs = log_probs.gather(-1, greedy[:, None]).exp().flatten().tolist()
        buckets = rank_logits.argmax(dim=-1).tolist()
        widths = slot_widths(top_probs, buckets, self.shape, first_block=first_block)
        pending: list[tuple[int, int]] = []  # (node, source slot)
        chain_parent, chain_score = parent, score
        for k in range(self.k):
            width = min(widths[k], log_probs.shape[-1])
            candidates = log_probs[k].topk(max(width, 1))
            ids, values = candidates.indices.tolist(), candidates.values.tolist()
            if tree.child_logits is not None:
                tree.child_logits.setdefault(chain_parent, logits[k])
            node = nodes.add(ids[0], chain_parent, depth + 1 + k, chain_score + values[0])
            for alt_id, alt_value in zip(ids[1:], values[1:]):
                pending.append((nodes.add(alt_id, chain_parent, depth + 1 + k, chain_score + alt_value), k))
            if width > 1:
                pending.append((node, k))
            chain_parent, chain_score = node, nodes.scores[node]
        if not gives_up(buckets):
            pending.append((chain_parent, self.k - 1))
        leaves = []
        for node, slot in sorted(set(pending)):  # creation order; a merged node starts one block
            if leaves and leaves[-1].node == node:
                continue
            if lineage is None:
                current_valid, visible = slot + 1, []
            else:
                current_valid, visible = lineage.current_valid, lineage.visible + entries[: slot + 1]
            leaves.append(Leaf(node, slot, hidden[slot], nodes.scores[node], current_valid, visible))
        return leaves
