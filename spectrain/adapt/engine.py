"""Engine-side set-up of ``adapt=bandit``: the drafter's adapter class, the measured cost model, the adapter, and
:data:`BANDIT`, what the engine's round-observer hook (:mod:`inference.round_observers`) attaches."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import torch

from spectrain.adapt.adapter import AdaptSettings, BanditAdapter
from spectrain.adapt.cost import CostModel, cached_costs, measure_target_forward, time_call
from spectrain.adapt.drafters import AdaptableDrafter, adaptable_for
from spectrain.adapt.updater import Updater


def measure_costs(
    target,
    adaptable: AdaptableDrafter,
    updater: Updater,
    arms: list[str],
    *,
    verify_tokens: int,
    context: int,
    rows: int,
) -> CostModel:
    """Time a verification forward of ``verify_tokens`` tokens after ``context`` cached ones, and one bounded
    update per arm on a synthetic ``rows``-row record (the drafter is restored after each)."""
    target_s = measure_target_forward(target, verify_tokens, context)
    record = adaptable.synthetic_record(rows, prompt_len=max(1, rows // 4))
    per_row = {}
    for arm in arms:
        snapshot = updater.snapshot()
        try:
            seconds = time_call(
                lambda arm=arm: updater.update(record, arm),
                repeats=1,
                device=next(adaptable.module.parameters()).device,
            )
        finally:
            updater.restore(snapshot)
        per_row[arm] = seconds / min(rows, getattr(adaptable, "max_rows", rows))
    return CostModel(target_s, per_row)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()}"


def adaptable_options(settings: AdaptSettings) -> dict[str, Any]:
    """The settings a drafter's adapter class takes (how its update loss is built)."""
    return {
        "ttt_steps": settings.ttt_steps,
        "step_weight": settings.step_weight,
        "max_rows": settings.max_rows,
        "teacher_temperature": settings.teacher_temperature,
    }


def adaptable_with_settings(drafter, settings: AdaptSettings) -> AdaptableDrafter:
    """The drafter's adapter class under ``settings`` (LoRA adapters added when the lora arm may be played)."""
    adaptable = adaptable_for(drafter, **adaptable_options(settings))
    if "lora" in settings.arm_list():
        adaptable.add_lora(settings.lora_rank)
    return adaptable


def private_copy(drafter):
    """A copy of ``drafter`` that adaptation may change without touching the loaded one (other algorithms of the
    same evaluate run serve from it); the target's embedding stays shared, not copied."""

    shared = drafter.embed_tokens.weight
    return copy.deepcopy(drafter, memo={id(shared): shared})


def training_copy(adaptable: AdaptableDrafter, settings: AdaptSettings) -> AdaptableDrafter:
    """The same adapter class over a private copy of ``adaptable``'s drafter (LoRA adapters included): what
    ``adapt.background`` trains while the original serves, and what replay measures τ on."""
    return adaptable_for(private_copy(adaptable.module), **adaptable_options(settings))


def build_adapter(target, drafter, settings: AdaptSettings, *, verify_tokens: int, max_accept: int) -> BanditAdapter:
    """A :class:`BanditAdapter` for ``drafter`` served with ``target``; measures (or loads cached) costs. With
    ``adapt.background`` it trains a copy of ``drafter`` and publishes into ``drafter`` between queries."""
    adaptable = adaptable_with_settings(drafter, settings)
    if settings.background:
        adaptable = training_copy(adaptable, settings)
    probe = BanditAdapter.updater_for(adaptable, settings)
    arms = settings.arm_list()
    context = min(settings.cost_rows, max(1, target.max_seq_len - verify_tokens))
    key: dict[str, Any] = {
        "device": _device_name(target.device),
        "dtype": str(target.dtype),
        "torch": torch.__version__,
        "target": {
            k: getattr(target.config, k, None)
            for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")
        },
        "drafter": type(drafter).__name__,
        "drafter_config": getattr(getattr(drafter, "config", None), "to_dict", dict)(),
        "settings": {
            k: v
            for k, v in asdict(settings).items()
            if k in ("head_steps", "full_steps", "lora_steps", "lora_rank", "ttt_steps", "max_rows", "cost_rows")
        },
        "arms": arms,
        "verify_tokens": verify_tokens,
        "context": context,
    }
    costs = cached_costs(
        settings.cost_cache,
        key,
        lambda: measure_costs(
            target, adaptable, probe, arms, verify_tokens=verify_tokens, context=context, rows=settings.cost_rows
        ),
    )
    return BanditAdapter(
        adaptable,
        costs,
        settings,
        serving=drafter if settings.background else None,
        manifest={"max_accept": max_accept, "verify_tokens": verify_tokens, "drafter": type(drafter).__name__},
    )


class BanditObservers:
    """``adapt=bandit`` for :mod:`inference.round_observers`: a :class:`BanditAdapter` over a private copy."""

    def settings(self, given: dict[str, str]) -> AdaptSettings:
        return AdaptSettings.from_given(given)

    def attach(
        self, target, drafter, settings: AdaptSettings | None, *, verify_tokens: int, max_accept: int
    ) -> tuple[Any, BanditAdapter]:
        served = private_copy(drafter)
        return served, build_adapter(
            target, served, settings or AdaptSettings(), verify_tokens=verify_tokens, max_accept=max_accept
        )


BANDIT = BanditObservers()
