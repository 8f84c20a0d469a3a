"""A P-EAGLE drafter for a tiny target's config (the export and interop tests build it)."""

from __future__ import annotations

import torch
from eagle3_export_builders import AUX, DRAFT_VOCAB, VOCAB
from tiny_targets import set_random_vocab_map

from core.drafters.peagle import PEagleConfig, PEagleDrafter

MASK, DEPTHS = 7, 4


def make_peagle(
    target_config, *, seed: int = 1, depths: int = DEPTHS, mask_token_id: int = MASK, **overrides
) -> PEagleDrafter:
    """Every weight random (norms too) and a reduced vocabulary."""
    torch.manual_seed(seed)
    config = PEagleConfig.for_target(
        target_config,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=AUX,
        mask_token_id=mask_token_id,
        num_depths=depths,
        **overrides,
    )
    drafter = PEagleDrafter(config, embed_weight=torch.randn(VOCAB, config.hidden_size))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)
    set_random_vocab_map(drafter, VOCAB, DRAFT_VOCAB)
    return drafter
