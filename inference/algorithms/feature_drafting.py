"""What tree algorithms over feature-conditioned drafters (``eagle3_tree``, ``specblock_tree``) share: reading
the drafter's input features from the target's captured hidden states, and the prefill that starts a query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.algorithms.base import GenerationStats, OutputBuffer, as_batch
from inference.sampling import SamplingParams, sample


@dataclass
class FeaturePrefill:
    root: int  # the first generated token (not yet in the target's cache)
    output: object  # the target's prefill RunnerOutput (last-position logits, captured layers)
    features: torch.Tensor  # [1, P, 3·H_t] features of the prompt positions
    next_tokens: list[int]  # the token after each of those positions (the prompt shifted, then the root)


class FeatureDrafting:
    """Mixin for algorithms whose drafter reads the target's aux layers (``self.drafter``, ``self.aux_layers``)."""

    def _features(self, output) -> torch.Tensor:
        """[1, T, 3·H_t]: the aux layers concatenated in the drafter's order, in the drafter's dtype."""
        return torch.cat([output.hidden[i] for i in self.aux_layers], dim=-1).to(self.drafter.fc.weight.dtype)

    def _prefill(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                 generator: torch.Generator | None, stats: GenerationStats) -> FeaturePrefill:
        """Reset and prefill the target, sample the first token, and return what the drafter reads next."""
        target = self.target
        target.reset(1)
        output = target.forward(as_batch(prompt_ids, target.device), capture_layers=self.aux_layers,
                                only_last_logits=True)
        stats.target_forwards += 1
        root = int(sample(sampling.warp(output.logits[0, -1]), generator))
        out.extend([root])
        return FeaturePrefill(root, output, self._features(output), prompt_ids[1:] + [root])
