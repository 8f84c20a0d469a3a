"""``python -m spectrain.adapt.replay traces=DIR drafter=PATH [out=DIR] [gamma=N] [key=value ...]``

Runs the bandit policy (:meth:`spectrain.adapt.adapter.BanditAdapter.process`, the code the engine runs) over the
queries recorded by ``eagle3_tree adapt=bandit adapt.log=DIR`` (format: :mod:`spectrain.adapt.record`), in
order, starting from the drafter at ``drafter=PATH``. The environment is simulated from the records, so the run
is deterministic: τ of a query is the greedy chain acceptance τ_sim of the CURRENT drafter (chains of ``gamma``
drafts from every generated row, teacher-forced on the recorded sequence), the signal uses each chain's first
rejection, iteration time and costs are the recorded measurements (no re-timing, no cost refinement). Updates
really train the drafter on the recorded rows, and rollbacks really restore it.

Writes ``out/decisions.csv`` (every decision and reward, and ``tau_none``: τ_sim of the drafter as loaded, the
no-adaptation baseline; ``logger=wandb`` also logs to wandb) and ``out/tau.png`` (τ over queries with the chosen
arms, and the baseline). Any ``adapt.*`` setting can be overridden, as ``adapt.horizon=512`` or by its short
name (``horizon=512``); the rest come from the trace manifest.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from core.atomic import check_output
from core.drafters.eagle3.kind import load_eagle3
from core.drafters.eagle3.layouts import read_checkpoint
from core.errors import UserError
from core.overrides import OverrideError, run_cli, split_key_values
from inference.drafters import load_lm
from spectrain.adapt.adapter import AdaptSettings, BanditAdapter
from spectrain.adapt.background import Publisher, changed_weights
from spectrain.adapt.cost import CostModel
from spectrain.adapt.engine import adaptable_with_settings, training_copy
from spectrain.adapt.log import plot_tau
from spectrain.adapt.record import read_trace
from spectrain.adapt.signal import query_signal

USAGE = "python -m spectrain.adapt.replay traces=DIR drafter=PATH [out=DIR] [gamma=N] [horizon=H ...]"


@dataclass
class ReplayConfig:
    traces: str = ""
    drafter: str = ""
    out: str | None = None  # default: TRACES/replay
    target: str | None = None  # default: the target the drafter export records
    gamma: int = 0  # chain length of the simulated τ; 0 = the recorded tree depth
    logger: str = "csv"  # csv | wandb
    threads: int = 1  # CPU threads (1 keeps replays bit-identical across machines)
    device: str = "cpu"


def parse_args(argv: Sequence[str]) -> tuple[ReplayConfig, dict[str, str]]:
    """The replay config and the ``adapt_*`` overrides (short names), refusing unknown keys."""
    known = {f.name for f in fields(ReplayConfig)}
    settings = {f.name for f in fields(AdaptSettings)}
    cfg, overrides = {}, {}
    for key, value in split_key_values(argv, USAGE):
        short = key.removeprefix("adapt.").removeprefix("adapt_")
        if key in known:
            cfg[key] = value
        elif short in settings:
            overrides[short] = value
        else:
            raise OverrideError(f"unknown key '{key}'; valid: {', '.join(sorted(known | settings))}")
    for key in ("traces", "drafter"):
        if not cfg.get(key):
            raise OverrideError(f"missing {key}=...; usage: {USAGE}")
    config = ReplayConfig(**{k: (int(v) if k in ("gamma", "threads") else v) for k, v in cfg.items()})
    if config.logger not in ("csv", "wandb"):
        raise OverrideError(f"logger must be csv or wandb, got {config.logger}")
    return config, overrides


def replay(
    records, adaptable, settings: AdaptSettings, costs: CostModel, *, gamma: int, out: Path | None
) -> list[dict[str, Any]]:
    """Run the policy over ``records`` (in order) with ``adaptable``'s drafter; returns the decision rows. With
    ``background``, τ is measured on a serving copy that receives the policy's weight changes one query late, at
    the points the engine publishes them (:mod:`spectrain.adapt.background`)."""
    settings.log, settings.cost_cache = (str(out) if out else None), None
    costs = CostModel(costs.target_forward_s, dict(costs.update_s_per_row), refine=0.0)  # recorded, frozen
    adapter = BanditAdapter(adaptable, costs, settings, write_traces=False)
    serving, publisher = adaptable, None
    if settings.background:
        serving = training_copy(adaptable, settings)
        publisher = Publisher(adaptable.module, serving.module, adapter.updater.parameters("full"))
    # τ_sim of the drafter as loaded (no adaptation), per query: the baseline every row is compared with
    baseline = [adaptable.simulate(record, gamma)[0] for record in records]
    rows: list[dict[str, Any]] = []
    try:
        for record, tau_none in zip(records, baseline):
            record.max_accept = gamma + 1
            tau, rejection_q, chains = serving.simulate(record, gamma)
            if publisher is not None and rows and changed_weights(rows[-1]):
                publisher.publish()  # the engine publishes the previous query's work at the end of this one
            iter_ratio = record.decode_s / max(record.rounds, 1) / costs.target_forward_s
            adapter.log.extra = {"tau_none": tau_none}
            rows.append(
                adapter.process(
                    record,
                    tau=tau,
                    iter_ratio=iter_ratio,
                    signal=query_signal(rejection_q, chains, settings.signal_floor),
                )
            )
    finally:
        adapter.close()
    return rows


def run(cfg: ReplayConfig, overrides: dict[str, str]) -> Path:
    torch.set_num_threads(cfg.threads)
    check_output(cfg.out or Path(cfg.traces) / "replay")
    manifest, records = read_trace(cfg.traces)
    settings = AdaptSettings.with_overrides(manifest.get("settings", {}), overrides)
    if cfg.logger == "wandb":
        settings.wandb = settings.wandb or "spectrain"
    target_name = cfg.target or (read_checkpoint(cfg.drafter).target or {}).get("name")
    if not target_name:
        raise UserError(f"drafter {cfg.drafter} records no target; pass target=NAME_OR_DIR")
    target = load_lm(target_name, device=cfg.device)
    drafter = load_eagle3(cfg.drafter, target).float()
    gamma = cfg.gamma or int(manifest.get("max_accept", records[0].max_accept)) - 1
    if gamma < 1:
        raise UserError(f"gamma must be >= 1 (simulated chain length), got {gamma}")
    out = Path(cfg.out) if cfg.out else Path(cfg.traces) / "replay"
    adaptable = adaptable_with_settings(drafter, settings)
    rows = replay(records, adaptable, settings, CostModel.from_dict(manifest["costs"]), gamma=gamma, out=out)
    plot_tau(rows, out / "tau.png", title=f"replay of {Path(cfg.traces).name}: τ_sim (γ={gamma}) over queries")

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    print(
        f"{len(rows)} queries: mean τ_sim {mean('tau'):.3f} with adaptation, {mean('tau_none'):.3f} without; "
        f"{sum(r['arm'] != 'skip' for r in rows)} updates, {sum(bool(r['rolled_back']) for r in rows)} rollbacks, "
        f"{sum(bool(r['reset']) for r in rows)} returns to the original drafter (origin check)"
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    def action(args: list[str]) -> Path:
        return run(*parse_args(args))

    return run_cli(
        argv,
        action,
        doc=__doc__,
        schema=ReplayConfig,
        report=lambda out: print(f"replay written to {out}/decisions.csv and {out}/tau.png"),
    )


if __name__ == "__main__":
    sys.exit(main())
