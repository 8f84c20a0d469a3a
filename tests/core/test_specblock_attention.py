"""Block-sparse SpecBlock training attention (core.drafters.specblock.attention) against the dense masks it
replaces: the attention itself, and the training loss and every gradient of cross-block training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from specblock_builders import tiny_drafter

from core.drafters.specblock import first_block_mask, later_block_mask
from core.drafters.specblock.attention import BlockLayout, block_sparse_attention
from spectrain.kinds.specblock.losses import total_loss, unroll_blocks

K = 4


@pytest.mark.parametrize("expand_kv", [False, True])  # True: the CUDA path (K/V heads repeated, no GQA)
@pytest.mark.parametrize("other_anchors", [False, True])
def test_block_sparse_attention_equals_the_dense_masks(expand_kv, other_anchors):
    """Every block kind, cuts below K (invalid prefixes) and at K, over several chunks with a partial last one."""
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, anchors = 2, 4, 2, 8, 11
    entries = anchors * K
    for ttt_valid in [(), (1,), (K,), (3, 1), (2, K)]:
        later = bool(ttt_valid)
        q = torch.randn(batch, heads, entries, dim)
        k, v = torch.randn(batch, kv_heads, entries, dim), torch.randn(batch, kv_heads, entries, dim)
        past = [(torch.randn_like(k), torch.randn_like(v)) for _ in range(len(ttt_valid) + later)]
        mask = (
            later_block_mask(anchors, K, first_block=True, ttt_valid=ttt_valid, other_anchors=other_anchors)
            if later
            else first_block_mask(anchors, K)
        )
        keys, values = (torch.cat([p[i] for p in past] + [t], dim=2) for i, t in ((0, k), (1, v)))
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        layout = BlockLayout(
            anchors,
            K,
            first_block=later,
            ttt_valid=ttt_valid,
            own_sees_earlier=other_anchors or not later,
            chunk_anchors=4,
        )
        sparse = block_sparse_attention(
            q, k, v, [p[0] for p in past], [p[1] for p in past], layout, expand_kv=expand_kv
        )
        torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-6, msg=f"ttt_valid={ttt_valid}")


@pytest.mark.parametrize("other_anchors", [False, True])
def test_training_loss_and_gradients_equal_the_dense_path(other_anchors):
    """fp32, 3 blocks with cuts 1 and 3 (slots past the cut invisible to the next block, and the valid-prefix
    loss masks), 37 anchors = 3 chunks of the default size: loss and every parameter's gradient equal the dense
    masks' within rtol 1e-5 + atol 1e-6 (measured here: the loss bitwise equal, each gradient within 6e-7 of its
    largest entry)."""
    drafter, _ = tiny_drafter()
    drafter.config.train_block2_sees_other_anchors = other_anchors
    torch.manual_seed(1)
    seq = 37
    aux, tokens = torch.randn(2, seq, 3 * 32), torch.randint(0, 96, (2, seq))
    teacher = torch.softmax(3 * torch.randn(2, seq, 64), -1)
    pm = torch.rand(2, seq) < 0.8
    results = {}
    for attention in ("dense", "block_sparse"):
        drafter.zero_grad(set_to_none=True)
        out = unroll_blocks(drafter, aux, tokens, teacher, pm, [1, 3], attention=attention)
        loss = total_loss(out)
        loss.backward()
        results[attention] = (
            loss.detach(),
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
        )
    (dense_loss, dense_grads), (sparse_loss, sparse_grads) = results["dense"], results["block_sparse"]
    assert seq > 2 * BlockLayout(seq, K).chunk_anchors
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert sparse_grads.keys() == dense_grads.keys() and len(dense_grads) > 10
    for name, grad in dense_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(sparse_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_unknown_attention_is_refused():
    drafter, _ = tiny_drafter()
    with pytest.raises(ValueError, match="attention='flex' is not one of block_sparse, dense"):
        drafter.forward_block(
            torch.randn(1, 3, 96), torch.zeros(1, 3, dtype=torch.long), from_target=True, attention="flex"
        )
