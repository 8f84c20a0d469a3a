"""The DFlash drafter: block-sparse training attention equals the dense anchor mask (values and gradients), a
training block equals the served block for the same context, what a block may and may not see, the frozen target
weights, and one-line errors."""

from __future__ import annotations

import pytest
import torch
from dflash_builders import AUX, BLOCK, MASK_ID, make_drafter
from tiny_targets import tiny_llama

from core.drafters.dflash import DFlashConfig, DFlashDrafter


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=3)


def batch(target, length: int = 40, rows: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (rows, length), generator=generator)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return ids, torch.cat([states[i + 1] for i in AUX], dim=-1)


def test_block_sparse_attention_equals_the_dense_anchor_mask(target):
    drafter = make_drafter(target)
    ids, features = batch(target)
    anchors = torch.tensor([[0, 3, 4, 9, 17, 18, 25, 30, 33, 35], [1, 2, 2, 6, 11, 20, 21, 28, 29, 36]])
    outputs, grads = {}, {}
    for attention in ("dense", "block_sparse"):
        drafter.zero_grad()
        hidden = drafter(features, ids, anchors, attention=attention)
        (drafter.head(hidden).float().logsumexp(-1) * torch.linspace(0, 1, BLOCK)).sum().backward()
        outputs[attention] = hidden.detach()
        grads[attention] = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outputs["block_sparse"], outputs["dense"], rtol=1e-5, atol=1e-5)
    assert set(grads["dense"]) == set(grads["block_sparse"]) and "fc.weight" in grads["dense"]
    assert "lm_head.weight" not in grads["dense"] and "embed_tokens.weight" not in grads["dense"]  # frozen
    for name, grad in grads["dense"].items():
        torch.testing.assert_close(grads["block_sparse"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunks", [[5, 12, 20], [20]])
def test_a_training_block_equals_the_served_block(target, chunks):
    """Serving caches the context in pieces and drafts with no mask; training drafts many anchors at once under
    the anchor mask: the logits of anchor p's block must agree (context = positions < p, anchor token = token p)."""
    drafter = make_drafter(target).eval()
    ids, features = batch(target, rows=1)
    anchors = torch.tensor([[5, 12, 20]])
    with torch.no_grad():
        trained = drafter.head(drafter(features, ids, anchors))[0, :, 1:]
    for a, p in enumerate(anchors[0].tolist()):
        if p not in chunks:
            continue
        cache, start = drafter.new_cache(64), 0
        for end in [c for c in chunks if c <= p]:  # the context arrives in several appends
            served = drafter.draft(cache, features[:, start:end], ids[0, end])
            start = end
        torch.testing.assert_close(served[0], trained[a], rtol=1e-5, atol=1e-5)


def test_a_block_sees_its_context_prefix_and_all_of_itself_only(target):
    drafter = make_drafter(target).eval()
    ids, features = batch(target, rows=1)
    anchors = torch.tensor([[10, 20]])
    with torch.no_grad():
        base = drafter(features, ids, anchors)
        later = features.clone()
        later[:, 10:] += 1.0  # the context at and after the first anchor: invisible to its block
        changed = drafter(later, ids, anchors)
        torch.testing.assert_close(changed[:, 0], base[:, 0])
        assert not torch.allclose(changed[:, 1], base[:, 1])  # ...but the second block reads positions 10..19
        other = ids.clone()
        other[0, 20] = (ids[0, 20] + 1) % 90  # the second anchor's token: invisible to the first block
        torch.testing.assert_close(drafter(features, other, anchors)[:, 0], base[:, 0])
        # bidirectional inside a block: slot 1 depends on slot 3's token
        cache = drafter.new_cache(64)
        drafter.draft(cache, features[:, :10], ids[0, 10])
        layers = drafter._layers
        tokens = drafter.block_tokens(ids[:, 10:11])
        positions = torch.arange(10, 10 + BLOCK)[None]
        plain = layers(tokens, positions, cache.view(), None)
        tokens[0, 3] = 5
        moved = layers(tokens, positions, cache.view(), None)
        assert not torch.allclose(plain[0, 1], moved[0, 1])


def test_the_head_is_the_targets_rows_of_the_draft_vocabulary(target):
    drafter = make_drafter(target)
    ids = drafter.draft_ids_in_target()
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight.detach()[ids])
    assert not drafter.lm_head.weight.requires_grad and not drafter.embed_tokens.weight.requires_grad
    assert drafter.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()  # shared


def test_bad_configs_are_one_line_errors(target):
    def config(**kw):
        values = dict(draft_vocab_size=60, aux_layer_ids=AUX, block_size=BLOCK, num_layers=1, mask_token_id=MASK_ID)
        values.update(kw)
        return DFlashConfig.for_target(target.config, **values)

    with pytest.raises(ValueError, match="block_size must be >= 2"):
        config(block_size=1)
    with pytest.raises(ValueError, match="mask_token_id 97 is not a token id of the 97-token vocabulary"):
        config(mask_token_id=97)
    with pytest.raises(ValueError, match="at least one non-negative aux layer id"):
        config(aux_layer_ids=[])
    with pytest.raises(ValueError, match="hidden_size 48 must equal the target's 32"):
        config(hidden_size=48)
    drafter = DFlashDrafter(config())
    with pytest.raises(ValueError, match=r"target lm_head is \(50, 32\) but this drafter needs \(97, 32\)"):
        drafter.use_target_head(torch.zeros(50, 32))
    with pytest.raises(ValueError, match="context cache overflow: 9 positions needed, capacity 8"):
        drafter.draft(drafter.new_cache(8), torch.zeros(1, 9, 64), 3)
