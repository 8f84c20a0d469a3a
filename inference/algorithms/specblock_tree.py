"""SpecBlock with a rank-guided block tree (``specblock_ssd_eagle3.md`` §1.6): lossless, greedy and sampling.

Bookkeeping (training-consistent, §1.6 / §1.9 item 9): every committed token ``x_{j+1}`` appears in exactly one
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

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer, as_batch
from inference.algorithms.feature_drafting import FeatureDrafting, TreeVerification
from inference.sampling import SamplingParams
from inference.specblock_tree_builder import SpecBlockTreeBuilder, TreeShape


class SpecBlockTree(FeatureDrafting, TreeVerification, Algorithm):
    name = "specblock_tree"
    drafter = "specblock"

    def __init__(self, target, drafter, *, width: int = 10, budget: int = 90, widths: list[int] | None = None,
                 blocks: int = 2, prob_caps: bool = True, max_seq_len: int | None = None, adapt: str = "none",
                 adapt_settings=None):
        super().__init__(target, max_seq_len=max_seq_len)
        if adapt not in ("none", "bandit"):
            raise ValueError(f"adapt={adapt} is unknown; use adapt=none or adapt=bandit")
        if not hasattr(drafter, "forward_leaves"):
            raise ValueError(f"specblock_tree needs a SpecBlock drafter, got {type(drafter).__name__}: pass "
                             "specblock_drafter=PATH (a SpecBlock export for this target)")
        _check_drafter_fits(target, drafter.config)
        self.drafter = drafter.eval()
        widths = list(drafter.config.widths if widths is None else widths)
        self.shape = TreeShape(width=width, budget=budget, widths=tuple(widths), blocks=blocks, prob_caps=prob_caps)
        self.builder = SpecBlockTreeBuilder(self.drafter, self.shape)
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.max_accept = blocks * drafter.config.block_size + 1
        self.adapter = None
        if adapt == "bandit":  # measures its costs now (start-up), on this target and drafter
            from spectrain.adapt.adapter import AdaptSettings
            from spectrain.adapt.engine import build_adapter

            self.adapter = build_adapter(target, drafter, adapt_settings or AdaptSettings(),
                                         verify_tokens=budget + 1, max_accept=self.max_accept)

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        options = {"width": cfg.specblock_width, "budget": cfg.specblock_budget, "widths": cfg.specblock_widths,
                   "blocks": cfg.specblock_blocks, "prob_caps": cfg.specblock_prob_caps}
        if getattr(cfg, "adapt", "none") != "none":
            from spectrain.adapt.adapter import AdaptSettings

            options.update(adapt=cfg.adapt, adapt_settings=AdaptSettings.from_options(cfg))
        return options

    def lookahead(self) -> int:
        return self.shape.budget + 1

    def _generate(
        self,
        prompt_ids: list[int],
        out: OutputBuffer,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        target, drafter = self.target, self.drafter
        device = target.device
        cache = drafter.new_cache(self.max_seq_len + 1)
        start = self._prefill(prompt_ids, out, sampling, generator, stats)
        output, root, features, next_tokens = start.output, start.root, start.features, start.next_tokens
        committed = len(prompt_ids)
        adapter = self.adapter
        if adapter is not None:
            adapter.begin_query(prompt_ids, features[0], output.logits[0, -1], max_accept=self.max_accept)

        while not out.done:
            first = drafter.extend_and_draft(features, as_batch(next_tokens, device), cache)
            stats.draft_forwards += 1
            child_logits: dict[int, torch.Tensor] | None = None if adapter is None else {}
            tree, later = self.builder.build(first, cache, max_depth=max(1, out.remaining - 1),
                                             child_logits=child_logits)
            stats.draft_forwards += later

            verified = self._verify_tree(root, tree, committed, sampling, generator, stats, out)
            kept_rows, emitted = verified.kept_rows, verified.emitted
            features, next_tokens = verified.features, emitted
            if adapter is not None:
                self._observe_round(root, tree, verified, child_logits)
            committed += len(kept_rows)
            root = emitted[-1]
        if adapter is not None:
            adapter.end_query(root)


def _check_drafter_fits(target, config) -> None:
    """Refuse a SpecBlock drafter built for another target shape (one line each)."""
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(f"SpecBlock drafter vocab_size {config.vocab_size} differs from the target's "
                         f"{target.config.vocab_size}: it was trained for another tokenizer")
    if config.target_hidden_size != target.config.hidden_size:
        raise ValueError(f"SpecBlock drafter reads features of width {config.target_hidden_size} but the target's "
                         f"hidden_size is {target.config.hidden_size}: it was trained for another target")
    if max(config.aux_layer_ids) >= target.num_layers:
        raise ValueError(f"SpecBlock drafter aux layers {config.aux_layer_ids} do not exist in a "
                         f"{target.num_layers}-layer target")
