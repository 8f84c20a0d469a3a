"""Autoregressive decoding: the baseline every speedup is measured against (and the greedy reference).

A gpt-fast style loop: one prefill, then one single-token forward per new token over the static KV cache.
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams, sample


class Autoregressive(Algorithm):
    name = "ar"
    drafter = "none"

    def _generate(
        self,
        prompt_ids: list[int],
        out: OutputBuffer,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        target = self.target
        target.reset(1)
        logits = target.forward(as_batch(prompt_ids, target.device), only_last_logits=True).logits[0, -1]
        stats.target_forwards += 1
        while True:
            token = sample(sampling.warp(logits), generator)
            out.extend([int(token)])
            if out.done:
                return
            logits = target.forward(token.view(1, 1)).logits[0, -1]
            stats.target_forwards += 1
