"""What a server serves: one algorithm over a loaded target (and drafter), built the way ``inference.evaluate``
builds a variant, with the tokenizer, the EOS ids and the context it answers within.

A served model holds its target runner (its KV cache) alone until it is closed: two engines stepping one cache
would corrupt each other's answers, so a second server over the same loaded target is refused.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from core.drafters.kinds import CAUSAL_LM_KIND
from core.errors import UserError
from inference.algorithms import ALGORITHMS, algorithm_class
from inference.algorithms.base import Algorithm
from inference.drafters import LoadedModel, eos_token_ids, load_lm, model_dtype, pick_device
from inference.engine.widths import CostModelWidths, StepBudget, WidthPolicy
from inference.engine_args import (
    build_variant,
    check_drafters,
    drafter_paths,
    load_drafters,
    parse_variant,
    resolved_config,
    sampling_params,
)
from inference.round_observers import ObserverTap
from inference.runner_contract import default_dtype
from inference.sampling import SamplingParams
from inference.serve.limits import max_prompt_chars


@dataclass
class ServedModel:
    name: str  # the "model" clients send
    label: str  # the algorithm as configured (NAME[@key=value...])
    algorithm: Algorithm
    tokenizer: Any
    eos_ids: list[int]
    max_seq_len: int
    batch_size: int  # > 1: requests decoded side by side on the engine loop (inference.engine); else one at a time
    default_max_tokens: int
    default_sampling: SamplingParams  # what a request that sets no temperature / top_k / top_p samples with
    adapter: ObserverTap | None  # the serving-time adapter (adapt=NAME), tapped for its decisions
    exactness: dict[str, Any]  # the target runner's path and probe (inference.exactness), for /health
    # where a request that sets no seed gets one: seeded by the server's seed=, so a restarted server answers the
    # same unseeded requests, sent in the same order, alike
    seeds: random.Random = field(default_factory=random.Random)

    widths: WidthPolicy = field(default_factory=WidthPolicy)  # each step's row widths (inference.engine.widths)
    adapt: str = "none"  # the adapter's name (adapt=NAME)

    @property
    def batched(self) -> bool:
        return self.batch_size > 1

    @property
    def batching(self) -> dict[str, Any]:
        """How requests share the engine, for ``/health``."""
        widths = self.widths.describe()
        budget = widths.get("max_step_tokens", 0)
        shrink = {
            "budget": f"; each step scores at most {budget} target rows, so drafts shrink as requests join, "
            "down to AR steps",
            "cost": "; each step's drafts are as long as this host's measured forward costs and the rows' "
            "acceptance make worth it, down to AR steps",
        }.get(widths["width_policy"], "")
        adapting = (
            f"; adapt={self.adapt} learns from every request, each round charged its share of the step"
            if self.adapter is not None
            else ""
        )
        return {
            "batch_size": self.batch_size,
            "max_step_tokens": budget,
            **widths,
            "adapter": self.adapt,
            "policy": (
                "one request at a time"
                if not self.batched
                else f"up to {self.batch_size} requests side by side" + shrink
            )
            + adapting,
        }

    def room(self, prompt_len: int) -> int:
        """New tokens the context leaves after a prompt of ``prompt_len`` tokens (the algorithm's lookahead
        slots reserved, as ``Algorithm.check_fits`` counts them)."""
        return self.max_seq_len - prompt_len - self.algorithm.lookahead()

    @cached_property
    def max_prompt_chars(self) -> int:
        """A prompt's text (a chat's message contents together) longer than this cannot fit the context."""
        return max_prompt_chars(self.tokenizer, self.max_seq_len)

    def request_seed(self) -> int:
        """The seed of a request that sets none (the next of the server's seed stream)."""
        return self.seeds.getrandbits(63)

    def close(self) -> None:
        """The algorithm first (its draft process or threads), then the adapter (with ``adapt.background``: its
        last update is collected and published; its log and wandb run are finished), then the target runner is
        free for another server. Call it once the engine's worker has stopped."""
        try:
            getattr(self.algorithm, "close", lambda: None)()
        finally:
            try:
                if self.adapter is not None:
                    getattr(self.adapter, "close", lambda: None)()
            finally:
                release_runner(self.algorithm.target)


_SERVED_RUNNERS: weakref.WeakSet = weakref.WeakSet()  # target runners an open ServedModel holds
_SERVED_LOCK = threading.Lock()


def claim_runner(runner: Any) -> None:
    """Hold ``runner`` for one served model; a second claim fails in one line until ``release_runner``."""
    with _SERVED_LOCK:
        if runner in _SERVED_RUNNERS:
            raise UserError(
                "this target's runner (its KV cache) already serves another server; close that server "
                "first, or load the target again for this one"
            )
        _SERVED_RUNNERS.add(runner)


def release_runner(runner: Any) -> None:
    with _SERVED_LOCK:
        _SERVED_RUNNERS.discard(runner)


def served_name(cfg: Any) -> str:
    return cfg.model_name or Path(str(cfg.target)).name


AUTO_BATCH = 8  # rows decoded side by side when batch_size=0, where batched rows stay the requests' own answers


def batchable_algorithms() -> list[str]:
    return [name for name in ALGORITHMS if algorithm_class(name).batchable]


def serving_batch(batch_size: int, algorithm: str, dtype: torch.dtype, device: str = "cpu") -> int:
    """Rows decoded side by side: algorithms on the engine loop batch; ``batch_size`` > 1 for another is refused.
    ``batch_size=0`` (auto) batches where a batched row's answer is the request's own: on a CPU in fp32 or bf16
    (exact mode covers batched rows, ``inference.exactness``), and in fp32 elsewhere; a GPU's bf16 batch is not
    batch-invariant, and a server's greedy answers must be AR's."""
    if not algorithm_class(algorithm).batchable:
        if batch_size > 1:
            raise UserError(
                f"batch_size={batch_size}: {algorithm} serves one request at a time; batched serving "
                f"runs {', '.join(batchable_algorithms())} (or set batch_size=1)"
            )
        return 1
    if batch_size:
        return batch_size
    exact = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    return AUTO_BATCH if exact or dtype == torch.float32 else 1


def load_served_model(
    cfg: Any,
    *,
    target: LoadedModel | None = None,
    drafters: dict[str, Any] | None = None,
    on_decision: Callable[[dict], None] | None = None,
) -> ServedModel:
    """Load (or take) the target and the algorithm's drafter, and build ``cfg.algorithm`` over them. A batched
    algorithm with ``batch_size`` > 1 loads its target (and draft LM) with ``2 * batch_size`` rows: new prompts
    prefill in spare rows.
    ``on_decision`` receives each adapter decision (``adapt=``)."""
    name, _ = parse_variant(cfg.algorithm)
    kind = algorithm_class(name).drafter
    paths = drafter_paths(cfg)
    preloaded = {k: v for k, v in (drafters or {}).items() if v is not None}
    check_drafters([cfg.algorithm], set(preloaded) | set(paths), cfg.drafter)
    device = pick_device(cfg.device)
    dtype = target.runner.dtype if target is not None else model_dtype(cfg.dtype, device)
    batch = serving_batch(cfg.batch_size, name, dtype or default_dtype(torch.device(device)), device)
    if target is None:
        target = load_lm(
            cfg.target,
            device=cfg.device,
            max_seq_len=cfg.max_seq_len,
            max_batch_size=2 * batch if batch > 1 else 1,
            dtype=dtype,
            chat_template=cfg.chat_template,
        )
    if batch > 1 and not hasattr(target.runner, "row_block"):  # the transformers fallback: one row at a time
        if cfg.batch_size:
            raise UserError(
                f"batch_size={batch}: this target runs on the transformers fallback, which serves one "
                "request at a time; set batch_size=1"
            )
        batch = 1
    for key, value, unset in (("max_step_tokens", cfg.max_step_tokens, 0), ("width_policy", cfg.width_policy, "full")):
        if value != unset and (batch <= 1 or not algorithm_class(name).squeezable):
            squeezable = ", ".join(n for n in ALGORITHMS if algorithm_class(n).squeezable)
            raise UserError(
                f"{key}={value} does nothing here: it sets the drafts of batched speculative serving "
                f"(batch_size > 1 with {squeezable}); drop it"
            )
    check_rows(target.runner, batch, "target")
    claim_runner(target.runner)
    try:
        loaded = load_drafters(
            cfg, paths, {kind} - {"none"}, target, preloaded, max_batch_size=2 * batch if batch > 1 else 1
        )
        if kind == CAUSAL_LM_KIND:
            check_rows(loaded[kind], batch, "draft LM")
        algorithm, variant_cfg = build_variant(cfg.algorithm, resolved_config(cfg, paths), target, loaded, {})
    except BaseException:
        release_runner(target.runner)
        raise
    limit_draft_calls(algorithm, getattr(cfg, "draft_timeout_s", None))
    adapter = getattr(algorithm, "adapter", None)
    if adapter is not None:  # the tap reports each query's decision; the algorithm calls it like the adapter
        adapter = algorithm.adapter = ObserverTap(adapter, on_decision or (lambda row: None))
    return ServedModel(
        served_name(cfg),
        cfg.algorithm,
        algorithm,
        target.tokenizer,
        eos_token_ids(target.tokenizer, target.model.config),
        algorithm.max_seq_len,
        batch,
        variant_cfg.max_new_tokens,
        sampling_params(variant_cfg),
        adapter,
        target.runner.exactness.as_dict(),
        random.Random(variant_cfg.seed),
        widths=(
            CostModelWidths()
            if cfg.width_policy == "cost"
            else StepBudget(cfg.max_step_tokens)
            if cfg.max_step_tokens
            else WidthPolicy()
        ),
        adapt=getattr(cfg, "adapt", "none") if adapter is not None else "none",
    )


def check_rows(runner: Any, batch: int, what: str) -> None:
    if batch > 1 and runner.max_batch_size < batch:
        raise UserError(
            f"batch_size={batch} but the {what} runner holds {runner.max_batch_size} rows; load it with "
            f"max_batch_size={2 * batch}"
        )


def limit_draft_calls(algorithm: Algorithm, seconds: float | None) -> None:
    """A draft-process call of ``algorithm`` (executor=multiprocess) that takes over ``seconds`` fails its request
    and stops the process, instead of holding the engine for the process group's 600 s. Set before the executor
    is built (on first use)."""
    executor_kwargs = getattr(algorithm, "executor_kwargs", None)
    if seconds and executor_kwargs is not None:
        executor_kwargs["call_timeout_s"] = float(seconds)


def warm_up(model: ServedModel) -> None:
    """One short greedy generation: allocation and kernel selection happen now, not in the first request; then
    the width policy measures what it needs (``width_policy=cost``: this host's forward costs)."""
    prompt = model.tokenizer("Hello", add_special_tokens=False)["input_ids"] or [0]
    model.algorithm.generate(
        prompt,
        max_new_tokens=min(4, max(1, model.room(len(prompt)))),
        sampling=SamplingParams(0.0),
        generator=torch.Generator().manual_seed(0),
        eos_ids=model.eos_ids,
    )
    if model.batched:
        strategy = model.algorithm.strategy()
        model.widths.prepare(model.algorithm.target, strategy.draft, model.batch_size, strategy.lookahead())
