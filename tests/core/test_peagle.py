"""The P-EAGLE drafter: its chain attention against the library's mask and a dense reference, and one training forward
against the serving path (the same logits for every depth of a chain)."""

from __future__ import annotations

import pytest
import torch
from eagle3_export_builders import VOCAB, tiny_target
from peagle_export_builders import DEPTHS, make_peagle
from speculators.models.peagle.attention import create_peagle_mask_mod

from core.drafters.peagle.attention import ChainLayout


def chains_of(rows: list[tuple[int, int]], width: int | None = None) -> ChainLayout:
    """A one-sequence layout of (anchor, depth) rows, sorted, padded at the front to ``width``."""
    rows = sorted(rows)
    pad = (width or len(rows)) - len(rows)
    anchors = torch.tensor([[0] * pad + [a for a, _ in rows]])
    depths = torch.tensor([[1] * pad + [d for _, d in rows]])
    valid = torch.tensor([[False] * pad + [True] * len(rows)])
    return ChainLayout(anchors, depths, valid)


def every_chain(length: int, anchors: list[int], depths: int) -> list[tuple[int, int]]:
    return [(a, d) for a in anchors for d in range(1, depths) if a + d < length]


def test_the_chain_mask_is_the_librarys_peagle_mask():
    length = 12
    rows = [(0, 1), (0, 2), (3, 1), (3, 2), (3, 3), (5, 1), (8, 1), (8, 2)]
    layout = chains_of(rows)
    ours = torch.zeros(length + len(rows), length + len(rows), dtype=torch.bool)
    ours[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()  # depth-0 rows: causal
    ours[length:] = layout.mask(length)[0]
    # the library's rows: depth 0 at every position, then the chain rows (its anchor_pos / depth lists)
    anchor_pos = torch.tensor(list(range(length)) + [a for a, _ in rows])
    depth = torch.tensor([0] * length + [d for _, d in rows])
    mod = create_peagle_mask_mod(anchor_pos, depth, torch.zeros(length, dtype=torch.long))
    q, kv = torch.meshgrid(torch.arange(len(anchor_pos)), torch.arange(len(anchor_pos)), indexing="ij")
    assert torch.equal(mod(0, 0, q, kv), ours)


def test_chunked_chain_attention_equals_the_dense_mask():
    torch.manual_seed(0)
    length, heads, kv_heads, dim = 20, 4, 2, 8
    rows = every_chain(length, [2, 3, 7, 8, 9, 15], 5)
    layout = chains_of(rows, width=len(rows) + 3)
    total = length + layout.rows
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    dense = ChainLayout(layout.anchors, layout.depths, layout.valid, dense=True).attend(q, k, v)
    for chunk in (1, 3, 5, 64):  # chunk starts cut chains
        sparse = ChainLayout(layout.anchors, layout.depths, layout.valid, chunk_rows=chunk).attend(q, k, v)
        torch.testing.assert_close(sparse[:, :, 3:], dense[:, :, 3:], rtol=1e-6, atol=1e-6)  # padding rows aside


def test_the_training_forward_and_its_gradients_equal_the_dense_masks():
    target = tiny_target(0)
    torch.manual_seed(4)
    length = 24
    ids, aux = torch.randint(0, VOCAB, (2, length)), torch.randn(2, length, 3 * target.config.hidden_size)
    first, second = every_chain(length, [1, 5, 6, 12], DEPTHS), every_chain(length, [3, 9], DEPTHS)
    results = []
    for dense in (True, False):
        drafter = make_peagle(target.config)
        layout = chains_of(first, width=len(first))
        other = chains_of(second, width=len(first))
        layout = ChainLayout(
            torch.cat([layout.anchors, other.anchors]),
            torch.cat([layout.depths, other.depths]),
            torch.cat([layout.valid, other.valid]),
            dense=dense,
            chunk_rows=5,
        )
        out = drafter(ids, aux, layout)
        loss = out.hidden.square().mean() + out.chain_hidden[layout.valid].square().mean()
        loss.backward()
        results.append((out, {name: p.grad for name, p in drafter.named_parameters() if p.requires_grad}))
    (dense_out, dense_grads), (sparse_out, sparse_grads) = results
    torch.testing.assert_close(sparse_out.hidden, dense_out.hidden, rtol=1e-5, atol=1e-6)
    valid = layout.valid
    torch.testing.assert_close(sparse_out.chain_hidden[valid], dense_out.chain_hidden[valid], rtol=1e-5, atol=1e-6)
    assert "mask_hidden" in sparse_grads and float(sparse_grads["mask_hidden"].abs().sum()) > 0
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_training_forward_drafts_what_serving_drafts_at_every_depth():
    target = tiny_target(0)
    drafter = make_peagle(target.config).eval()
    torch.manual_seed(2)
    length = 16
    ids = torch.randint(0, VOCAB, (1, length))
    aux = torch.randn(1, length, 3 * target.config.hidden_size)
    anchors = [0, 4, 9]
    layout = chains_of(every_chain(length, anchors, DEPTHS))
    with torch.no_grad():
        out = drafter(ids, aux, layout)
        chain_logits = drafter.head(out.chain_hidden)[0]
        depth0 = drafter.head(out.hidden)[0]
    for a in anchors:
        cache = drafter.new_cache(64)
        served = drafter.draft(cache, aux[:, : a + 1], ids[0, 1 : a + 2].tolist())[0]
        assert cache.length == a + 1  # the mask rows' K/V were dropped
        expected = [depth0[a]] + [
            chain_logits[n] for n, (an, d) in enumerate(sorted(every_chain(length, anchors, DEPTHS))) if an == a
        ]
        torch.testing.assert_close(served, torch.stack(expected), rtol=1e-5, atol=1e-5)
    # incremental serving: rows appended over two calls draft what one call drafts
    cache = drafter.new_cache(64)
    drafter.draft(cache, aux[:, :5], ids[0, 1:6].tolist())
    torch.testing.assert_close(
        drafter.draft(cache, aux[:, 5:10], ids[0, 6:11].tolist()),
        drafter.draft(drafter.new_cache(64), aux[:, :10], ids[0, 1:11].tolist()),
        rtol=1e-5,
        atol=1e-5,
    )


def test_bad_configs_and_calls_are_refused_in_one_line():
    target = tiny_target(0)
    with pytest.raises(ValueError, match="mask_token_id 97 is not a token id of the 97-token vocabulary"):
        make_peagle(target.config, mask_token_id=97)
    with pytest.raises(ValueError, match="P-EAGLE num_depths must be >= 1"):
        make_peagle(target.config, depths=0)
    drafter = make_peagle(target.config)
    with pytest.raises(ValueError, match="draft depths=5 but this drafter drafts 1..4"):
        drafter.draft(drafter.new_cache(8), torch.zeros(1, 1, 96), [1], depths=5)
