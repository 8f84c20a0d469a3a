"""A tiny target whose greedy decode is a near-tie at every step: the lm_head's second half repeats its first half,
each copied row moved by about one rounding unit of the dtype. Whichever of a token and its twin wins, the other is
a rounding error behind, so a forward that rounds one way where decoding rounds another (a batched GEMM, SDPA over
more rows) picks the other twin, whose embedding differs: the output leaves AR's. Only bitwise-exact verification
keeps greedy output equal to AR's on it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TWINS = 256  # tokens 0..255; token TWINS + j is token j's twin


def near_tie_llama(dtype: torch.dtype, *, seed: int = 0, layers: int = 4, hidden: int = 64) -> LlamaForCausalLM:
    """A random fp32 Llama (vocab 2·TWINS, ``layers`` layers) whose weights are exactly representable in ``dtype``
    and whose twin lm_head rows differ from their originals by about one unit in the last place of ``dtype``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2 * TWINS,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():  # the runner's cast to dtype is then exact
            param.copy_(param.to(dtype).float())
        head = model.lm_head.weight.mul_(4.0)  # sharper logits: a tie between non-twins stays rare
        first = head[:TWINS]
        nudge = torch.randn(first.shape, generator=generator) * torch.finfo(dtype).eps * first.abs()
        head[TWINS:] = (first + nudge).to(dtype).float()
    return model
