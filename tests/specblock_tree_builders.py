"""A random SpecBlock drafter over a tiny target (the tree, engine and serving tests build it)."""

from __future__ import annotations

import torch
from tiny_targets import set_random_vocab_map

from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter

PROMPTS, N_NEW, AUX = ([7, 1, 8, 2, 8], [3, 14, 15, 92, 65, 35]), 64, [0, 1, 2]


def random_drafter(
    target, *, draft_vocab: int, seed: int = 3, cls=SpecBlockDrafter, block_size: int = 4, **kw
) -> SpecBlockDrafter:
    """A randomly initialised drafter sharing the target's embedding, over a random reduced vocab if Vd < V."""
    config = SpecBlockConfig.for_target(
        target.config, draft_vocab_size=draft_vocab, aux_layer_ids=AUX, block_size=block_size
    )
    torch.manual_seed(seed)
    drafter = cls(config, embed_weight=target.get_input_embeddings().weight.detach(), **kw)
    vocab = target.config.vocab_size
    if draft_vocab < vocab:
        set_random_vocab_map(drafter, vocab, draft_vocab)
    return drafter.eval()
