"""What every decoding algorithm shares: its entry point, and (re-exported from ``inference.engine.state``) its
result, its statistics and the output bookkeeping.

An algorithm turns a prompt into new tokens with one target runner (and, for draft-model algorithms, a draft
runner). It reports the counters docs/architecture.md §6.4 lists, so evaluation treats all algorithms alike. An
algorithm with a strategy (``strategy()``) runs on the engine loop (``inference.engine.loop``): a request run alone
is a one-row engine run, the same code that serves requests side by side.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from core.errors import UserError
from inference.engine.loop import DecodeEngine
from inference.engine.state import (
    GenerationResult,
    GenerationStats,
    OutputBuffer,
    RowRequest,  # noqa: F401
    TokenCallback,
    fit_problem,
)
from inference.engine.strategy import Strategy
from inference.sampling import SamplingParams


class Algorithm(ABC):
    """A lossless decoding algorithm. Subclasses declare which drafter they need and return their ``strategy()``:
    every algorithm runs on the engine loop (a request alone is a one-row run of it). Each takes its options
    dataclass (``inference.algorithms.options``) whole, or its fields as keywords: the dataclass holds the defaults."""

    name: ClassVar[str]
    drafter: ClassVar[str] = "none"  # none, or the drafter kind it is written for (core.drafters.kinds)
    # what the engine hands the constructor besides the options (inference.engine_args.engine_context names them)
    context: ClassVar[tuple[str, ...]] = ()
    batchable: ClassVar[bool] = False  # runs requests side by side on the engine loop (its strategy batches rows)
    squeezable: ClassVar[bool] = False  # its strategy drafts fewer tokens for a row whose width the engine caps

    def __init__(self, target, *, max_seq_len: int | None = None):
        self.target = target
        self.max_seq_len = max_seq_len or target.max_seq_len

    def extra_metrics(self) -> dict:
        """Algorithm-specific figures for the evaluation record of the runs since the previous call (e.g. an
        executor's simulated-overlap timing); each call starts a new period. Default: none."""
        return {}

    def lookahead(self) -> int:
        """Cache slots needed beyond the committed tokens during one step."""
        return 1

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        problem = fit_problem(prompt_len, max_new_tokens, self.lookahead(), self.max_seq_len)
        if problem:
            raise UserError(problem)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        eos_ids: Sequence[int] = (),
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        if len(prompt_ids) == 0:
            raise UserError("empty prompt: give at least one token")
        self.check_fits(len(prompt_ids), max_new_tokens)
        stats = GenerationStats()
        out = OutputBuffer(max_new_tokens, eos_ids, on_tokens)
        start = time.perf_counter()
        self._generate(list(prompt_ids), out, sampling, generator, stats)
        _synchronize(self.target)
        stats.wall_s = time.perf_counter() - start
        stats.new_tokens = len(out.tokens)
        return GenerationResult(out.tokens, stats)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        eos_ids: Sequence[int] = (),
    ) -> list[GenerationResult]:
        """``prompts`` side by side on the engine loop, one row each (a ``batchable`` algorithm), sharing
        ``generator``: greedy answers are each prompt's answer alone; sampled ones follow the target's law. Each
        result's ``wall_s`` is the batch's wall time split evenly, so summed stats give the batch's tokens/s. A
        target runner without row views (the transformers fallback) answers them one at a time."""
        if not self.batchable:
            raise UserError(f"{self.name} answers one prompt at a time; use batch_size=1")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("generate_batch needs at least one prompt and no empty prompt")
        kw = {"max_new_tokens": max_new_tokens, "sampling": sampling, "generator": generator, "eos_ids": eos_ids}
        if not hasattr(self.target, "row_block"):  # a runner without row views (the fallback): one at a time
            return [self.generate(prompt, **kw) for prompt in prompts]
        for prompt in prompts:
            self.check_fits(len(prompt), max_new_tokens)
        engine = DecodeEngine(
            self.target, self.strategy(), rows=len(prompts), eos_ids=eos_ids, max_seq_len=self.max_seq_len
        )
        queue = [RowRequest(k, list(p), max_new_tokens, sampling, generator) for k, p in enumerate(prompts)]
        events = {}
        start = time.perf_counter()
        engine.run(lambda: queue.pop(0) if queue else None, lambda event: events.__setitem__(event.key, event))
        _synchronize(self.target)
        wall = time.perf_counter() - start
        results = []
        for k in range(len(prompts)):
            if not hasattr(events[k], "result"):
                raise events[k].error
            events[k].result.stats.wall_s = wall / len(prompts)
            results.append(events[k].result)
        return results

    @abstractmethod
    def strategy(self) -> Strategy:
        """A new strategy of this algorithm for the engine loop."""

    def _generate(
        self,
        prompt_ids: list[int],
        out: OutputBuffer,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        """One request alone: a one-row run of the engine loop."""
        engine = self.__dict__.get("_solo_engine")
        if engine is None:
            engine = self.__dict__["_solo_engine"] = DecodeEngine(self.target, self.strategy(), rows=1)
        engine.run_one(RowRequest(None, prompt_ids, out.max_new_tokens, sampling, generator), out, stats)


def _synchronize(runner) -> None:
    device = getattr(runner, "device", torch.device("cpu"))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def as_batch(tokens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)
