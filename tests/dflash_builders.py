"""A random DFlash drafter over a tiny target (the engine, serving and interop tests build it)."""

from __future__ import annotations

import torch
from tiny_targets import set_random_vocab_map

from core.drafters.dflash import DFlashConfig, DFlashDrafter

AUX = [0, 1]


BLOCK = 4


MASK_ID = 96


def make_drafter(
    target,
    *,
    draft_vocab: int = 60,
    seed: int = 3,
    block_size: int = BLOCK,
    layers: int = 2,
    mask_token_id: int = MASK_ID,
    cls=DFlashDrafter,
    **kw,
) -> DFlashDrafter:
    """A random drafter over a random reduced vocabulary, sharing the target's embedding and head."""
    config = DFlashConfig.for_target(
        target.config,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=AUX,
        block_size=block_size,
        num_layers=layers,
        mask_token_id=mask_token_id,
    )
    torch.manual_seed(seed)
    drafter = cls(
        config,
        embed_weight=target.get_input_embeddings().weight.detach(),
        head_weight=target.lm_head.weight.detach(),
        **kw,
    )
    vocab = target.config.vocab_size
    set_random_vocab_map(drafter, vocab, draft_vocab)
    return drafter
