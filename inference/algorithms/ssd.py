"""SSD — speculative speculative decoding with SAGUARO (docs/algorithms/ssd.md), batch ≥ 1, lossless.

While the target verifies round T, the draft side (``inference.ssd_draft.SSDDraftSide``, run by an executor in this
process or another) predicts the outcomes (k accepted, bonus token), drafts the next speculation for each into a
cache keyed (sequence, k, bonus), serves hits at once and falls back on a miss (``jit``: the drafter drafts now;
``fast``: n-gram / random tokens; ``auto``: the cheaper per token under the measured T_verify, T_draft, hit rate and
batch size, §7). The target verifies ONE chain per sequence per round with tokenwise speculative sampling
against the proposal each token was really drawn from: SAGUARO's ``q'`` rebuilt from the cached raw logits, a point
mass for n-gram tokens, uniform for random tokens (the reference's greedy check of fast tokens is lossy at T > 0;
``fast_verify="reference_greedy"`` reproduces it for the regression test only).

Fork vocabulary: with a vocabulary-limited drafter (``draft_vocab``), ``fork_vocab="full"`` (the default) takes the
fork guesses from the drafter's whole lm_head at the K+1 glue positions, so a bonus token outside the limited
range can still hit the cache; ``"draft"`` forks on the limited head (such a bonus always misses). Fan-out
``"uniform"`` splits the budget evenly over the K+1 acceptance lengths (the reference code's shape: K = 7,
F = 3 each, B = 24); ``"geometric"`` is §5's closed form; an explicit vector gives the K+1 counts.

Round bookkeeping (per row): the target cache holds the committed tokens; the last emitted token (the bonus) is
pending. The verify forward is ``[bonus, s_1..s_K]``; the row keeps ``1 + k`` of those K+1 slots.

A request alone runs on the engine loop (``inference.engine.loop``) as :class:`SSDRow`, one row at a time.
``generate_batch`` runs its prompts as one lockstep batch of its own (the same rounds: serve, verify beside
speculate, advance), because the draft side prefills, serves and speculates for one fixed batch of rows, all
admitted together, and draws each round's verification for every row at once from one generator; the engine
admits a request whenever a row frees and gives each its own generator.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from core.errors import UserError
from inference.algorithms.base import Algorithm, GenerationResult, GenerationStats, OutputBuffer, _synchronize
from inference.algorithms.options import SSDOptions, with_fields
from inference.algorithms.overlapped import OneRowStrategy
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, T
from inference.executors import EXECUTORS, Executor, make_executor
from inference.runner_contract import check_same_vocab
from inference.saguaro import check_c, proposal_probs
from inference.sampling import SamplingParams, random_device, sample
from inference.ssd_cache import NO_KEY, AcceptanceEMA, geometric_fanout, largest_remainder_round, parse_fanout
from inference.ssd_draft import (
    FALLBACKS,
    FAST,
    FAST_KINDS,
    FORK_VOCABS,
    HIT,
    IDLE,
    JIT,
    ServeRequest,
    SpeculateRequest,
    Speculation,
    given_runner,
    draft_side_factory,
)
from inference.verify import LossyVerifierWarning, VerifyPlan, VerifyResult, tokenwise_plan
from inference.runner_loading import limited_draft

FAST_VERIFY = ("exact", "reference_greedy")


class _Ema:
    """Exponential moving average that starts at its first sample (None before any)."""

    def __init__(self, decay: float = 0.2, prior: float | None = None):
        self.decay, self.value = decay, prior
        self.seen = False

    def update(self, x: float) -> None:
        self.value = x if not self.seen or self.value is None else self.value + self.decay * (x - self.value)
        self.seen = True


def fanout_vector(spec: str | Sequence[int], k_max: int, budget: int) -> list[int] | None:
    """The fixed fan-out an ``ssd_fanout`` value names: ``"uniform"`` (the budget split evenly over the K+1
    acceptance lengths, the remainder to the shortest), an explicit K+1 vector, or None for ``"geometric"``."""
    if spec == "uniform":
        if budget < 1:
            raise UserError(f"uniform fan-out needs budget >= 1, got {budget}")
        return largest_remainder_round([budget / (k_max + 1)] * (k_max + 1), budget)
    return parse_fanout(spec, k_max)


class SSDMetrics:
    """SSD counters beyond GenerationStats: cache hit rate by k, bonus hit rate, fallbacks, drafter idle time.
    ``fanout_at_lookup_by_k[k]`` counts the fan-out F_k the looked-up cache was built with, per value (what a
    teacher-forced recall must be read at); "outside draft vocab" counts lookups whose bonus id is beyond the
    drafter's vocabulary limit (``draft_vocab``)."""

    def __init__(self, k_max: int):
        self.lookups_by_k = [0] * (k_max + 1)
        self.hits_by_k = [0] * (k_max + 1)
        self.fanout_at_lookup_by_k: list[dict[int, int]] = [{} for _ in range(k_max + 1)]
        self.lookups_outside_vocab = 0
        self.hits_outside_vocab = 0
        self.guessable = 0  # lookups whose k had at least one cached branch
        self.fallbacks = {"jit": 0, "fast": 0}
        self.first_round_misses = 0
        self.fast_rounds_auto = 0
        self.jit_rounds_auto = 0
        self.new_tokens = 0
        self.wall_s = 0.0
        self.simulated_s = 0.0
        self.drafter_idle_s = 0.0
        self.target_s = 0.0
        self.draft_s = 0.0

    def as_dict(self) -> dict[str, Any]:
        lookups, hits = sum(self.lookups_by_k), sum(self.hits_by_k)
        return {
            "cache_hit_rate": round(hits / lookups, 4) if lookups else None,
            "cache_hit_rate_by_k": [round(h / n, 4) if n else None for h, n in zip(self.hits_by_k, self.lookups_by_k)],
            "cache_lookups_by_k": list(self.lookups_by_k),
            "cache_lookup_fanout_by_k": [dict(sorted(h.items())) for h in self.fanout_at_lookup_by_k],
            "cache_lookups_outside_draft_vocab": self.lookups_outside_vocab,
            "cache_hits_outside_draft_vocab": self.hits_outside_vocab,
            "bonus_hit_rate": round(hits / self.guessable, 4) if self.guessable else None,
            "fallback_counts": dict(self.fallbacks),
            "first_round_misses": self.first_round_misses,
            "auto_choices": {"jit": self.jit_rounds_auto, "fast": self.fast_rounds_auto},
            "drafter_idle_s": round(self.drafter_idle_s, 4),
            "target_s": round(self.target_s, 4),
            "draft_s": round(self.draft_s, 4),
            "simulated_overlap_s": round(self.simulated_s, 4),
            "simulated_tokens_per_s": round(self.new_tokens / self.simulated_s, 3) if self.simulated_s else None,
        }


class SSD(Algorithm):
    name = "ssd"
    drafter = "draft_lm"

    context = ("draft_path", "seed", "threads")

    def __init__(
        self,
        target,
        draft=None,
        options: SSDOptions | None = None,
        *,
        ema: float = 0.2,
        executor_kwargs: dict | None = None,
        draft_source: Any = None,
        draft_path: str | None = None,
        seed: int = 0,
        threads: int = 0,
        fast_verify: str = "exact",
        max_seq_len: int | None = None,
        max_batch_size: int | None = None,
        **fields: Any,
    ):
        """``draft`` is an in-process drafter runner; ``draft_source`` (a draft LM path or a picklable callable
        building one; default ``draft_path``) is needed instead for ``executor=multiprocess``, where the drafter
        lives in another process, with ``threads`` CPU threads (0: torch's default) unless ``executor_kwargs`` says
        otherwise. ``seed`` seeds the fast fallback's random tokens. ``options.fanout`` / ``fanout_miss`` may also
        be sequences of K+1 ints."""
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = options = with_fields(SSDOptions, options, fields)
        gamma, budget, fanout, fanout_miss, fanout_r = (
            options.gamma,
            options.budget,
            options.fanout,
            options.fanout_miss,
            options.fanout_r,
        )
        fallback, fast, saguaro_c, executor, fork_vocab = (
            options.fallback,
            options.fast,
            options.saguaro_c,
            options.executor,
            options.fork_vocab,
        )
        if executor == "multiprocess":
            draft_source = draft_source if draft_source is not None else draft_path
            executor_kwargs = {"threads": threads or None} if executor_kwargs is None else executor_kwargs
        if gamma < 1:
            raise UserError(f"gamma (lookahead K) must be >= 1, got {gamma}")
        if fallback not in ("jit", "fast", "auto"):
            raise UserError(f"ssd fallback must be jit, fast or auto, got {fallback!r}")
        if fast not in FAST_KINDS:
            raise UserError(f"ssd fast fallback must be one of {', '.join(FAST_KINDS)}, got {fast!r}")
        if executor not in EXECUTORS:
            raise UserError(f"unknown executor '{executor}'; choose one of {', '.join(EXECUTORS)}")
        if fork_vocab not in FORK_VOCABS:
            raise UserError(f"ssd fork_vocab must be one of {', '.join(FORK_VOCABS)}, got {fork_vocab!r}")
        if fast_verify not in FAST_VERIFY:
            raise UserError(f"fast_verify must be one of {', '.join(FAST_VERIFY)}, got {fast_verify!r}")
        if fast_verify == "reference_greedy":
            warnings.warn(
                "ssd fast_verify='reference_greedy' is the SSD reference's greedy check of fast-fallback "
                "tokens: lossy at temperature > 0, for regression tests only",
                LossyVerifierWarning,
                stacklevel=2,
            )
        check_c(saguaro_c)
        if draft is None and draft_source is None:
            raise UserError("ssd needs a drafter: pass a draft runner or draft_source=PATH")
        if draft is not None:
            draft = limited_draft(draft, options.draft_vocab)
            check_same_vocab(target, draft)
            self.max_seq_len = min(self.max_seq_len, draft.max_seq_len)
        if executor == "multiprocess" and draft_source is None:
            raise UserError(
                "executor=multiprocess builds the drafter in another process: pass draft_source (a draft "
                "LM path, e.g. drafter=PATH) or use executor=sequential / cuda_streams"
            )
        self.k = gamma
        self.budget = budget
        self.vocab = target.config.vocab_size
        self.fan_hit = fanout_vector(fanout, gamma, budget)
        self.fan_miss = None if fanout_miss == "auto" else fanout_vector(fanout_miss, gamma, budget)
        for fan in (self.fan_hit, self.fan_miss):
            if fan is not None and sum(fan) != budget:
                raise UserError(
                    f"explicit fan-out {fan} sums to {sum(fan)} but budget={budget}: both hit and miss "
                    "vectors must sum to the budget (static shapes)"
                )
        self.fanout_r, self.fallback, self.fast, self.c = fanout_r, fallback, fast, saguaro_c
        self.fast_verify = fast_verify
        self.fork_vocab = fork_vocab
        self.logit_vocab = getattr(draft, "logit_vocab", None)  # the drafter's vocabulary limit (None: every id)
        self.executor_name, self.executor_kwargs = executor, dict(executor_kwargs or {})
        self.draft, self.draft_source, self.seed = draft, draft_source, seed
        self.draft_max_batch = max_batch_size or getattr(draft, "max_batch_size", 1)
        self._executor: Executor | None = None
        self.ema_hit = AcceptanceEMA(decay=ema)
        self.ema_fast = AcceptanceEMA(decay=ema, prior=0.05)
        self.hit_rate = _Ema(ema, prior=0.5)
        self.t_verify, self.t_jit, self.t_fast = _Ema(ema), _Ema(ema), _Ema(ema, prior=0.0)
        self.e_fast = _Ema(ema, prior=1.0)
        self.metrics = SSDMetrics(gamma)

    def lookahead(self) -> int:
        return self.k + 1 + self.k * self.budget  # the drafter's glue + tree slots (the target needs K+1)

    # -- executor -----------------------------------------------------------------------------------------------

    def executor(self) -> Executor:
        """The executor around the draft side, built on first use and kept (close() releases it)."""
        if self._executor is None or self._executor.broken:  # first use, or its draft process died or hung
            source = self.draft_source
            if source is None:
                source = functools.partial(given_runner, self.draft)
            device = str(getattr(self.draft, "device", self.target.device))
            factory = draft_side_factory(
                source,
                lookahead=self.k,
                budget=self.budget,
                seed=self.seed,
                device=device,
                max_batch_size=self.draft_max_batch,
                max_seq_len=self.max_seq_len,
                logit_vocab=self.logit_vocab,
                fork_vocab=self.fork_vocab,
            )
            # backend / threads only mean something for the draft process
            kwargs = self.executor_kwargs if self.executor_name == "multiprocess" else {}
            self._executor = make_executor(self.executor_name, factory, **kwargs)
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def extra_metrics(self) -> dict[str, Any]:
        """SSD metrics accumulated since the last call (then reset)."""
        metrics, self.metrics = self.metrics.as_dict(), SSDMetrics(self.k)
        metrics["fanout_hit"] = self._fanouts()[0]
        metrics["ssd_lookahead"], metrics["ssd_budget"] = self.k, self.budget
        metrics["fork_vocab"], metrics["draft_vocab"] = self.fork_vocab, self.logit_vocab or 0
        metrics["acceptance_ema"] = round(self.ema_hit.value, 4)
        return metrics

    # -- generation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        eos_ids: Sequence[int] = (),
    ) -> list[GenerationResult]:
        """Generate for several prompts of any lengths at once (one verify forward per round for the batch).
        Each result's ``wall_s`` is the batch wall time split evenly, so summed stats give the batch's tokens/s."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("generate_batch needs at least one prompt and no empty prompt")
        for p in prompts:
            self.check_fits(len(p), max_new_tokens)
        outs = [OutputBuffer(max_new_tokens, eos_ids) for _ in prompts]
        stats = [GenerationStats() for _ in prompts]
        start = time.perf_counter()
        self._run([list(p) for p in prompts], outs, stats, sampling, generator)
        _synchronize(self.target)
        wall = time.perf_counter() - start
        for out, s in zip(outs, stats):
            s.wall_s, s.new_tokens = wall / len(prompts), len(out.tokens)
        return [GenerationResult(out.tokens, s) for out, s in zip(outs, stats)]

    def strategy(self) -> SSDRow:
        return SSDRow(self)

    def _run(
        self,
        prompts: list[list[int]],
        outs: list[OutputBuffer],
        stats: list[GenerationStats],
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        """``prompts`` as one lockstep batch (generate_batch): one serve, one verify forward and one speculate call
        a round for every row, until each has ended; the rounds are those of :class:`SSDRow`."""
        target, executor, k_max, b = self.target, self.executor(), self.k, len(prompts)
        if b > target.max_batch_size:
            raise UserError(
                f"batch of {b} prompts but the target runner holds {target.max_batch_size} rows; build "
                "it with max_batch_size >= the batch size"
            )
        ex0 = executor.stats.as_dict()
        start = time.perf_counter()
        lengths = torch.tensor([len(p) for p in prompts])
        first = self._prefill(prompts, lengths, sampling, generator)
        executor.call("prefill", prompts)
        for row in range(b):
            outs[row].extend([int(first[row])])
            stats[row].target_forwards += 1
            stats[row].draft_forwards += 1
        keys = torch.stack([torch.full((b,), NO_KEY), first.cpu()], 1)
        self.metrics.first_round_misses += b
        while True:
            active = torch.tensor([not out.done for out in outs])
            if not bool(active.any()):
                break
            spec, fanout, fan_hit = self._serve(executor, keys, lengths, active, sampling)
            outcome, draft_forwards = self._overlap_round(
                executor,
                functools.partial(self._verify, keys[:, 1], spec, active, lengths.clone(), sampling, generator),
                fanout,
                fan_hit,
                sampling,
            )
            for row, (accepted, emitted) in outcome.items():
                stats[row].record_round(k_max, accepted)
                stats[row].target_forwards += 1
                stats[row].draft_forwards += draft_forwards + spec.draft_forwards
                outs[row].extend(emitted)
            keys = self._advance(outcome, spec, keys, lengths)
        self._note_run(executor, ex0, start, sum(len(o.tokens) for o in outs))

    def _prefill(
        self,
        prompts: list[list[int]],
        lengths: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Ragged prefill: right-pad, one forward, roll each row back to its prompt; first token per row."""
        target, b = self.target, len(prompts)
        target.reset(b)
        width = int(lengths.max())
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=target.device)
        logits = target.forward(ids).logits  # [b, width, V]
        target.truncate(lengths.to(target.device))
        last = logits[torch.arange(b, device=logits.device), lengths.to(logits.device) - 1]
        return sample(sampling.warp(last), generator)

    def _verify(
        self,
        bonus: torch.Tensor,
        spec: Speculation,
        active: torch.Tensor,
        lengths: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> dict[int, tuple[int, list[int]]]:
        """The lockstep batch's target job: one forward over [bonus, s_1..s_K] per row, each active row judged
        (:meth:`_judge`), the cache rolled back to what each kept."""
        target = self.target
        block = torch.cat([bonus[:, None], spec.tokens.cpu()], 1).to(target.device)
        p = sampling.warp(target.forward(block).logits)  # [b, K+1, V]
        outcome = self._judge(spec, p, active.nonzero().view(-1).tolist(), sampling, generator)
        kept = lengths.clone()
        for row, (accepted, _) in outcome.items():
            kept[row] += 1 + accepted
        target.truncate(kept.to(target.device))
        return outcome

    # -- one round, shared by the lockstep batch and the engine strategy ----------------------------------------

    def _serve(
        self,
        executor: Executor,
        keys: torch.Tensor,
        lengths: torch.Tensor,
        active: torch.Tensor,
        sampling: SamplingParams,
    ) -> tuple[Speculation, torch.Tensor, list[int]]:
        """This round's speculation for every row (a cache hit, or the fallback's), the fan-out its next
        speculation forks with, and the hit fan-out."""
        k_max, b = self.k, keys.shape[0]
        fallback = self._choose_fallback(int(active.sum()))
        fan_hit, fan_jit, fan_fast = self._fanouts()
        request = ServeRequest(
            keys,
            lengths,
            active,
            torch.tensor([[f + 1 for f in fan_jit[:k_max]]] * b),
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            self.c,
            FALLBACKS[fallback],
            FAST_KINDS[self.fast],
        )
        served_at = time.perf_counter()
        spec = Speculation.unpack(*executor.call("serve", request.pack()))
        self._record_lookup(keys, spec.source, active, fallback, time.perf_counter() - served_at)
        by_source = {HIT: fan_hit, JIT: fan_jit, FAST: fan_fast, IDLE: [0] * (k_max + 1)}
        return spec, torch.tensor([by_source[s] for s in spec.source.tolist()]), fan_hit

    def _overlap_round(
        self,
        executor: Executor,
        target_job: Callable[[], Any],
        fanout: torch.Tensor,
        fan_hit: list[int],
        sampling: SamplingParams,
    ) -> tuple[Any, int]:
        """``target_job()`` (the verification) while the draft side speculates the next round for every outcome;
        (its result, the draft forwards speculating took). Its time feeds the fallback policy's T_verify."""
        timed: dict[str, float] = {}

        def verification() -> Any:
            start = time.perf_counter()
            result = target_job()
            _synchronize(self.target)
            timed["verify_s"] = time.perf_counter() - start
            return result

        spec_request = SpeculateRequest(
            fanout,
            torch.tensor([[f + 1 for f in fan_hit[: self.k]]] * fanout.shape[0]),
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            self.c,
        )
        result, draft_forwards = executor.overlap(verification, "speculate", spec_request.pack())
        self.t_verify.update(timed["verify_s"])
        self._last_fanout = fanout
        return result, draft_forwards

    def _judge(
        self,
        spec: Speculation,
        p: torch.Tensor,
        rows: list[int],
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> dict[int, tuple[int, list[int]]]:
        """Tokenwise verification of each row of ``rows`` against the proposal its tokens were drawn from; ``p``
        [b, K+1, V]: the warped target rows of the speculation's rows. Returns {row: (accepted, emitted tokens)}."""
        device = p.device
        q = proposal_probs(
            spec.tokens.to(device),
            spec.logits.to(device),
            spec.kinds.to(device),
            spec.tops.to(device),
            self.c,
            sampling,
        )
        outcome: dict[int, tuple[int, list[int]]] = {}
        if self.fast_verify == "reference_greedy":  # the lossy rule, for the regression test only
            for row in [r for r in rows if int(spec.source[r]) == FAST]:
                outcome[row] = _reference_greedy(spec.tokens[row].to(device), p[row], generator)
            rows = [r for r in rows if r not in outcome]
        if rows:
            index = torch.tensor(rows, device=device)
            tokens = spec.tokens.to(device)[index]
            taus, bonus_tokens = _draw_rows(tokenwise_plan(tokens, q[index], p[index]), generator)
            for i, row in enumerate(rows):
                tau = int(taus[i])
                outcome[row] = (tau, tokens[i, :tau].tolist() + [int(bonus_tokens[i])])
        return outcome

    def _advance(
        self, outcome: dict[int, tuple[int, list[int]]], spec: Speculation, keys: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """After a round: the acceptance statistics, each row's committed length (``lengths``, in place) and the
        next round's cache keys (k accepted, bonus token)."""
        next_keys = keys.clone()
        for row, (accepted, emitted) in outcome.items():
            source = int(spec.source[row])
            (self.ema_fast if source == FAST else self.ema_hit).update(accepted, self.k)
            if source == FAST:
                self.e_fast.update(accepted + 1)
            lengths[row] += 1 + accepted
            next_keys[row] = torch.tensor([accepted, emitted[-1]])
        return next_keys

    def _note_run(self, executor: Executor, ex0: dict[str, float], start: float, new_tokens: int) -> None:
        """A generation's (or a batch's) time split into the metrics: wall, simulated overlap, drafter idle."""
        ex1 = executor.stats.as_dict()
        wall = time.perf_counter() - start
        m = self.metrics
        m.new_tokens += new_tokens
        exec_wall = ex1["wall_s"] - ex0["wall_s"]
        m.simulated_s += wall - exec_wall + (ex1["simulated_s"] - ex0["simulated_s"])
        m.wall_s += wall
        m.target_s += ex1["target_s"] - ex0["target_s"]
        m.draft_s += ex1["draft_s"] - ex0["draft_s"]
        m.drafter_idle_s += (ex1["simulated_s"] - ex0["simulated_s"]) - (ex1["draft_s"] - ex0["draft_s"])

    # -- policy -------------------------------------------------------------------------------------------------

    def _fanouts(self) -> tuple[list[int], list[int], list[int]]:
        """(hit, JIT-miss, fast-miss) fan-out vectors, each summing to the budget."""
        f_max = self.vocab - 1
        hit = self.fan_hit or geometric_fanout(self.budget, self.k, self.ema_hit.value, self.fanout_r, f_max)
        if self.fan_miss is not None:
            return hit, self.fan_miss, self.fan_miss
        # JIT misses draft like hits (same statistics); fast misses mostly stop at k = 0.
        fast = geometric_fanout(self.budget, self.k, self.ema_fast.value, self.fanout_r, f_max)
        return hit, hit, fast

    def _choose_fallback(self, batch: int) -> str:
        """Batch-aware choice (§7): the fallback with the lower expected time per emitted token."""
        if self.fallback != "auto":
            return self.fallback
        if self.t_jit.value is None or self.t_verify.value is None:
            choice = "jit"  # measure the neural fallback first
        else:
            p = min(max(self.hit_rate.value, 0.0), 1.0)
            a = min(self.ema_hit.value, 0.99)
            e_hit = (1 - a ** (self.k + 1)) / (1 - a)
            delay = 1 - p**batch
            per_token_jit = (self.t_verify.value + delay * self.t_jit.value) / e_hit
            per_token_fast = (self.t_verify.value + delay * self.t_fast.value) / (
                p * e_hit + (1 - p) * self.e_fast.value
            )
            choice = "fast" if per_token_fast < per_token_jit else "jit"
        if choice == "fast":
            self.metrics.fast_rounds_auto += 1
        else:
            self.metrics.jit_rounds_auto += 1
        return choice

    def _record_lookup(
        self, keys: torch.Tensor, source: torch.Tensor, active: torch.Tensor, fallback: str, serve_s: float
    ) -> None:
        m = self.metrics
        last = getattr(self, "_last_fanout", None)
        hits = 0
        lookups = 0
        for row, (k, bonus) in enumerate(keys.tolist()):
            if not bool(active[row]) or k == NO_KEY:
                continue
            hit = int(source[row]) == HIT
            lookups += 1
            hits += hit
            m.lookups_by_k[k] += 1
            m.hits_by_k[k] += hit
            if self.logit_vocab is not None and bonus >= self.logit_vocab:
                m.lookups_outside_vocab += 1
                m.hits_outside_vocab += hit
            if last is not None and row < last.shape[0]:
                fan = int(last[row, k])
                m.fanout_at_lookup_by_k[k][fan] = m.fanout_at_lookup_by_k[k].get(fan, 0) + 1
                m.guessable += fan > 0
        if lookups:
            self.hit_rate.update(hits / lookups)
        misses = int(((source == JIT) | (source == FAST)).sum())
        if misses:
            m.fallbacks[fallback] += misses
            (self.t_jit if fallback == "jit" else self.t_fast).update(serve_s)


def _draw_rows(plan: VerifyPlan, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (accepted count τ, emitted token) for every row of a batched forward-scan (tokenwise) plan: one
    uniform per level and row (none when every decision is certain, e.g. greedy), then one residual draw per row.
    The same scan as ``VerifyPlan.draw``, vectorised over rows."""
    stops = plan.stop_probs  # [n, K+1], last level always 1
    if bool(((stops > 0) & (stops < 1)).any()):
        stopped = (
            torch.rand(
                stops.shape, generator=generator, dtype=stops.dtype, device=random_device(generator, stops.device)
            ).to(stops.device)
            < stops
        )
    else:
        stopped = stops == 1
    tau = stopped.to(torch.uint8).argmax(dim=-1)
    rows = torch.arange(tau.shape[0], device=tau.device)
    return tau, sample(plan.residuals[rows, tau], generator)


def _reference_greedy(
    tokens: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, list[int]]:
    """The SSD reference's check of fast-fallback tokens: accept iff the token is the target argmax, bonus from p.
    LOSSY at T > 0 (kept only so a test can show it failing)."""
    for j, token in enumerate(tokens.tolist()):
        if token != int(p[j].argmax()):
            return j, tokens[:j].tolist() + [int(sample(p[j], generator))]
    return len(tokens), tokens.tolist() + [int(sample(p[-1], generator))]


class SSDRow(OneRowStrategy):
    """SSD as a strategy of the engine loop, one row at a time: ``propose`` serves the row's speculation (cache hit
    or fallback), ``beside`` runs the engine's target forward and the row's verification while the draft side
    speculates the next round, ``accepted`` moves the row's cache key on. Several prompts at once run as
    ``SSD.generate_batch``'s lockstep batch instead (its draft side prefills and serves every row together)."""

    name = "ssd"
    one_row_because = "its draft side holds one lockstep batch"
    other_ways = ", or use SSD.generate_batch"

    def open_executor(self) -> Executor:
        executor = self.algorithm.executor()
        self.started = (executor.stats.as_dict(), time.perf_counter())
        return executor

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        (state,) = states
        self.executor.call("prefill", [list(state.request.prompt)])
        state.stats.draft_forwards += 1
        self.keys = torch.tensor([[NO_KEY, state.pending[0]]], dtype=torch.long)
        self.lengths = torch.tensor([len(state.request.prompt)])
        self.algorithm.metrics.first_round_misses += 1

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        (state,) = states
        self.spec, self.fanout, self.fan_hit = self.algorithm._serve(
            self.executor, self.keys, self.lengths, torch.tensor([True]), state.sampling
        )
        return [Proposal(self.spec.tokens[0].tolist())]

    def beside(self, states: Sequence[RowState], forward: Callable[[], T], *, prefill: bool = False) -> T:
        if prefill:
            return forward()
        (state,) = states

        def verification() -> T:
            scored = forward()
            p = state.sampling.warp(scored.logits[state.row])[None]  # [1, K+1, V]
            self.outcome = self.algorithm._judge(self.spec, p, [0], state.sampling, state.generator)
            return scored

        scored, self.draft_forwards = self.algorithm._overlap_round(
            self.executor, verification, self.fanout, self.fan_hit, state.sampling
        )
        return scored

    def verify(self, state: RowState, proposal: Proposal, logits: torch.Tensor) -> VerifyResult:
        accepted, emitted = self.outcome[0]  # judged beside the speculation, in ``beside``
        return VerifyResult(accepted, torch.tensor(emitted, dtype=torch.long))

    def count_round(self, state: RowState, proposal: Proposal, result: VerifyResult) -> None:
        super().count_round(state, proposal, result)
        state.stats.draft_forwards += self.draft_forwards + self.spec.draft_forwards

    def accepted(
        self, states: Sequence[RowState], proposals: Sequence[Proposal], results: Sequence[VerifyResult | None]
    ) -> None:
        if results[0] is not None:
            self.keys = self.algorithm._advance(self.outcome, self.spec, self.keys, self.lengths)

    def release(self, state: RowState) -> None:
        if state.out.done:
            self.algorithm._note_run(self.executor, *self.started, len(state.out.tokens))
