"""The online bandit adapter: per query, signal -> context -> cost-aware arm -> bounded update, with rollback.

Order of work at the end of query k (after its last verification, before the next query starts):

1. feedback for the decision taken after query k−1: realised Δτ = τ_k − baseline, the baseline being the EMA of
   τ under ``skip`` in that decision's context (τ_{k−1} until that EMA exists); reward = saving(Δτ) − cost paid;
2. safety: after an update, if τ stays below the pre-update EMA of τ for ``patience`` consecutive queries within
   ``watch`` queries, the snapshot taken before the update is restored (rollback; ``rollback_to=origin``
   restores the drafter as it was before its first update instead);
3. context = running-quantile bucket of the signal S_k; at most one update per ``min_gap`` queries (rate bound);
   otherwise the UCB choice of :mod:`spectrain.adapt.bandit` with costs from the measured :class:`CostModel`;
4. a non-skip arm: snapshot, then at most ``{arm}_steps`` clipped AdamW steps on query k's record (with
   ``buffer`` > 1: the mean loss over the last ``buffer`` queries' records; §7 uses one query);
5. validation (``validate``, on by default; our addition to §7): the update is kept only if it lowers the
   training loss (``validate_on=tau``: raises the simulated accept length) on the most recent query it did NOT
   train on; otherwise the snapshot is restored at once. An
   update that fits one query at the expense of the rest is caught before it serves a single token, instead of
   after ``patience`` slow queries (the τ watch of step 2 stays as the second line). With no such query yet
   (the first ``buffer`` queries), nothing is updated. Each undone update doubles the rate bound's gap (up to
   ``2**backoff`` × ``min_gap``; a kept update resets it): updates that keep failing stop costing time;
6. origin check (``origin_check`` = N > 0; our addition): every N queries while the drafter serves adapted
   weights, the latest query (which no update has trained on) is scored under the adapted weights and under the
   drafter as it was before its first update, with the validation metric; if the original does better, it is
   restored (``reset``). Validation and the τ watch judge an update right after it; this catches the later case
   where the stream moved on to a domain the adapted weights serve worse than the original (measured: a drafter
   adapted on HumanEval served GSM-symbolic 2 % below the original, BENCHMARKS.md). It runs before step 3.

With ``background`` (our addition), all of this runs on a worker thread while query k+1 is served, and its weight
changes serve from query k+2 on; feedback and the rollback watch account for that lag
(:mod:`spectrain.adapt.background`).

Queries served side by side (the engine's ``batch_size`` > 1) end in any order, and a query that ends after a
decision may have started before it. Each query is stamped at ``begin_query`` with the decisions whose weights
serve it from its start (``published``), so "the first query after a decision" is the first query to end that
STARTED after the decision served: that query gives the decision its feedback (every decision it is the first
after, when several are), and only such queries count in the rollback watch. Served one at a time, that is the
next query (the one after with ``background``), as before. Each round's cost is the query's share of its engine
step (``inference.round_observers``), so ``iter_ratio`` means the same whatever the batch.

The same :meth:`BanditAdapter.process` runs online (τ and S measured by the engine) and in replay (τ and S
simulated from recorded traces), so the CI replay test exercises the production policy.

Defaults: docs/algorithms/specblock.md §7 (one query an update, rollback to the last snapshot). Learning rates: the better of
(head, full) ∈ {(3e-3, 1e-3), (1e-3, 3e-4)} in replays (γ = 4, last 128 rows) of two recorded
16-query smollm2 streams (HumanEval→GSM and held-out ShareGPT, EAGLE-3 trained on ShareGPT): mean τ_sim
+3.3 % / −0.4 % vs no adaptation, where (3e-3, 1e-3) gave +0.1 % / −3.9 %. The same replays favoured
``buffer=4`` (+3.8 % / +2.3 %, at ~4x the update cost) and ``buffer=4 rollback_to=origin`` (+6.9 % / +1.8 %);
they are options, not defaults, until measured end to end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import UserError
from spectrain.adapt.background import BackgroundRunner, Publisher
from spectrain.adapt.bandit import UPDATE_ARMS, CostAwareUCB, Decision
from spectrain.adapt.cost import DEFAULT_COST_CACHE, CostModel, saving
from spectrain.adapt.drafters import AdaptableDrafter
from spectrain.adapt.log import DecisionLog
from spectrain.adapt.record import QueryRecord, QueryRecorder, write_manifest, write_record
from spectrain.adapt.signal import ContextBuckets, query_signal
from spectrain.adapt.updater import ArmUpdate, Snapshot, Updater


@dataclass
class AdaptSettings:
    """Every constant of the adapter, declared here only: the engine passes ``adapt.NAME=VALUE`` through
    (:meth:`from_given`)."""

    arms: str = "head,full"  # update arms the bandit may play (skip is always available)
    horizon: int = 1024  # H: tokens an update is expected to serve
    prior: float = 0.3  # Δτ estimate of an arm never tried yet (optimism); a new context borrows pooled stats
    ucb_c: float = 0.5  # exploration weight, in Δτ units
    bins: int = 4  # signal buckets (contexts)
    ema: float = 0.3  # weight of the newest τ in the EMAs
    head_steps: int = 4
    head_lr: float = 1e-3  # lrs chosen by replay of recorded smollm2 streams (module docstring)
    full_steps: int = 2
    full_lr: float = 3e-4
    lora_rank: int = 8  # the lora arm: peft LoRA adapters on the decoder linears (added at start-up if in arms)
    lora_steps: int = 2
    lora_lr: float = 1e-3
    clip: float = 1.0  # gradient-norm bound per step
    min_gap: int = 4  # at most one update per min_gap queries (2 measured worse on a 48-query shift: BENCHMARKS)
    patience: int = 2  # roll back after this many consecutive queries below the pre-update EMA
    watch: int = 4  # queries after an update during which a rollback can trigger
    rollback_to: str = "last"  # last: the snapshot before the update (§7) | origin: the drafter as served first
    max_rows: int = 384  # bounded update size: the last rows of a query
    buffer: int = 1  # queries an update trains on (the latest ones); 1 = this query only (§7)
    validate: bool = True  # keep an update only if it helps on the latest query it did not train on
    validate_on: str = "loss"  # loss: its training loss drops | tau: its simulated accept length (τ_sim) rises
    backoff: int = 4  # max doublings of min_gap after consecutive undone updates (0 = none)
    origin_check: int = 4  # every N queries on adapted weights: back to the original if it scores better (0 = off)
    background: bool = False  # run the work after a query on a worker thread while the next one is served
    #   (spectrain.adapt.background): its result serves one query later, the update time leaves the serving path
    ttt_steps: int = 3  # training-time-test steps of the EAGLE-3 update loss
    teacher_temperature: float = 1.0  # the update's teacher: target logits at this temperature (0: greedy token)
    step_weight: float = 0.8
    signal_floor: float = 1e-6
    cost_rows: int = 256  # rows of the synthetic record the start-up measurement times
    cost_cache: str | None = DEFAULT_COST_CACHE  # $SPECTRAIN_CACHE/adapt_costs.json; a file; None: always measure
    log: str | None = None  # adapt.log=DIR: decisions.csv + per-query trace records for replay
    wandb: str | None = None  # wandb project for the decision log (None: CSV only)

    @classmethod
    def from_given(cls, given: dict[str, str]) -> AdaptSettings:
        """The settings ``adapt.NAME=VALUE`` gives (NAME -> the value as written; the rest keep their defaults),
        refusing (one line) an unknown NAME, a bad value, and an arm's setting (``lora_rank``, ``head_lr``, ...)
        whose arm ``arms`` leaves out: it would do nothing."""
        names = [f.name for f in fields(cls)]
        for name in given:
            if name not in names:
                raise UserError(f"adapt.{name} is not a setting of adapt=bandit; its settings: {', '.join(names)}")
        settings = cls.with_overrides(cls(), given)
        for name in given:
            arm = name.split("_", 1)[0]
            if arm in UPDATE_ARMS and arm not in settings.arm_list():
                example = " (e.g. adapt.arms=head,full,lora)" if arm == "lora" else ""
                raise UserError(
                    f"adapt.{name} does nothing with adapt.arms={settings.arms}; set adapt.arms with "
                    f"{arm} in it{example} or drop adapt.{name}"
                )
        return settings

    @classmethod
    def with_overrides(cls, base: AdaptSettings | dict[str, Any], overrides: dict[str, str]) -> AdaptSettings:
        """``base`` (settings, or a dict of field values: unknown keys ignored) with ``overrides`` (field name ->
        command-line string) parsed and type-checked by OmegaConf (``validate=false`` is False, ``log=null`` None)."""
        if isinstance(base, dict):
            base = cls(**{f.name: base[f.name] for f in fields(cls) if f.name in base})
        try:
            merged = OmegaConf.merge(
                OmegaConf.structured(base), OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])
            )
        except OmegaConfBaseException as error:
            key = getattr(error, "full_key", None) or "*"
            raise UserError(f"bad setting adapt.{key}: {str(error).splitlines()[0]}") from None
        return OmegaConf.to_object(merged)

    def arm_list(self) -> list[str]:
        return [a.strip() for a in self.arms.split(",") if a.strip()]


@dataclass
class _Watch:
    snapshot: Snapshot
    pre_ema: float
    snapshot_adapted: bool  # whether the snapshot itself holds adapted weights (restoring it keeps them)
    decision: int  # the update's decision index: queries stamped after it are watched
    since: int = 0
    below: int = 0


@contextmanager
def torch_kernels(module: torch.nn.Module) -> Iterator[None]:
    """Torch's kernels inside the block for a drafter served row-exact (``set_row_exact``, batched rows on a CPU):
    some of its row-exact ops have no autograd, so training and scoring run without them, and they are back for
    serving after. A drafter served as is: nothing changes."""
    exact = getattr(module, "row_exact", False)
    if exact:
        module.set_row_exact(False)
    try:
        yield
    finally:
        if exact:
            module.set_row_exact(True)


class BanditAdapter:
    def __init__(
        self,
        adaptable: AdaptableDrafter,
        costs: CostModel,
        settings: AdaptSettings | None = None,
        *,
        write_traces: bool = True,
        manifest: dict[str, Any] | None = None,
        serving: torch.nn.Module | None = None,
    ):
        """``serving``: with ``background``, the drafter the engine serves from (``adaptable`` trains a private
        copy of it, published into it by :mod:`spectrain.adapt.background`). Replay passes none and publishes
        itself."""
        self.settings = settings = settings or AdaptSettings()
        if settings.min_gap < 1 or settings.patience < 1 or settings.watch < settings.patience:
            raise UserError(
                f"need adapt.min_gap >= 1 and adapt.watch >= adapt.patience >= 1, got "
                f"{settings.min_gap}, {settings.watch}, {settings.patience}"
            )
        if settings.rollback_to not in ("last", "origin"):
            raise UserError(f"adapt.rollback_to must be last or origin, got {settings.rollback_to}")
        if settings.origin_check < 0:
            raise UserError(
                f"adapt.origin_check must be >= 0 (queries between checks; 0 = off), got {settings.origin_check}"
            )
        if settings.backoff < 0:
            raise UserError(f"adapt.backoff must be >= 0 (doublings of min_gap), got {settings.backoff}")
        if settings.buffer < 1:
            raise UserError(f"adapt.buffer must be >= 1 (queries per update), got {settings.buffer}")
        if settings.validate_on not in ("loss", "tau"):
            raise UserError(f"adapt.validate_on must be loss or tau, got {settings.validate_on}")
        if not 0 < settings.ema <= 1 or settings.horizon < 1:
            raise UserError(f"need 0 < adapt.ema <= 1 and adapt.horizon >= 1, got {settings.ema}, {settings.horizon}")
        self.adaptable, self.costs = adaptable, costs
        self.bandit = CostAwareUCB(settings.arm_list(), ucb_c=settings.ucb_c, prior=settings.prior)
        self.updater = self.updater_for(adaptable, settings)
        self.buckets = ContextBuckets(settings.bins)
        self.log_dir = Path(settings.log) if settings.log else None
        self.write_traces = write_traces and self.log_dir is not None
        if self.write_traces:
            write_manifest(self.log_dir, {"costs": costs.to_dict(), "settings": asdict(settings), **(manifest or {})})
        self.log = DecisionLog(self.log_dir, wandb_project=settings.wandb)
        self.query = 0
        self.tau_ema: float | None = None
        self.skip_ema: dict[int, float] = {}
        # decisions awaiting feedback, oldest first: (decision index, context, arm, baseline τ, cost paid). The
        # first query stamped after a decision gives its feedback: served one at a time, the next query, or with
        # ``background`` the one after (lag).
        self.lag = 1 if settings.background else 0
        self.pending: deque[tuple[int, int, str, float, float]] = deque()
        self.published = 0  # decisions whose weights serve now (online: the stamp of a query that begins)
        self.watch: _Watch | None = None
        self.origin: Snapshot | None = None  # the drafter before its first update
        self.adapted = False  # the drafter serves weights an update changed (not the origin's)
        self.since_check = 0  # queries served on adapted weights since the last origin check
        self.since_update = settings.min_gap  # queries since the last update; the first query may update
        self.undone = 0  # consecutive updates undone by validation (backoff)
        # the queries under way, by the engine's query id: (their recorder, the decisions serving at their start)
        self.recorders: dict[Hashable, tuple[QueryRecorder, int]] = {}
        self.recent: deque[QueryRecord] = deque(maxlen=settings.buffer)
        self.held_out: QueryRecord | None = None  # the newest query not in ``recent`` (validation)
        self.background = None
        if settings.background and serving is not None:
            if serving is adaptable.module:
                raise ValueError("adapt.background needs a training copy of the drafter, not the serving one")
            publisher = Publisher(adaptable.module, serving, self.updater.parameters("full"))
            self.background = BackgroundRunner(publisher, next(serving.parameters()).device)

    @staticmethod
    def updater_for(adaptable: AdaptableDrafter, settings: AdaptSettings) -> Updater:
        return Updater(
            adaptable,
            {
                "head": ArmUpdate(settings.head_steps, settings.head_lr),
                "full": ArmUpdate(settings.full_steps, settings.full_lr),
                "lora": ArmUpdate(settings.lora_steps, settings.lora_lr),
            },
            clip=settings.clip,
        )

    # -- the policy (online and replay) ------------------------------------------------------------------------

    def process(
        self,
        record: QueryRecord,
        *,
        tau: float,
        signal: float,
        iter_ratio: float,
        stamp: int | None = None,
        request: Hashable = None,
    ) -> dict[str, Any]:
        """Everything that happens after one query; returns (and logs) its decision row. ``stamp``: the decisions
        that served the query from its start (None: queries served one at a time, as replay runs them);
        ``request``: its engine key, logged."""
        with torch_kernels(self.adaptable.module):
            return self._process(
                record,
                tau=tau,
                signal=signal,
                iter_ratio=iter_ratio,
                stamp=self.query - self.lag if stamp is None else stamp,
                request=request,
            )

    def _process(
        self, record: QueryRecord, *, tau: float, signal: float, iter_ratio: float, stamp: int, request: Hashable
    ) -> dict[str, Any]:
        s = self.settings
        row: dict[str, Any] = {
            "query": self.query,
            "request": "" if request is None else str(request),
            "rows": record.num_rows,
            "signal": signal,
            "tau": tau,
            "iter_ratio": iter_ratio,
            "rolled_back": False,
            "reset": False,
        }
        max_accept = record.max_accept
        if len(self.recent) == s.buffer:
            self.held_out = self.recent[0]  # about to leave the training window
        self.recent.append(record)
        rows = sum(min(r.num_rows, s.max_rows) for r in self.recent)  # what an update would train on
        while self.pending and self.pending[0][0] < stamp:  # 1. feedback for the decisions this query first shows
            _, context, arm, baseline, paid = self.pending.popleft()
            dtau = tau - baseline
            self.bandit.feedback(context, arm, dtau)
            if arm == "skip":
                old = self.skip_ema.get(context, tau)
                self.skip_ema[context] = (1 - s.ema) * old + s.ema * tau
            row.update(
                prev_arm=arm,
                realised_dtau=dtau,
                realised_reward=saving(dtau, baseline, iter_ratio, s.horizon, max_accept) - paid,
            )
        if self.watch is not None and stamp > self.watch.decision:  # 2. rollback watch: queries begun after it
            watch = self.watch
            watch.since += 1
            watch.below = watch.below + 1 if tau < watch.pre_ema else 0
            if watch.below >= s.patience:
                to_origin = s.rollback_to == "origin"
                self.updater.restore(self.origin if to_origin else watch.snapshot)
                self.adapted = False if to_origin else watch.snapshot_adapted
                row["rolled_back"] = True
                self.watch = None
            elif watch.since >= s.watch:
                self.watch = None  # the update stays
        self.tau_ema = tau if self.tau_ema is None else (1 - s.ema) * self.tau_ema + s.ema * tau
        row["tau_ema"] = self.tau_ema
        if self.adapted and self.watch is None:  # 6. origin check
            self.since_check += 1
            if s.origin_check and self.since_check >= s.origin_check:
                self.since_check = 0
                row.update(self._origin_check(record))

        context = self.buckets.observe(signal)  # 3. context and decision
        costs = {arm: self.costs.cost(arm, rows) for arm in self.bandit.arms}
        decision = self.bandit.decide(
            context, tau=tau, iter_ratio=iter_ratio, horizon=s.horizon, max_accept=max_accept, costs=costs
        )
        self.since_update += 1
        gap = s.min_gap * 2 ** min(self.undone, s.backoff)
        if decision.arm != "skip" and self.since_update < gap:
            decision = Decision("skip", decision.ucb, decision.value, decision.cost, forced="rate_limit")
        elif decision.arm != "skip" and s.validate and self.held_out is None:
            decision = Decision("skip", decision.ucb, decision.value, decision.cost, forced="no_held_out")
        row.update(context=context, arm=decision.arm, forced=decision.forced)
        for arm in self.bandit.arms:
            row.update(
                {
                    f"ucb_{arm}": decision.ucb[arm],
                    f"value_{arm}": decision.value[arm],
                    f"cost_{arm}": decision.cost[arm],
                }
            )

        paid = 0.0
        if decision.arm != "skip":  # 4. bounded update with a snapshot
            snapshot = self.updater.snapshot()
            self.origin = snapshot if self.origin is None else self.origin
            started = time.perf_counter()
            judge = self._scorer(self.held_out) if s.validate else None
            val_before = judge() if s.validate else None
            result = self.updater.update(list(self.recent), decision.arm)
            kept = True
            if s.validate:
                val_after = (judge if decision.arm == "head" else self._scorer(self.held_out))()
                kept = val_after < val_before if s.validate_on == "loss" else val_after > val_before
                self.undone = 0 if kept else self.undone + 1
                if not kept:
                    self.updater.restore(snapshot)
                row.update({f"val_{s.validate_on}_before": val_before, f"val_{s.validate_on}_after": val_after})
            seconds = time.perf_counter() - started
            paid = self.costs.cost(decision.arm, rows)  # the estimate the decision used
            self.costs.observe_update(decision.arm, rows, seconds)
            self.watch = _Watch(snapshot, self.tau_ema, self.adapted, self.query) if kept else None
            self.adapted = self.adapted or kept
            self.since_update = 0
            row.update(update_s=seconds, loss_before=result.loss_before, loss_after=result.loss_after, kept=kept)
        self.pending.append((self.query, context, decision.arm, self.skip_ema.get(context, tau), paid))
        self.log.add(row)
        self.query += 1
        return row

    def _origin_check(self, record: QueryRecord) -> dict[str, Any]:
        """Score ``record`` under the adapted weights and under the origin; keep whichever does better."""
        s = self.settings
        started = time.perf_counter()
        adapted = self.updater.snapshot()
        head = {id(p) for p in self.adaptable.head_parameters()}
        same_trunk = all(torch.equal(p, saved) for p, saved in self.origin if id(p) not in head)
        judge = self._scorer(record)
        now = judge()
        self.updater.restore(self.origin)
        original = (judge if same_trunk else self._scorer(record))()
        # written so that a NaN score of the adapted weights (a diverged update) also sends them back
        reset = not (now <= original) if s.validate_on == "loss" else not (now >= original)
        if reset:
            self.adapted = False
        else:
            self.updater.restore(adapted)
        return {
            f"check_{s.validate_on}_adapted": now,
            f"check_{s.validate_on}_origin": original,
            "reset": reset,
            "check_s": time.perf_counter() - started,
        }

    def _scorer(self, record: QueryRecord) -> Callable[[], float]:
        """``record``'s score under the drafter as it stands at each call: its training loss (lower is better), or
        with ``validate_on=tau`` its simulated accept length (greedy chains as long as the engine's, teacher-forced
        on the same tokens), so two scores of one record are paired (higher is better). The loss is the ``head``
        arm's closure, whatever arm was played: the same value, with the frozen part run once at creation, so one
        scorer serves before and after a change of head parameters only (half the validation time)."""
        if self.settings.validate_on == "tau":
            return lambda: self.adaptable.simulate(record, max(record.max_accept - 1, 1))[0]  # drafts per chain
        closure = self.adaptable.loss_closure(record, "head")

        def loss() -> float:
            with torch.no_grad():
                return float(closure())

        return loss

    # -- engine hooks ------------------------------------------------------------------------------------------

    def begin_query(
        self, query: Hashable, prompt_ids: list[int], features: torch.Tensor, last_logits: torch.Tensor, max_accept: int
    ) -> None:
        """After prefill of query ``query``: the prompt's features [P, F] and the target's logits at its last
        position [V]."""
        teacher, in_vocab = self.adaptable.teacher_rows(last_logits[None])
        self.recorders[query] = (QueryRecorder(prompt_ids, features, teacher, in_vocab, max_accept), self.published)

    def observe_round(
        self,
        query: Hashable,
        tokens: list[int],
        features: torch.Tensor,
        target_logits: torch.Tensor,
        accepted: int,
        rejected: tuple[torch.Tensor, int] | None,
        seconds: float,
    ) -> None:
        """After one verification: the committed ``tokens`` (root + accepted path), their features [n, F] and
        target logits [n, V]; ``rejected`` = (draft logits at the rejected position, the target's token there)
        or None when the walk ended where nothing had been drafted; ``seconds``: the query's share of the step."""
        teacher, in_vocab = self.adaptable.teacher_rows(target_logits)
        q = None if rejected is None else self.adaptable.draft_prob(*rejected)
        self.recorders[query][0].add_round(tokens, features, teacher, in_vocab, accepted, q, seconds)

    def end_query(self, query: Hashable, last_token: int) -> dict[str, Any]:
        """After the last verification of a query: decide and maybe update (its time counts in the query's).
        With ``background``: collect the previous query's work (waiting for it if it still runs; its weight
        changes now serve), then start this query's on the worker; returns the collected row."""
        recorder, stamp = self.recorders.pop(query)
        record = recorder.finish(last_token)
        if record.rounds == 0:  # a one-token answer: nothing was drafted, nothing to learn or judge
            return {}
        iter_s = record.decode_s / max(record.rounds, 1)
        observed = dict(
            tau=record.tau,
            iter_ratio=iter_s / self.costs.target_forward_s,
            signal=query_signal(record.rejection_q, record.rounds, self.settings.signal_floor),
            stamp=stamp,
            request=query,
        )
        if self.settings.background and self.background is None:
            raise RuntimeError(
                "adapt.background: this adapter was built without the serving drafter "
                "(spectrain.adapt.engine.build_adapter passes it)"
            )
        collected = self.background.collect() if self.background else None  # before self.query is read
        if collected is not None:
            self.published += 1  # its weights serve from now on
        if self.write_traces:
            write_record(self.log_dir, self.query, record)
        if self.background is None:
            row = self.process(record, **observed)
            self.published += 1
            return row
        self.background.submit(lambda: self.process(record, **observed))
        return collected or {}

    def close(self) -> None:
        """Finish (with ``background``: wait for the last query's work) and close the decision log."""
        try:
            if self.background is not None:
                self.background.close()
        finally:
            self.log.close()
