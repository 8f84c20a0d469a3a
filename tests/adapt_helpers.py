"""The online adapter's tiny target and draft, its prompts and settings that force an adaptation."""

from __future__ import annotations

import torch
from eagle3_tree_builders import random_drafter
from tiny_targets import tiny_llama

from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter

from spectrain.adapt.adapter import AdaptSettings, BanditAdapter
from spectrain.adapt.cost import CostModel
from spectrain.adapt.drafters import Eagle3Adaptable

PROMPTS = [[7, 1, 8, 2, 8], [3, 14, 15, 9, 2, 6], [5, 3, 5, 8, 9], [2, 7, 1, 8, 2, 8]]


def tiny_pair():
    """A tiny target and a random EAGLE-3 drafter for it."""
    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    return target, random_drafter(target, draft_vocab=60)


def forcing_settings(tmp_path=None, **kw) -> AdaptSettings:
    """Settings under which every allowed query updates (optimistic prior, cheap costs, no rate limit)."""
    values = dict(
        prior=5.0,
        min_gap=1,
        cost_cache=None,
        cost_rows=24,
        head_lr=1e-2,
        full_lr=1e-2,
        validate=False,
        log=None if tmp_path is None else str(tmp_path),
    )
    values.update(kw)
    return AdaptSettings(**values)


def adapter_for(drafter, costs_per_row: float = 1e-6, **kw) -> tuple[BanditAdapter, Eagle3Adaptable]:
    adaptable = Eagle3Adaptable(drafter)
    # refine=0: the policy tests set the costs; learning them from wall-clock update times made the decisions
    # depend on how busy the machine was.
    costs = CostModel(1e-3, {"head": costs_per_row, "full": costs_per_row}, refine=0.0)
    return BanditAdapter(adaptable, costs, forcing_settings(**{"arms": "head", "min_gap": 3, **kw})), adaptable


def specblock_drafter(target) -> SpecBlockDrafter:
    """A seeded random SpecBlock drafter over ``target``'s three first layers, block size 4."""
    config = SpecBlockConfig.for_target(
        target.config,
        draft_vocab_size=target.config.vocab_size,
        aux_layer_ids=[0, 1, 2],
        block_size=4,
        rank_hidden_size=16,
    )
    torch.manual_seed(0)
    return SpecBlockDrafter(config, embed_weight=target.model.embed_tokens.weight.detach()).eval()
