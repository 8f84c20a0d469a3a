"""A random EAGLE-3 drafter over a tiny target (the tree, engine and serving tests build it)."""

from __future__ import annotations

import torch
from tiny_targets import set_random_vocab_map

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter

PROMPT, N_NEW = [7, 1, 8, 2, 8], 37


AUX = [0, 1, 2]


def random_drafter(target, *, draft_vocab: int, seed: int = 3, cls=Eagle3Drafter, **kw) -> Eagle3Drafter:
    """A randomly initialised drafter over a random reduced vocabulary, sharing the target's embedding."""
    config = Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=AUX)
    torch.manual_seed(seed)
    drafter = cls(config, embed_weight=target.get_input_embeddings().weight.detach(), **kw)
    vocab = target.config.vocab_size
    set_random_vocab_map(drafter, vocab, draft_vocab)
    return drafter.eval()
