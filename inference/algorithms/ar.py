"""Autoregressive decoding: the baseline every speedup is measured against (and the greedy reference).

A gpt-fast style loop: one prefill, then one single-token forward per new token over the static KV cache. It is the
engine loop's width-1 strategy (``inference.engine.strategy.Strategy``): no drafter, one sampled token a step.
"""

from __future__ import annotations

from inference.algorithms.base import Algorithm
from inference.algorithms.options import AROptions, with_fields
from inference.engine.strategy import Strategy


class Autoregressive(Algorithm):
    name = "ar"
    drafter = "none"
    batchable = True

    def __init__(self, target, options: AROptions | None = None, *, max_seq_len: int | None = None):
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = with_fields(AROptions, options, {})

    def strategy(self) -> Strategy:
        return Strategy()
