"""What algorithms whose drafter drafts a whole chain in ONE forward (``dflash``, ``peagle``) share: the query loop
(prefill, then per round: one drafter forward, the chain verified in one target forward with the tokenwise rule, the
accepted rows' features handed back to the drafter) and turning the drafter's logits into draft tokens.

Exactness at T > 0: the drafter's distribution for chain position k does not depend on the tokens drawn for the
earlier positions (DFlash's slots read mask tokens and the context, P-EAGLE's deeper rows the mask token and
``mask_hidden``), so ``q_k`` is also its law given them and the tokenwise rule (accept with ``min(1, p/q)``, else the
residual) keeps the target's law exactly, as for a draft LM. Each algorithm supplies ``_draft_logits``.
"""

from __future__ import annotations

import torch

from inference.algorithms.base import GenerationStats, OutputBuffer
from inference.algorithms.feature_drafting import FeatureDrafting
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams, sample
from inference.verify import get_verifier


class ParallelDrafting(FeatureDrafting):
    """Mixin: the algorithm sets ``self.drafter`` (a ``TargetTiedDrafter``), ``self.draft_tokens`` (the most a round
    drafts) and ``self.aux_layers`` (calling :meth:`_init_parallel`), and implements ``_draft_logits``."""

    def _init_parallel(self, drafter, draft_tokens: int, most: int, why_most: str) -> None:
        """``draft_tokens``: the ``{name}_draft_tokens`` option, 1..``most`` (0: ``most``, what one drafter forward
        drafts); ``why_most`` says in the error what limits it, e.g. "this drafter's block drafts 7 tokens"."""
        if not 0 <= draft_tokens <= most:
            raise ValueError(f"{self.name}_draft_tokens={draft_tokens} but {why_most}; give 1..{most} (0 = all of them)")
        self.drafter = drafter.eval()
        self.draft_tokens = draft_tokens or most
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.verifier = get_verifier("tokenwise")

    def _draft_logits(self, cache, features: torch.Tensor, next_tokens: list[int], gamma: int) -> torch.Tensor:
        """One drafter forward: append the committed rows (``features`` [1, n, ·] of the positions after those
        ``cache`` holds, ``next_tokens`` the token after each) and return the logits of ``gamma`` drafts [gamma, Vd]
        after the last of them (whose next token, the last emitted one, is not in the target's cache yet)."""
        raise NotImplementedError

    def lookahead(self) -> int:
        return self.draft_tokens + 1

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        target = self.target
        start = self._prefill(prompt_ids, out, sampling, generator, stats)
        cache = self.drafter.new_cache(self.max_seq_len)
        root, features, next_tokens = start.root, start.features, start.next_tokens
        while not out.done:
            gamma = max(1, min(self.draft_tokens, out.remaining - 1))  # never draft past the token budget
            logits = self._draft_logits(cache, features, next_tokens, gamma)
            stats.draft_forwards += 1
            drafts, draft_probs = self._draft(logits, sampling, generator)

            committed = target.length()
            block = torch.cat([as_batch([root], target.device), drafts.view(1, -1).to(target.device)], dim=1)
            output = target.forward(block, capture_layers=self.aux_layers)
            stats.target_forwards += 1
            result = self.verifier(drafts, draft_probs, sampling.warp(output.logits[0]), generator)
            accepted = result.num_accepted
            stats.record_round(gamma, accepted)
            target.truncate(committed + 1 + accepted)  # keep the root and the accepted drafts
            features = self._features(output)[:, : 1 + accepted]
            next_tokens = [int(t) for t in result.tokens]  # the token after each kept position
            out.extend(next_tokens)
            root = next_tokens[-1]

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
