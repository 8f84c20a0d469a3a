"""A small draft LM for draft-model algorithms (SpS, HSD, PEARL, SpecBranch, SSD), made from the target itself.

No offline partner model exists for SmolLM2, so the draft is the target with most decoder layers dropped
("layer-drop init"): it keeps the target's tokenizer, embeddings, final norm and lm_head, and a few evenly
spaced decoder layers. Distillation (``spectrain.kinds.draft_lm.module``) then teaches the shallow stack to imitate
the deep one. The result is a plain transformers causal LM, so the engine loads it like any HF directory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.atomic import atomic_directory


def evenly_spaced_layers(num_layers: int, keep: int) -> list[int]:
    """``keep`` layer ids spread over ``num_layers``, always including the first and the last."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"draft layers must be between 1 and the target's {num_layers}, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def layer_drop_init(target, keep_layers: Sequence[int]):
    """A new causal LM with the target's config but only ``keep_layers`` (copied), sharing nothing mutable."""
    from transformers import AutoModelForCausalLM  # transformers: a heavy import, deferred to first use

    keep_layers = list(keep_layers)
    config = type(target.config)(**(target.config.to_dict() | {"num_hidden_layers": len(keep_layers)}))
    draft = AutoModelForCausalLM.from_config(config, dtype=next(target.parameters()).dtype)
    source = target.state_dict()
    state = {}
    for key, value in source.items():
        if ".layers." in key:
            prefix, rest = key.split(".layers.", 1)
            index, suffix = rest.split(".", 1)
            if int(index) in keep_layers:
                state[f"{prefix}.layers.{keep_layers.index(int(index))}.{suffix}"] = value.clone()
        else:
            state[key] = value.clone()
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"layer-drop init could not map the target's weights: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        draft.tie_weights()
    return draft


def freeze_embeddings(draft) -> None:
    """The embeddings (and a tied lm_head) stay the target's: they are a third of a small model's parameters,
    and keeping them frozen keeps the draft's token space aligned with the target's."""
    for parameter in draft.get_input_embeddings().parameters():
        parameter.requires_grad_(False)


def add_lora(draft, rank: int, alpha: int | None = None):
    """Wrap the copied decoder layers with LoRA adapters (peft); embeddings and lm_head stay frozen."""
    from peft import LoraConfig, get_peft_model  # peft: a heavy import, deferred to first use

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(draft, config)


def merged(draft):
    """A plain transformers model (LoRA adapters merged in) for export."""
    if hasattr(draft, "merge_and_unload"):
        return draft.merge_and_unload()
    return draft


@torch.no_grad()
def export_draft_lm(draft, tokenizer, out_dir, *, spectrain_block: dict) -> None:
    """Write a loadable HF directory (+ tokenizer) with a ``spectrain`` block in config.json, atomically."""
    model = merged(draft)
    model.config.spectrain = spectrain_block
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
