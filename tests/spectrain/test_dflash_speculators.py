"""Our DFlash drafter, training loss and gradients against vLLM's drafter library itself (``speculators`` 0.9.0,
``DFlashDraftModel``), on the same weights, batch and anchors.

Conventions pinned here: the library's ``aux_hidden_state_layer_ids`` are ours + 1 (HF ``hidden_states`` indices);
its teacher applies the target's final norm itself (``verifier_norm``) to the last layer's output, ours reads the
normed state; its loss divides by (scored slots + 1e-5), ours by the scored slots; anchors are drawn by its own
``select_anchors`` from the same RNG state. The export layouts the engines load, loaded and converted by the same
library: ``tests/spectrain/test_dflash_export.py``.
"""

from __future__ import annotations

import torch

# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from tiny_targets import tiny_llama
from dflash_builders import make_drafter
from transformers import Qwen3Config
from dflash_interop_builders import ANCHORS, LENGTH, check_training_forward_agrees


def theirs_for(ours) -> DFlashDraftModel:
    """The library's model with our drafter's shapes and weights (eager attention: its flex attention fails on
    short CPU inputs)."""
    c = ours.config
    layer = Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.resolved_head_dim,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias,
    )
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=c.draft_vocab_size,
        block_size=c.block_size,
        aux_hidden_state_layer_ids=[i + 1 for i in c.aux_layer_ids],
        mask_token_id=c.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.block_size - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    theirs = DFlashDraftModel(config)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"] and not unexpected
    return theirs


def test_the_training_forward_and_loss_agree_with_the_library():
    target = tiny_llama(0, layers=3)
    ours = make_drafter(target)
    theirs = theirs_for(ours)
    with torch.no_grad():  # the library's teacher: the target's final norm and head rows of the draft vocabulary
        theirs.verifier_lm_head.weight.copy_(ours.lm_head.weight)
        theirs.verifier_norm.weight.copy_(target.model.norm.weight)
    ids = torch.randint(0, 90, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(1, LENGTH)
    loss_mask[0, 8:] = 1.0
    check_training_forward_agrees(target, ours, theirs, ids, loss_mask, anchors=ANCHORS)
