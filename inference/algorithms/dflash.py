"""DFlash (block diffusion drafting, arXiv 2602.06036): ONE drafter forward per round drafts a whole block, verified
as a chain; lossless, greedy and sampling.

Per round, with ``n`` committed tokens in the target's cache and the last emitted token ``r`` (not yet in it):

1. The drafter appends the context of the positions the last verification committed (the target's aux layers,
   captured by that verification; at the start the prompt's, captured by the prefill) to its cache, and drafts
   the block anchored at ``r`` (position ``n``): ``block_size - 1`` distributions for positions ``n + 1 ...``,
   all from one forward (the mask tokens do not read the drafted tokens, so the slots are independent given
   the context).
2. The draft tokens: the argmax of each slot at T = 0; at T > 0 a sample from each slot's warped distribution
   ``q_k``. Since slot ``k``'s distribution does not depend on the tokens drawn for the earlier slots, ``q_k`` is
   also its law given them, so the tokenwise rule (accept with ``min(1, p/q)``, else the residual) keeps the
   target's law exactly, as for a draft LM.
3. The target verifies ``[r, drafts]`` in ONE forward (positions ``n ..``), capturing the aux layers; the cache
   keeps ``r`` and the accepted drafts, whose features are the drafter's next context.

``dflash_draft_tokens`` drafts fewer than ``block_size - 1`` tokens per round (a cheaper verification).
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer
from inference.algorithms.feature_drafting import FeatureDrafting, check_drafter_fits
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams, sample
from inference.verify import get_verifier


class DFlash(FeatureDrafting, Algorithm):
    name = "dflash"
    drafter = "dflash"

    def __init__(self, target, drafter, *, draft_tokens: int = 0, max_seq_len: int | None = None):
        super().__init__(target, max_seq_len=max_seq_len)
        if not hasattr(drafter, "draft") or not hasattr(drafter.config, "mask_token_id"):
            raise ValueError(f"dflash needs a DFlash drafter, got {type(drafter).__name__}: pass dflash_drafter=PATH "
                             "(a DFlash export for this target)")
        check_drafter_fits(target, drafter.config, "DFlash")
        most = drafter.config.block_size - 1
        if not 0 <= draft_tokens <= most:
            raise ValueError(f"dflash_draft_tokens={draft_tokens} but this drafter's block drafts {most} tokens; "
                             f"give 1..{most} (0 = all of them)")
        self.drafter = drafter.eval()
        self.draft_tokens = draft_tokens or most
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.verifier = get_verifier("tokenwise")

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"draft_tokens": cfg.dflash_draft_tokens}

    def lookahead(self) -> int:
        return self.draft_tokens + 1

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        target = self.target
        start = self._prefill(prompt_ids, out, sampling, generator, stats)
        cache = self.drafter.new_cache(self.max_seq_len)
        root, features = start.root, start.features
        while not out.done:
            gamma = max(1, min(self.draft_tokens, out.remaining - 1))  # never draft past the token budget
            logits = self.drafter.draft(cache, features, root)[0, :gamma]
            stats.draft_forwards += 1
            drafts, draft_probs = self._draft(logits, sampling, generator)

            committed = target.length()
            block = torch.cat([as_batch([root], target.device), drafts.view(1, -1).to(target.device)], dim=1)
            output = target.forward(block, capture_layers=self.aux_layers)
            stats.target_forwards += 1
            result = self.verifier(drafts, draft_probs, sampling.warp(output.logits[0]), generator)
            accepted = result.num_accepted
            stats.record_round(gamma, accepted)
            target.truncate(committed + 1 + accepted)  # keep r and the accepted drafts
            features = self._features(output)[:, : 1 + accepted]
            emitted = [int(t) for t in result.tokens]
            out.extend(emitted)
            root = emitted[-1]

    def _draft(self, logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary logits [γ, Vd] -> target ids [γ] and, when sampling, the distributions they were drawn
        from over the target vocabulary [γ, V] (None: argmax drafts, a point mass for the verifier)."""
        to_target = self.drafter.draft_ids_in_target().to(logits.device)
        if sampling.greedy:
            return to_target[logits.argmax(-1)], None
        q_draft = sampling.warp(logits.float())
        q = q_draft.new_zeros(len(logits), self.drafter.config.vocab_size)
        q[:, to_target] = q_draft
        return torch.stack([sample(row, generator) for row in q]), q
