"""Tiny models of each architecture family the runner serves."""

from __future__ import annotations

import torch
import transformers

from inference.runner import ModelRunner
from inference.transformers_runner import TransformersRunner

VOCAB, WINDOW, MAX_SEQ = 128, 8, 96


BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2
# 8 experts of width 16, two a token, layer 0 dense (tests/inference/test_moe_target.py covers the MoE path in depth)
MOE = {
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],
}


# family -> (model class, config class, config overrides, runner that serves it)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, ModelRunner),
    "mistral (sliding window)": ("MistralForCausalLM", "MistralConfig", {"sliding_window": WINDOW}, TransformersRunner),
    "mistral (full)": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}, ModelRunner),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, ModelRunner),
    "qwen2 (sliding window)": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
        TransformersRunner,
    ),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}, ModelRunner),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", MOE, ModelRunner),
    "qwen3-moe (sliding window)": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {**MOE, "use_sliding_window": True, "sliding_window": WINDOW},
        TransformersRunner,
    ),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}, ModelRunner),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8}, TransformersRunner),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {"head_dim": 8, "sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
        TransformersRunner,
    ),
    "gemma3 (text)": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {"head_dim": 8, "sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
        TransformersRunner,
    ),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"sliding_window": WINDOW}, TransformersRunner),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}, TransformersRunner),
    "olmo3": (
        "Olmo3ForCausalLM",
        "Olmo3Config",
        {"sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
        TransformersRunner,
    ),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {}, TransformersRunner),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {"sliding_window": WINDOW}, TransformersRunner),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {}, TransformersRunner),
    "cohere2": (
        "Cohere2ForCausalLM",
        "Cohere2Config",
        {"sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
        TransformersRunner,
    ),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}, TransformersRunner),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", {"head_dim": 8}, TransformersRunner),
    "gpt-oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "head_dim": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        TransformersRunner,
    ),
}


def tiny_model(family: str):
    model_class, config_class, overrides, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**BASE, **overrides})
    config._attn_implementation = "eager" if any(f in family for f in ("gemma", "cohere", "gpt-oss")) else "sdpa"
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # sharper logits: greedy choices far from ties, so kernel rounding cannot flip them
        model.get_output_embeddings().weight.mul_(8.0)
    return model
