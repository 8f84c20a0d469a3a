"""P-EAGLE (parallel EAGLE): ONE drafter forward per round drafts a chain of K tokens, verified as a chain; lossless,
greedy and sampling.

Per round, with ``n`` committed tokens in the target's cache and the last emitted token ``r`` (not yet in it):

1. The drafter appends the rows the last verification committed (EAGLE-3's rows: the target's aux layers at each
   kept position, paired with the token after it; at the start the prompt's, captured by the prefill) and, in the same
   forward, ``K - 1`` mask rows after the last of them (:meth:`core.drafters.peagle.PEagleDrafter.draft`): the last
   committed row (position ``n - 1``, token ``r``) drafts position ``n + 1``, mask row ``d`` position ``n + 1 + d``.
2. Draft tokens: each row's argmax at T = 0, a sample of its warped distribution at T > 0 (exact, since the mask
   rows never read the drafted tokens: :mod:`inference.algorithms.parallel_drafting`, whose query loop this is).
3. The target verifies ``[r, drafts]`` in ONE forward, capturing the aux layers; the cache keeps ``r`` and the
   accepted drafts, whose rows are the drafter's next committed rows.

``peagle_draft_tokens`` drafts fewer than ``K`` tokens per round (a cheaper drafter forward and verification).
"""

from __future__ import annotations

import torch

from core.drafters.peagle import PEagleDrafter
from inference.algorithms.base import Algorithm
from inference.algorithms.options import PEagleOptions, with_fields
from inference.algorithms.feature_drafting import check_drafter_fits
from inference.algorithms.parallel_drafting import ParallelDrafting


class PEagle(ParallelDrafting, Algorithm):
    name = "peagle"
    drafter = "peagle"
    batchable = True
    depth_sensitive = True  # the mask rows of a call: rows drafting fewer tokens get a call of their own

    def __init__(
        self, target, drafter, options: PEagleOptions | None = None, *, max_seq_len: int | None = None, **fields
    ):
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = options = with_fields(PEagleOptions, options, fields)
        if not isinstance(drafter, PEagleDrafter):
            raise ValueError(
                f"peagle needs a P-EAGLE drafter, got {type(drafter).__name__}: pass drafter.peagle=PATH "
                "(a P-EAGLE export for this target)"
            )
        check_drafter_fits(target, drafter.config, "P-EAGLE")
        most = drafter.config.num_depths
        self._init_parallel(drafter, options.draft_tokens, most, f"this drafter drafts {most} tokens per forward")

    def _draft_logits(
        self, cache, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int] | None, gamma: int
    ) -> torch.Tensor:
        if counts is None:  # one row
            return self.drafter.draft(cache, features, next_tokens[0].tolist(), depths=gamma)
        return self.drafter.draft(cache, features, next_tokens, depths=gamma, counts=counts)
