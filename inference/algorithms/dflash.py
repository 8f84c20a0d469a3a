"""DFlash (block diffusion drafting, arXiv 2602.06036): ONE drafter forward per round drafts a whole block, verified
as a chain; lossless, greedy and sampling.

Per round, with ``n`` committed tokens in the target's cache and the last emitted token ``r`` (not yet in it):

1. The drafter appends the context of the positions the last verification committed (the target's aux layers,
   captured by that verification; at the start the prompt's, captured by the prefill) to its cache, and drafts
   the block anchored at ``r`` (position ``n``): ``block_size - 1`` distributions for positions ``n + 1 ...``,
   all from one forward (the mask tokens do not read the drafted tokens, so the slots are independent given
   the context).
2. The draft tokens: the argmax of each slot at T = 0; at T > 0 a sample from each slot's warped distribution
   ``q_k`` (exact: :mod:`inference.algorithms.parallel_drafting`, whose engine strategy this is).
3. The target verifies ``[r, drafts]`` in ONE forward (positions ``n ..``), capturing the aux layers; the cache
   keeps ``r`` and the accepted drafts, whose features are the drafter's next context.

``dflash_draft_tokens`` drafts fewer than ``block_size - 1`` tokens per round (a cheaper verification).
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm
from inference.algorithms.options import DFlashOptions, with_fields
from inference.algorithms.feature_drafting import check_drafter_fits
from inference.algorithms.parallel_drafting import ParallelDrafting


class DFlash(ParallelDrafting, Algorithm):
    name = "dflash"
    drafter = "dflash"
    batchable = True

    def __init__(
        self, target, drafter, options: DFlashOptions | None = None, *, max_seq_len: int | None = None, **fields
    ):
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = options = with_fields(DFlashOptions, options, fields)
        if not hasattr(drafter, "draft") or not hasattr(drafter.config, "block_size"):
            raise ValueError(
                f"dflash needs a DFlash drafter, got {type(drafter).__name__}: pass drafter.dflash=PATH "
                "(a DFlash export for this target)"
            )
        check_drafter_fits(target, drafter.config, "DFlash")
        most = drafter.config.block_size - 1
        self._init_parallel(drafter, options.draft_tokens, most, f"this drafter's block drafts {most} tokens")

    def _draft_logits(
        self, cache, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None, gamma: int
    ) -> torch.Tensor:
        if counts is None:  # one row
            return self.drafter.draft(cache, features, int(next_tokens[0, -1]))
        # each row's block is anchored at its last committed row's next token (the last emitted one)
        last = torch.tensor([max(c - 1, 0) for c in counts])[:, None]
        return self.drafter.draft(cache, features, next_tokens.gather(1, last)[:, 0], counts)
