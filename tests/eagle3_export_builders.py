"""A tiny target and an EAGLE-3 drafter for it, and a Lightning checkpoint holding one."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_targets import set_random_vocab_map
from transformers import LlamaConfig, LlamaForCausalLM

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from spectrain.checkpoint_contract import checkpoint_metadata

VOCAB, DRAFT_VOCAB, LAYERS, AUX = 97, 40, 8, [1, 3, 4]  # AUX = the EAGLE-3 triple [1, L//2-1, L-4] for L=8


def tiny_target(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=5000.0,
    )
    return LlamaForCausalLM(config).eval()


def make_drafter(target_config, *, seed: int = 1, hidden: int | None = None, **overrides) -> Eagle3Drafter:
    """A drafter with every weight random (norms too: a swapped norm must show) and a reduced vocabulary."""
    torch.manual_seed(seed)
    shape = {} if hidden is None else {"hidden_size": hidden, "intermediate_size": 2 * hidden, "own_embedding": True}
    config = Eagle3Config.for_target(
        target_config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX, **shape, **overrides
    )
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)
    set_random_vocab_map(drafter, VOCAB, DRAFT_VOCAB)
    return drafter


def lightning_ckpt(path: Path, drafter: Eagle3Drafter, target: dict) -> Path:
    """What the future LightningModule saves: the drafter as self.drafter, plus checkpoint_metadata."""
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    state["target_lm_head.weight"] = torch.zeros(3, 3)  # other module state must be ignored
    torch.save(
        {
            "state_dict": state,
            "global_step": 7,
            "epoch": 1,
            "optimizer_states": [],
            "spectrain": checkpoint_metadata(
                drafter, target, recipe={"kind": "eagle3", "lr": 5e-5}, metrics={"val/tau_sim": 2.5}
            ),
        },
        path,
    )
    return path
