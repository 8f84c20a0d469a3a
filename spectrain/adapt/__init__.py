"""Online cost-aware bandit adaptation of a drafter while it serves (docs/algorithms/specblock.md §7).

Modules, one job each:

- :mod:`~spectrain.adapt.signal`: the per-query signal from rejected positions and its context buckets;
- :mod:`~spectrain.adapt.cost`: the measured cost model (target forwards) and the value of a Δτ;
- :mod:`~spectrain.adapt.bandit`: the cost-aware UCB choice between ``skip``, ``head``, ``full`` (and opt-in ``lora``);
- :mod:`~spectrain.adapt.drafters`: the :class:`AdaptableDrafter` protocol, its EAGLE-3 and SpecBlock implementations, LoRA adapters;
- :mod:`~spectrain.adapt.updater`: bounded updates (steps, clip, lr) with snapshot / restore;
- :mod:`~spectrain.adapt.adapter`: the policy per query (feedback, rollback, rate limit, update) and engine hooks;
- :mod:`~spectrain.adapt.engine`: ``adapt=bandit`` set-up for the engine (start-up cost measurement, cached);
- :mod:`~spectrain.adapt.record` / :mod:`~spectrain.adapt.replay`: the trace format and the deterministic replay;
- :mod:`~spectrain.adapt.log`: decision CSV / wandb and the τ-over-queries PNG.

The verifier is never touched: adaptation changes only which tokens are drafted, so output stays lossless.
"""

from spectrain.adapt.adapter import AdaptSettings, BanditAdapter
from spectrain.adapt.drafters import AdaptableDrafter, Eagle3Adaptable

__all__ = ["AdaptSettings", "AdaptableDrafter", "BanditAdapter", "Eagle3Adaptable"]
