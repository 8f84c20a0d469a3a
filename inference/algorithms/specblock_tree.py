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

``adapt=bandit`` (``spectrain.adapt``), as in ``eagle3_tree``: after every verification the adapter receives the
committed rows and the drafter's distribution where the walk stopped; after the query it may update the drafter.
The verifier and the emitted tokens are untouched, so output stays lossless.
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer
from inference.algorithms.feature_drafting import (FeatureDrafting, TreeVerification, adapt_options,
                                                   check_drafter_fits)
from inference.round_observers import check_observer
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams
from inference.specblock_tree_builder import SpecBlockTreeBuilder, TreeShape


class SpecBlockTree(FeatureDrafting, TreeVerification, Algorithm):
    name = "specblock_tree"
    drafter = "specblock"

    def __init__(self, target, drafter, *, width: int = 10, budget: int = 90, widths: list[int] | None = None,
                 blocks: int = 2, prob_caps: bool = True, max_seq_len: int | None = None, adapt: str = "none",
                 adapt_settings=None):
        super().__init__(target, max_seq_len=max_seq_len)
        check_observer(adapt)
        if not hasattr(drafter, "forward_leaves"):
            raise ValueError(f"specblock_tree needs a SpecBlock drafter, got {type(drafter).__name__}: pass "
                             "specblock_drafter=PATH (a SpecBlock export for this target)")
        check_drafter_fits(target, drafter.config, "SpecBlock")
        self.drafter = drafter.eval()
        widths = list(drafter.config.widths if widths is None else widths)
        self.shape = TreeShape(width=width, budget=budget, widths=tuple(widths), blocks=blocks, prob_caps=prob_caps)
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.max_accept = blocks * drafter.config.block_size + 1
        self._build_adapter(adapt, adapt_settings, verify_tokens=budget + 1, max_accept=self.max_accept)
        self.builder = SpecBlockTreeBuilder(self.drafter, self.shape)  # after: adaptation may copy the drafter

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"width": cfg.specblock_width, "budget": cfg.specblock_budget, "widths": cfg.specblock_widths,
                "blocks": cfg.specblock_blocks, "prob_caps": cfg.specblock_prob_caps, **adapt_options(cfg)}

    def lookahead(self) -> int:
        return self.shape.budget + 1

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        self._generate_trees(prompt_ids, out, sampling, generator, stats,
                             cache=self.drafter.new_cache(self.max_seq_len + 1), max_accept=self.max_accept)

    def _draft_tree(self, features, next_tokens, committed, cache, out, stats, child_logits):
        first = self.drafter.extend_and_draft(features, as_batch(next_tokens, self.target.device), cache)
        stats.draft_forwards += 1
        tree, later = self.builder.build(first, cache, max_depth=max(1, out.remaining - 1), child_logits=child_logits)
        stats.draft_forwards += later
        return tree
