"""Drafter serving calls over B ragged rows (per-row caches, core.drafters.row_kv): each row of a batched call gets
what the same row gets called alone with B = 1, whoever shares the call.

Row-exact mode (``set_row_exact``, fp32 on a CPU: the exact linears, RMSNorm and SiLU of core.kernels.exact_cpu, a
per-position RoPE table and one SDPA per row over exactly its keys) must give bitwise the solo row: torch.equal.
The default mode runs one padded call (padded GEMMs, a masked SDPA over the longest row's keys), whose rounding
differs from the solo call's: fp32 logits within 1e-5 (the differences seen are a few 1e-7, a GEMM's or softmax's
summation order), and the same argmax.
"""

from __future__ import annotations

import pytest
import torch
from drafter_rows_helpers import (
    DRAFT_VOCAB,
    HIDDEN,
    SHAPE,
    TARGET_HIDDEN,
    VOCAB,
    Rows,
    eagle3,
    eagle3_calls,
    padded,
    randomised,
    same,
    siblings,
    tree_rows,
)

from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.peagle import PEagleDrafter
from core.drafters.row_kv import RowKV
from core.drafters.specblock import BlockKV, SpecBlockConfig, SpecBlockDrafter

EXACT = [pytest.param(True, id="row_exact"), pytest.param(False, id="padded")]


def dflash(exact: bool) -> DFlashDrafter:
    torch.manual_seed(0)
    config = DFlashConfig(
        **SHAPE, target_hidden_size=HIDDEN, aux_layer_ids=[0, 1], block_size=4, num_layers=2, mask_token_id=VOCAB - 1
    )
    return randomised(DFlashDrafter(config, embed_weight=torch.randn(VOCAB, HIDDEN)), exact)


# -- EAGLE-3 -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", EXACT)
def test_eagle3_rows_equal_their_solo_calls(exact):
    """Ragged cached lengths and new-row counts, causal, short-form and full-form masks: every real row's logits,
    hidden states, cache length and cached K/V equal the same row's B = 1 calls."""
    drafter = eagle3(exact)
    calls = [
        Rows([5, 2, 7], 3 * TARGET_HIDDEN, 1),
        Rows([3, 1, 2], 3 * TARGET_HIDDEN, 2),
        Rows([2, 3, 1], 3 * TARGET_HIDDEN, 3),
        Rows([1, 2, 2], 3 * TARGET_HIDDEN, 4),
    ]
    masks = [None, None, ("short", siblings), ("full", tree_rows)]
    cache = drafter.new_cache(32, batch_size=3)
    batched = eagle3_calls(drafter, cache, calls, masks, None)
    for b in range(3):
        alone = drafter.new_cache(32)
        solo = eagle3_calls(drafter, alone, calls, masks, b)
        for (logits, hidden), (solo_logits, solo_hidden), rows_in in zip(batched, solo, calls):
            n = rows_in.counts[b]
            same(logits[b, :n], solo_logits[0], exact)
            same(hidden[b, :n], solo_hidden[0], exact)
        assert int(cache.lengths[b]) == alone.length == sum(c.counts[b] for c in calls)
        held = alone.length
        same(cache.k[0][b, :, :held], alone.k[0][0, :, :held], exact)
        same(cache.v[0][b, :, :held], alone.v[0][0, :, :held], exact)


@pytest.mark.parametrize("exact", EXACT)
def test_eagle3_row_ignores_its_neighbours(exact):
    """Changing another row's tokens and features (same counts, so the same call shapes) leaves a row's outputs
    bitwise the same, in both modes; a row's pads never enter its cache (slots past its length stay untouched)."""
    drafter = eagle3(exact)
    outputs = []
    for seed in (1, 2):
        calls = [Rows([4, 6], 3 * TARGET_HIDDEN, 0), Rows([2, 1], 3 * TARGET_HIDDEN, 5)]
        for call in calls:  # row 1's inputs differ between the two runs
            other = Rows(call.counts, 3 * TARGET_HIDDEN, seed)
            call.tokens[1], call.features[1] = other.tokens[1], other.features[1]
        cache = drafter.new_cache(16, batch_size=2)
        outputs.append(eagle3_calls(drafter, cache, calls, [None, None], None))
        assert cache.lengths.tolist() == [6, 7]
        assert not cache.k[0][0, :, 6:].any() and not cache.v[0][1, :, 7:].any()  # pads never written
    for (logits, hidden), (other_logits, other_hidden) in zip(*outputs):
        assert torch.equal(logits[0], other_logits[0]) and torch.equal(hidden[0], other_hidden[0])
        assert not torch.equal(logits[1], other_logits[1])


def test_eagle3_bad_calls_name_the_fix():
    drafter = eagle3(False)
    cache = drafter.new_cache(4, batch_size=2)
    tokens, hidden, positions = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, HIDDEN), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"got 2 rows but the drafter cache holds 1; .*batch_size=2"):
        drafter.step(tokens, hidden, positions.long(), drafter.new_cache(4))
    with pytest.raises(ValueError, match=r"counts must be 2 numbers in 0..3"):
        drafter.step(tokens, hidden, positions.long(), cache, counts=torch.tensor([4, 1]))
    with pytest.raises(ValueError, match=r"drafter mask must be \[B, 3, 3\] .* or \[B, 3, 3\] .*got \(2, 3, 5\)"):
        drafter.step(tokens, hidden, positions.long(), cache, torch.ones(2, 3, 5, dtype=torch.bool))
    drafter.step(tokens, hidden, positions.long(), cache, counts=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match=r"drafter cache overflow: 5 rows needed, capacity 4; .*larger max_len"):
        drafter.step(tokens[:, :2], hidden[:, :2], positions[:, :2].long(), cache)
    with pytest.raises(ValueError, match=r"rows hold different lengths \[3, 1\]; read .lengths"):
        assert cache.length is None  # raises first
    with pytest.raises(ValueError, match="truncate drafter cache row 1 to 2 but it holds 1 rows"):
        cache.truncate(2)


# -- SpecBlock ---------------------------------------------------------------------------------------------------


def specblock(exact: bool) -> SpecBlockDrafter:
    torch.manual_seed(0)
    config = SpecBlockConfig(
        **SHAPE, target_hidden_size=TARGET_HIDDEN, aux_layer_ids=[1, 2, 3], block_size=3, num_layers=2
    )
    return randomised(SpecBlockDrafter(config, embed_weight=torch.randn(VOCAB, HIDDEN)), exact)


@pytest.mark.parametrize("exact", EXACT)
def test_specblock_rows_equal_their_solo_calls(exact):
    """``extend_and_draft`` over ragged rows (a row with no new anchor in the third call): each row's last block
    (logits, rank logits, hidden, its K/V), anchor count and cross-cache entries equal the same row's B = 1
    calls."""
    drafter = specblock(exact)
    calls = [
        Rows([5, 2, 7], 3 * TARGET_HIDDEN, 1),
        Rows([3, 1, 2], 3 * TARGET_HIDDEN, 2),
        Rows([2, 0, 1], 3 * TARGET_HIDDEN, 3),
    ]
    cache = drafter.new_cache(16, batch_size=3)
    with torch.no_grad():
        batched = [
            drafter.extend_and_draft(drafter_features, tokens, cache, counts=counts.tolist())
            for tokens, drafter_features, counts in (call.batch() for call in calls)
        ]
        for b in range(3):
            alone = drafter.new_cache(16)
            for call, out in zip(calls, batched):
                n = call.counts[b]
                if n == 0:
                    continue
                solo = drafter.extend_and_draft(call.features[b][None], call.tokens[b][None], alone)
                for got, want in [
                    (out.logits, solo.logits),
                    (out.rank_logits, solo.rank_logits),
                    (out.hidden, solo.hidden),
                    *zip(out.kv.k, solo.kv.k),
                    *zip(out.kv.v, solo.kv.v),
                ]:
                    same(got[b], want[0], exact)
            assert cache.row_anchors[b] == alone.anchors == sum(call.counts[b] for call in calls)
            held = alone.length
            for layer in range(2):
                same(cache.k[layer][b, :, :held], alone.k[layer][0, :, :held], exact)
                same(cache.v[layer][b, :, :held], alone.v[layer][0, :, :held], exact)


@pytest.mark.parametrize("exact", EXACT)
def test_specblock_later_blocks_of_rows_equal_their_solo_calls(exact):
    """``forward_leaves`` over ragged rows (2, 0 and 3 leaves; 6, 0 and 3 TTT entries, each leaf seeing some):
    each row's leaves get what the row's one-row call against its own cache gets."""
    drafter = specblock(exact)
    k, heads, dim = 3, 2, HIDDEN // 4
    call = Rows([5, 2, 7], 3 * TARGET_HIDDEN, 1)
    cache = drafter.new_cache(16, batch_size=3)
    generator = torch.Generator().manual_seed(4)
    leaves, entries = [2, 0, 3], [2 * k, 0, k]
    cond = [torch.randn(n, HIDDEN, generator=generator) for n in leaves]
    tokens = [torch.randint(0, VOCAB - 1, (n,), generator=generator) for n in leaves]
    valid = [torch.randint(1, k + 1, (n,), generator=generator) for n in leaves]
    ttt = [
        BlockKV(
            [torch.randn(1, heads, e, dim, generator=generator) for _ in range(2)],
            [torch.randn(1, heads, e, dim, generator=generator) for _ in range(2)],
        )
        for e in entries
    ]
    visible = [torch.rand(n, e, generator=generator) < 0.5 for n, e in zip(leaves, entries)]
    width, most = max(leaves), max(entries)
    padded_ttt = BlockKV(
        [torch.zeros(3, heads, most, dim) for _ in range(2)], [torch.zeros(3, heads, most, dim) for _ in range(2)]
    )
    padded_visible = torch.zeros(3, width, most, dtype=torch.bool)
    for b, (n, e) in enumerate(zip(leaves, entries)):
        for layer in range(2):
            padded_ttt.k[layer][b, :, :e], padded_ttt.v[layer][b, :, :e] = ttt[b].k[layer][0], ttt[b].v[layer][0]
        padded_visible[b, :n, :e] = visible[b]
    with torch.no_grad():
        batch_tokens, batch_features, counts = call.batch()
        drafter.extend_and_draft(batch_features, batch_tokens, cache, counts=counts.tolist())
        out = drafter.forward_leaves(
            padded(cond),
            padded(tokens),
            cache,
            current_valid=padded(valid),
            ttt=padded_ttt,
            ttt_visible=padded_visible,
            counts=leaves,
            ttt_counts=entries,
        )
        for b, (n, e) in enumerate(zip(leaves, entries)):
            if n == 0:
                continue
            alone = drafter.new_cache(16)
            drafter.extend_and_draft(call.features[b][None], call.tokens[b][None], alone)
            solo = drafter.forward_leaves(
                cond[b][None],
                tokens[b][None],
                alone,
                current_valid=valid[b],
                ttt=ttt[b] if e else None,
                ttt_visible=visible[b] if e else None,
            )
            for got, want in [
                (out.logits, solo.logits),
                (out.rank_logits, solo.rank_logits),
                (out.hidden, solo.hidden),
            ]:
                same(got[b, :n], want[0], exact)
            for got, want in [*zip(out.kv.k, solo.kv.k), *zip(out.kv.v, solo.kv.v)]:
                same(got[b, :, : n * k], want[0], exact)


def test_specblock_bad_calls_name_the_fix():
    drafter = specblock(False)
    tokens, features = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 3 * TARGET_HIDDEN)
    with pytest.raises(ValueError, match=r"got 2 rows but the cross cache holds 1; .*batch_size=2"):
        drafter.extend_and_draft(features, tokens, drafter.new_cache(4))
    cache = drafter.new_cache(4, batch_size=2)
    with pytest.raises(ValueError, match=r"counts must be 2 numbers in 0..9"):
        drafter.extend_and_draft(features, tokens, cache, counts=[4, 1])
    drafter.extend_and_draft(features, tokens, cache, counts=[3, 1])
    with pytest.raises(ValueError, match=r"SpecBlock cross cache overflow: 15 entries needed, capacity 12"):
        drafter.extend_and_draft(features[:, :2], tokens[:, :2], cache)
    with pytest.raises(ValueError, match=r"rows hold different lengths \[9, 3\]; read .lengths"):
        assert cache.anchors is None  # raises first
    with pytest.raises(ValueError, match=r"got 2 rows and counts \[1\] for a cross cache of 2 rows; give one count"):
        drafter.forward_leaves(
            torch.zeros(2, 1, HIDDEN), tokens[:, :1], cache, current_valid=torch.ones(2, 1), counts=[1]
        )


# -- the cache itself ----------------------------------------------------------------------------------------------


def test_row_kv_append_truncate_and_masks():
    """Row b writes counts[b] rows at its own length; truncation is per row; the single-row API still works."""
    cache = RowKV.empty(2, 3, 1, 6, 2, torch.zeros(()))
    new = torch.arange(1.0, 13.0).view(3, 1, 4, 1).expand(3, 1, 4, 2)
    cache.append([(new, -new), (2 * new, new)], torch.tensor([2, 0, 4]))
    assert cache.lengths.tolist() == [2, 0, 4] and cache.longest == 4
    assert cache.k[0][0, 0, :, 0].tolist() == [1, 2, 0, 0, 0, 0] and not cache.k[1][1].any()
    cache.truncate(torch.tensor([1, 0, 3]))
    cache.append([(new, new), (new, new)], torch.tensor([1, 2, 3]))
    assert cache.lengths.tolist() == [2, 2, 6]
    assert cache.k[0][2, 0, :, 0].tolist() == [9, 10, 11, 9, 10, 11] and cache.v[0][1, 0, :, 0].tolist()[:3] == [
        5,
        6,
        0,
    ]
    assert cache.key_mask(2).shape == (3, 2, 6) and cache.key_mask()[:, 0].sum(-1).tolist() == [2, 2, 6]
    with pytest.raises(ValueError, match="overflow: 7 rows needed, capacity 6; build it with a larger max_len"):
        cache.append([(new[:, :, :1], new[:, :, :1])] * 2)
    cache.truncate(1)
    assert cache.length == 1 and [k.shape[2] for k, _ in cache.view()] == [1, 1]


# -- P-EAGLE -------------------------------------------------------------------------------------------------------


def peagle_draft(drafter: PEagleDrafter, cache: RowKV, rows_in: Rows, depths: int, row: int | None) -> torch.Tensor:
    tokens, features, counts = rows_in.batch()
    with torch.no_grad():
        if row is None:
            return drafter.draft(cache, features, tokens, depths, counts)
        n = rows_in.counts[row]
        return drafter.draft(cache, features[row : row + 1, :n], tokens[row, :n].tolist(), depths)


@pytest.mark.parametrize("exact", EXACT)
def test_peagle_rows_equal_their_solo_calls(exact):
    """Ragged committed rows each round (a row with none sits a round out), K and fewer depths: each row's draft
    logits equal its B = 1 draft; the mask rows leave every row's cache at its committed length."""
    drafter = eagle3(exact, PEagleDrafter, mask_token_id=7, num_depths=4)
    rounds = [
        (Rows([4, 1, 6], 3 * TARGET_HIDDEN, 1), 4),
        (Rows([1, 3, 2], 3 * TARGET_HIDDEN, 2), 2),
        (Rows([2, 0, 1], 3 * TARGET_HIDDEN, 3), 4),
        (Rows([1, 2, 1], 3 * TARGET_HIDDEN, 4), 3),
    ]
    cache = drafter.new_cache(32, batch_size=3)
    batched = [peagle_draft(drafter, cache, rows_in, depths, None) for rows_in, depths in rounds]
    assert cache.lengths.tolist() == [8, 6, 10]
    for b in range(3):
        alone = drafter.new_cache(32)
        for (rows_in, depths), logits in zip(rounds, batched):
            if rows_in.counts[b] == 0:
                continue
            solo = peagle_draft(drafter, alone, rows_in, depths, b)
            assert logits.shape == (3, depths, DRAFT_VOCAB)
            same(logits[b], solo[0], exact)
        assert alone.length == int(cache.lengths[b])


# -- DFlash --------------------------------------------------------------------------------------------------------


def dflash_draft(drafter: DFlashDrafter, cache: RowKV, rows_in: Rows, row: int | None) -> torch.Tensor:
    tokens, features, counts = rows_in.batch()
    anchors = torch.tensor([int(t[-1]) if len(t) else 3 for t in rows_in.tokens])
    with torch.no_grad():
        if row is None:
            return drafter.draft(cache, features, anchors, counts)
        n = rows_in.counts[row]
        return drafter.draft(cache, features[row : row + 1, :n], int(anchors[row]))


@pytest.mark.parametrize("exact", EXACT)
def test_dflash_rows_equal_their_solo_calls(exact):
    """Ragged contexts (one row with none yet) and ragged new positions: each row's block logits equal its B = 1
    draft, and its context cache holds exactly its own positions."""
    drafter = dflash(exact)
    rounds = [Rows([6, 3, 0], 2 * HIDDEN, 1), Rows([2, 4, 1], 2 * HIDDEN, 2), Rows([1, 1, 3], 2 * HIDDEN, 3)]
    cache = drafter.new_cache(32, batch_size=3)
    batched = [dflash_draft(drafter, cache, rows_in, None) for rows_in in rounds]
    assert cache.lengths.tolist() == [9, 8, 4]
    for b in range(3):
        alone = drafter.new_cache(32)
        for rows_in, logits in zip(rounds, batched):
            same(logits[b], dflash_draft(drafter, alone, rows_in, b)[0], exact)
        held = alone.length
        for layer in range(2):
            same(cache.k[layer][b, :, :held], alone.k[layer][0, :, :held], exact)
        assert not cache.k[0][b, :, held:].any()  # pads never written


def test_row_exact_mode_is_refused_where_it_cannot_hold():
    drafter = eagle3(False)
    drafter.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="MLP uses gelu; leave row_exact off"):
        drafter.set_row_exact(True)
