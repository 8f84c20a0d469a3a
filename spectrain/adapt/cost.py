"""The cost model, in units of one target (verification) forward — measured on the running machine, not assumed.

At start-up :func:`measure_costs` times a target forward of ``tree_total`` tokens after ``context`` cached ones
and one bounded update per arm on a synthetic record (random rows, the real drafter, restored afterwards); the
result is cached in a JSON file keyed by device, target shape, drafter shape and update settings. Update time is
modelled as linear in the record's rows and refined with every real update (EMA of the measured seconds).

Value of an update (docs/algorithms/specblock.md §7, exact): with ``T_iter`` the measured time of one draft+verify
iteration and τ the accept length, the next ``H`` tokens cost ``H · T_iter / τ``; raising τ by Δτ saves
``H · T_iter · (1/τ − 1/(τ + Δτ))``. Δτ is capped at ``max_accept − τ``, so a cost above that bound can never pay.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.assets import cache_dir


@dataclass
class CostModel:
    target_forward_s: float  # one verification forward
    update_s_per_row: dict[str, float] = field(default_factory=dict)  # arm -> seconds per record row
    refine: float = 0.3  # EMA weight of a newly measured update

    def __post_init__(self) -> None:
        if self.target_forward_s <= 0:
            raise ValueError(f"target forward time must be > 0 s, got {self.target_forward_s}")

    def cost(self, arm: str, rows: int) -> float:
        """Cost of updating with ``arm`` on a record of ``rows`` rows, in target forwards (skip costs 0)."""
        if arm == "skip":
            return 0.0
        if arm not in self.update_s_per_row:
            raise ValueError(f"no measured cost for arm '{arm}'; measured arms: {sorted(self.update_s_per_row)}")
        return self.update_s_per_row[arm] * rows / self.target_forward_s

    def observe_update(self, arm: str, rows: int, seconds: float) -> None:
        """Fold a real update's wall time into the per-row estimate."""
        per_row = seconds / max(rows, 1)
        old = self.update_s_per_row.get(arm, per_row)
        self.update_s_per_row[arm] = (1 - self.refine) * old + self.refine * per_row

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CostModel:
        return cls(**values)


def saving(dtau: float, tau: float, iter_ratio: float, horizon: int, max_accept: float) -> float:
    """Saved time over the next ``horizon`` tokens, in target forwards, if τ rises by ``dtau`` (capped so that
    τ + Δτ ≤ ``max_accept``). ``iter_ratio`` = T_iter / T_target_forward."""
    tau = max(tau, 1.0)
    new_tau = min(tau + dtau, float(max_accept))
    if new_tau <= 0:
        return float("-inf")
    return horizon * iter_ratio * (1.0 / tau - 1.0 / new_tau)


def max_saving(tau: float, iter_ratio: float, horizon: int, max_accept: float) -> float:
    """The largest saving any update could bring (τ jumping to ``max_accept``)."""
    return saving(float("inf"), tau, iter_ratio, horizon, max_accept)


def time_call(fn: Callable[[], Any], repeats: int = 3, device: torch.device | str = "cpu") -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    device = torch.device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_target_forward(target, tokens: int, context: int, repeats: int = 3) -> float:
    """Seconds of one forward of ``tokens`` new tokens after ``context`` cached ones (the runner is reset after)."""
    device = target.device
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    target.reset(1)
    with torch.no_grad():
        target.forward(torch.randint(vocab, (1, context), generator=generator).to(device))
        new = torch.randint(vocab, (1, tokens), generator=generator).to(device)

        def forward() -> None:
            target.forward(new)
            target.truncate(context)

        seconds = time_call(forward, repeats, device)
    target.reset(1)
    return seconds


def cache_key(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


DEFAULT_COST_CACHE = "auto"  # adapt.cost_cache's default: COST_CACHE_NAME in the project's cache ($SPECTRAIN_CACHE)
COST_CACHE_NAME = "adapt_costs.json"


def cost_cache_path(path: str | Path | None) -> Path | None:
    """Where ``adapt.cost_cache`` keeps measured costs: ``auto`` is the project's cache folder (``$SPECTRAIN_CACHE``,
    default ``~/.cache/spectrain``), None keeps nothing."""
    if path is None:
        return None
    return cache_dir() / COST_CACHE_NAME if str(path) == DEFAULT_COST_CACHE else Path(path).expanduser()


def cached_costs(path: str | Path | None, key_payload: dict[str, Any], measure: Callable[[], CostModel]) -> CostModel:
    """The cost model stored under ``key_payload`` in the JSON file ``path`` (:func:`cost_cache_path`), else
    ``measure()`` (and store it). ``path`` None: always measure."""
    path = cost_cache_path(path)
    if path is None:
        return measure()
    key = cache_key(key_payload)
    stored = json.loads(path.read_text()) if path.is_file() else {}
    if key in stored:
        return CostModel.from_dict(stored[key]["costs"])
    costs = measure()
    stored[key] = {"what": key_payload, "costs": costs.to_dict()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=2, default=str) + "\n")
    tmp.replace(path)
    return costs
