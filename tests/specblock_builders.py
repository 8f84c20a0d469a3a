"""A tiny SpecBlock drafter, as the training tests build it."""

from __future__ import annotations

import torch


def tiny_drafter(vocab: int = 96, draft_vocab: int = 64, hidden: int = 32):
    from transformers import LlamaConfig

    from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter

    target = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = SpecBlockConfig.for_target(target, draft_vocab_size=draft_vocab, aux_layer_ids=[1, 3, 4])
    return SpecBlockDrafter(config, embed_weight=torch.randn(vocab, hidden)), target
