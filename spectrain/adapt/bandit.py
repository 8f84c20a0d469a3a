"""The cost-aware UCB choice between ``skip`` and the update arms (docs/algorithms/specblock.md §7).

Per (context, arm) the bandit keeps the running mean of the realised accept-length change Δτ after that arm.
Its optimistic estimate ``UCB = mean + c·sqrt(2·ln(N_ctx + 1) / n)`` (the arm's statistics pooled over contexts
where it was never tried in this one; ``prior`` for an arm never tried at all) is capped at the largest change possible (``max_accept − τ``) and turned into a saving in target
forwards (:func:`spectrain.adapt.cost.saving`). A non-skip arm is chosen only when that saving exceeds its
measured cost; otherwise the answer is ``skip`` (UCB_skip ≡ 0, cost 0). Deterministic: no random draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.errors import UserError
from spectrain.adapt.cost import saving

UPDATE_ARMS = ("head", "full", "lora")  # lora is opt-in (adapt.arms=head,full,lora): it adds adapters
DEFAULT_ARMS = ("head", "full")


@dataclass
class ArmStats:
    count: int = 0
    mean: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += (value - self.mean) / self.count


@dataclass
class Decision:
    arm: str
    ucb: dict[str, float] = field(default_factory=dict)  # capped Δτ estimate per update arm
    value: dict[str, float] = field(default_factory=dict)  # expected saving − cost, target forwards
    cost: dict[str, float] = field(default_factory=dict)
    forced: str = ""  # why the arm was forced (rate limit), else ""


class CostAwareUCB:
    def __init__(self, arms: Sequence[str] = DEFAULT_ARMS, *, ucb_c: float = 0.5, prior: float = 0.3):
        unknown = sorted(set(arms) - set(UPDATE_ARMS))
        if unknown or not arms:
            raise UserError(f"adapt.arms must be a non-empty subset of {list(UPDATE_ARMS)}, got {list(arms)}")
        if ucb_c < 0:
            raise UserError(f"adapt.ucb_c must be >= 0, got {ucb_c}")
        self.arms, self.ucb_c, self.prior = tuple(arms), ucb_c, prior
        self.stats: dict[tuple[int, str], ArmStats] = {}

    def _stats(self, context: int, arm: str) -> ArmStats:
        return self.stats.setdefault((context, arm), ArmStats())

    def pooled(self, arm: str) -> ArmStats:
        """``arm``'s statistics over all contexts."""
        pooled = ArmStats()
        for (_, a), stats in self.stats.items():
            if a == arm and stats.count:
                pooled.mean = (pooled.mean * pooled.count + stats.mean * stats.count) / (pooled.count + stats.count)
                pooled.count += stats.count
        return pooled

    def ucb(self, context: int, arm: str) -> float:
        """Optimistic Δτ estimate of ``arm`` in ``context`` (uncapped). A context where the arm was never played
        borrows the arm's pooled statistics (a short stream visits each context a few times only), and only an
        arm never played anywhere gets the ``prior``."""
        stats = self._stats(context, arm)
        tried = sum(self._stats(context, a).count for a in self.arms)
        if stats.count == 0:
            stats = self.pooled(arm)
            tried = sum(s.count for s in self.stats.values())
            if stats.count == 0:
                return self.prior
        return stats.mean + self.ucb_c * math.sqrt(2.0 * math.log(tried + 1) / stats.count)

    def decide(
        self,
        context: int,
        *,
        tau: float,
        iter_ratio: float,
        horizon: int,
        max_accept: float,
        costs: Mapping[str, float],
    ) -> Decision:
        """Best arm by expected saving − cost; ``skip`` unless some update arm's value is > 0."""
        decision = Decision("skip")
        best = 0.0
        for arm in self.arms:  # ties go to the earlier (cheaper) arm
            estimate = min(self.ucb(context, arm), max(max_accept - tau, 0.0))
            value = saving(estimate, tau, iter_ratio, horizon, max_accept) - costs[arm]
            decision.ucb[arm], decision.value[arm], decision.cost[arm] = estimate, value, costs[arm]
            if value > best:
                decision.arm, best = arm, value
        return decision

    def feedback(self, context: int, arm: str, dtau: float) -> None:
        """The realised Δτ after ``arm`` was played in ``context`` (skip carries no statistics)."""
        if arm != "skip":
            self._stats(context, arm).add(dtau)
