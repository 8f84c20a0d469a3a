"""A random P-EAGLE drafter over a tiny target (the engine and serving tests build it)."""

from __future__ import annotations

import torch

from core.drafters.peagle import PEagleConfig, PEagleDrafter

PROMPT, N_NEW, AUX3 = [7, 1, 8, 2, 8], 37, [0, 1, 2]


def make_peagle(
    target, *, depths: int = 4, draft_vocab: int = 40, cls=PEagleDrafter, seed: int = 1, **kw
) -> PEagleDrafter:
    torch.manual_seed(seed)
    config = PEagleConfig.for_target(
        target.config, draft_vocab_size=draft_vocab, aux_layer_ids=AUX3, mask_token_id=3, num_depths=depths
    )
    drafter = cls(config, embed_weight=target.model.embed_tokens.weight.detach(), **kw)
    if draft_vocab < target.config.vocab_size:
        t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        t2d[torch.randperm(target.config.vocab_size)[:draft_vocab]] = True
        drafter.set_vocab_map(t2d.nonzero().flatten() - torch.arange(draft_vocab), t2d)
    return drafter.eval()
