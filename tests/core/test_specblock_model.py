"""SpecBlock drafter (docs/algorithms/specblock.md §3–4, §10 tests 1, 2, 6, 7, 8): rank features, buckets, shift, masks, train/serve
parity, native export round trip and target checks."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_targets import set_random_vocab_map
from transformers import LlamaConfig, LlamaForCausalLM

from core.assets import target_record
from core.drafters.specblock import (
    BlockKV,
    SpecBlockConfig,
    SpecBlockDrafter,
    first_block_mask,
    later_block_mask,
    load_native,
    rank_bucket,
    rank_features,
    save_native,
    shift_slots,
)
from inference.drafters import LoadedModel
from core.drafters.specblock.kind import load_specblock
from inference.runner import ModelRunner

VOCAB, AUX, K = 97, [0, 1, 2], 4


def target_config(layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )


def make_drafter(*, draft_vocab: int = VOCAB, seed: int = 0, dtype=torch.float32, **overrides) -> SpecBlockDrafter:
    """A random drafter (norms randomised too, so a swapped norm shows) with a reduced vocab when Vd < V."""
    config = SpecBlockConfig.for_target(target_config(), draft_vocab_size=draft_vocab, aux_layer_ids=AUX, **overrides)
    torch.manual_seed(seed)
    drafter = SpecBlockDrafter(config, embed_weight=torch.randn(VOCAB, 32))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)
    if draft_vocab < VOCAB:
        set_random_vocab_map(drafter, VOCAB, draft_vocab)
    return drafter.to(dtype).eval()


def test_rank_features_by_hand():
    logits = torch.tensor([3.0, -1.0, 0.5, 2.0, 0.0, 1.0, -2.0] + [-3.0 - 0.25 * i for i in range(23)])
    top = sorted(logits.tolist(), reverse=True)[:20]
    log_z = math.log(sum(math.exp(x) for x in top))
    pi = [math.exp(x - log_z) for x in top]
    expected = [x - log_z for x in top[:10]] + [
        top[0] - top[1],
        top[0] - top[2],
        top[0] - top[4],
        pi[0],
        -sum(p * math.log(p) for p in pi),
    ]
    got = rank_features(logits[None, None])
    assert got.shape == (1, 1, 15)
    torch.testing.assert_close(got[0, 0], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert expected[10:13] == [1.0, 2.0, 3.0]  # gaps 3-2, 3-1, 3-0 (the hand-built vector)
    # A draft vocabulary smaller than 20: padded entries carry zero probability, everything stays finite.
    small = rank_features(torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, 0.2]]))
    probs = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, 0.2]).softmax(-1)
    assert torch.isfinite(small).all()
    torch.testing.assert_close(small[0, 14], -(probs * probs.log()).sum(), rtol=1e-5, atol=1e-6)


def test_rank_loss_trains_only_the_rank_head():
    drafter = make_drafter().train()
    out = drafter.forward_block(torch.randn(1, 5, 96), torch.randint(0, VOCAB, (1, 5)), from_target=True)
    torch.nn.functional.cross_entropy(out.rank_logits.flatten(0, 2), torch.randint(0, 4, (20,))).backward()
    head = {id(p) for p in drafter.rank_head.parameters()}
    for name, param in drafter.named_parameters():
        if id(param) in head:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None or not param.grad.any(), name
    assert {id(p) for p in drafter.head_parameters()} == head | {id(drafter.lm_head.weight)}


def test_rank_buckets():
    assert rank_bucket(torch.tensor([1, 2, 4, 5, 10, 11, 500])).tolist() == [0, 1, 1, 2, 2, 3, 3]


def test_shift_op_stays_inside_each_anchor():
    z = torch.arange(2 * 3 * K * 2, dtype=torch.float).view(2, 3, K, 2)  # [B, anchors, K, H]
    shifted = shift_slots(z)
    assert torch.equal(shifted[:, :, 0], z[:, :, 0])  # slot 0 is paired with itself
    assert torch.equal(shifted[:, :, 1:], z[:, :, :-1])  # slot k gets slot k - 1 of the SAME anchor
    # Through the model: slot 0 is paired with itself and slot k only with k - 1 (never a wrap-around from slot
    # K - 1), so perturbing the last slot's position query moves only the last slot.
    drafter = make_drafter()
    cond, tokens = torch.randn(1, 2, 96), torch.randint(0, VOCAB, (1, 2))
    with torch.no_grad():
        before = drafter.forward_block(cond, tokens, from_target=True).hidden
        drafter.position_queries[K - 1] += 1.0
        after = drafter.forward_block(cond, tokens, from_target=True).hidden
    torch.testing.assert_close(after[:, 0, : K - 1], before[:, 0, : K - 1])
    assert not torch.allclose(after[:, :, K - 1], before[:, :, K - 1])


def test_identity_init_shift_returns_its_first_input_and_fusion_passes_the_condition_through():
    config = SpecBlockConfig.for_target(target_config(), draft_vocab_size=VOCAB, aux_layer_ids=AUX, num_layers=3)
    torch.manual_seed(0)
    random = SpecBlockDrafter(config, embed_weight=torch.randn(VOCAB, 32))
    torch.manual_seed(0)
    drafter = SpecBlockDrafter(config, embed_weight=torch.randn(VOCAB, 32))
    rng = torch.get_rng_state()
    drafter.init_weights_("identity")
    assert torch.equal(torch.get_rng_state(), rng)  # draws nothing: the rest of a seeded run is unchanged
    x, y = torch.randn(2, 5, K, 32), torch.randn(2, 5, K, 32)
    for shift in drafter.shift:  # [I | 0]: the slot's own state, its partner ignored
        assert torch.equal(shift(torch.cat([x, y], dim=-1)), x)
    w_c, w_e, w_q = drafter.fuse.weight.split(32, dim=1)
    c = torch.randn(3, 32)
    assert torch.equal(torch.nn.functional.linear(c, w_c), c)
    assert torch.equal(drafter.fuse(torch.cat([c, torch.zeros(3, 64)], dim=-1)), c)
    # the token and position-query blocks, and every other tensor, keep their random init
    r_c, r_e, r_q = random.fuse.weight.split(32, dim=1)
    assert torch.equal(w_e, r_e) and torch.equal(w_q, r_q) and not torch.equal(w_c, r_c)
    changed = {name for name, t in drafter.state_dict().items() if not torch.equal(t, random.state_dict()[name])}
    assert changed == {"fuse.weight", "shift.0.weight", "shift.1.weight"}
    # in the trunk: layer l >= 1 reads exactly what layer l - 1 wrote (the shift is the identity on it)
    seen = []
    hooks = [
        layer.register_forward_hook(lambda _m, args, out: seen.append((args[0], out[0]))) for layer in drafter.layers
    ]
    with torch.no_grad():
        drafter.forward_block(torch.randn(1, 4, 96), torch.randint(0, VOCAB, (1, 4)), from_target=True)
    for hook in hooks:
        hook.remove()
    assert len(seen) == 3 and all(torch.equal(seen[i + 1][0], seen[i][1]) for i in range(2))
    # "random" is the default: it leaves the drafter bitwise as built; anything else is refused in one line
    random.init_weights_("random")
    torch.manual_seed(0)
    fresh = SpecBlockDrafter(config, embed_weight=torch.randn(VOCAB, 32))
    assert all(torch.equal(t, fresh.state_dict()[name]) for name, t in random.state_dict().items())
    with pytest.raises(ValueError, match="init='zeros' is not one of random, identity"):
        drafter.init_weights_("zeros")


def brute_force_mask(anchors: int, k: int, block: int, cuts: list[int], other_anchors: bool) -> torch.Tensor:
    """§4 written out: keys are [first block] + [one group per previous block] + [this block] (block >= 2)."""
    groups = ([] if block == 1 else ["first"] + [("ttt", m) for m in cuts]) + ["own"]
    rows = []
    for i in range(anchors):
        for s in range(k):
            row = []
            for group in groups:
                for j in range(anchors):
                    for t in range(k):
                        if group == "own" and block == 1:
                            ok = j < i or (j == i and t <= s)
                        elif group == "own":
                            ok = (j == i and t <= s) or (other_anchors and j < i)
                        elif group == "first":
                            ok = j < i
                        else:
                            ok = j == i and t < group[1]
                        row.append(ok)
            rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("other_anchors", [False, True])
def test_attention_masks_equal_brute_force(other_anchors):
    anchors, cuts = 3, [3, 1]
    assert torch.equal(first_block_mask(anchors, K), brute_force_mask(anchors, K, 1, [], other_anchors))
    for block in (2, 3):
        got = later_block_mask(anchors, K, first_block=True, ttt_valid=cuts[: block - 1], other_anchors=other_anchors)
        assert torch.equal(got, brute_force_mask(anchors, K, block, cuts[: block - 1], other_anchors)), block


@pytest.mark.parametrize("draft_vocab", [VOCAB, 40])
def test_train_serve_parity(draft_vocab):
    """Training-mode blocks == serving (prefill + incremental extend_and_draft, then forward_leaves) for the last
    anchor (block 1) and for anchor 0 and the last anchor (blocks 2 and 3), fp32 atol 1e-5."""
    drafter = make_drafter(draft_vocab=draft_vocab)
    seq, cuts = 7, [2, 3]
    features, tokens = torch.randn(1, seq, 96), torch.randint(0, VOCAB, (1, seq))
    with torch.no_grad():
        blocks = [drafter.forward_block(features, tokens, from_target=True)]
        toks = [tokens]
        for b, cut in enumerate(cuts):
            toks.append(torch.roll(toks[-1], -cut, dims=1))  # row i: the token at the leaf (wrap rows unused)
            blocks.append(
                drafter.forward_block(
                    blocks[-1].hidden[:, :, cut - 1],
                    toks[-1],
                    from_target=False,
                    first_block_kv=blocks[0].kv,
                    ttt_kv=[x.kv for x in blocks],
                    ttt_valid=cuts[: b + 1],
                )
            )

    # block 1, last anchor: prefill 4 anchors, then 1, then 2 (incremental extends)
    cache = drafter.new_cache(seq)
    for start, end in ((0, 4), (4, 5), (5, 7)):
        served = drafter.extend_and_draft(features[:, start:end], tokens[:, start:end], cache)
        torch.testing.assert_close(served.logits[0, 0], blocks[0].logits[0, end - 1], rtol=0, atol=1e-5)
        torch.testing.assert_close(served.rank_logits[0, 0], blocks[0].rank_logits[0, end - 1], rtol=0, atol=1e-5)
    assert served.logits.shape == (1, 1, K, draft_vocab) and cache.anchors == seq

    for anchor in (0, seq - 1):
        cache = drafter.new_cache(seq)
        first = drafter.extend_and_draft(features[:, : anchor + 1], tokens[:, : anchor + 1], cache)
        leaf = drafter.forward_leaves(
            first.hidden[:, :, cuts[0] - 1],
            toks[1][:, anchor : anchor + 1],
            cache,
            current_valid=torch.tensor([cuts[0]]),
        )
        torch.testing.assert_close(leaf.logits[0, 0], blocks[1].logits[0, anchor], rtol=0, atol=1e-5)
        visible = (torch.arange(K) < cuts[1])[None]
        third = drafter.forward_leaves(
            leaf.hidden[:, :, cuts[1] - 1],
            toks[2][:, anchor : anchor + 1],
            cache,
            current_valid=torch.tensor([cuts[0]]),
            ttt=leaf.kv,
            ttt_visible=visible,
        )
        torch.testing.assert_close(third.logits[0, 0], blocks[2].logits[0, anchor], rtol=0, atol=1e-5)
        torch.testing.assert_close(third.hidden[0, 0], blocks[2].hidden[0, anchor], rtol=0, atol=1e-5)


def test_training_quirk_flag_changes_only_later_blocks():
    plain, quirk = make_drafter(), make_drafter(train_block2_sees_other_anchors=True)
    features, tokens = torch.randn(1, 4, 96), torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        a, b = (d.forward_block(features, tokens, from_target=True) for d in (plain, quirk))
        torch.testing.assert_close(a.logits, b.logits)
        a2, b2 = (
            d.forward_block(
                x.hidden[:, :, 0], tokens, from_target=False, first_block_kv=x.kv, ttt_kv=[x.kv], ttt_valid=[1]
            )
            for d, x in ((plain, a), (quirk, b))
        )
    torch.testing.assert_close(a2.logits[:, 0], b2.logits[:, 0])  # anchor 0 has no other anchors
    assert not torch.allclose(a2.logits[:, 1:], b2.logits[:, 1:])


def test_block_kv_keeps_grad_and_bad_arguments_are_one_line_errors():
    drafter = make_drafter().train()
    out = drafter.forward_block(torch.randn(2, 3, 96), torch.randint(0, VOCAB, (2, 3)), from_target=True)
    assert isinstance(out.kv, BlockKV) and out.kv.entries == 3 * K and out.kv.k[0].requires_grad
    assert out.logits.shape == (2, 3, K, VOCAB) and out.hidden.shape == (2, 3, K, 32)
    with pytest.raises(ValueError, match="ttt_kv has 1 blocks but ttt_valid 0"):
        drafter.forward_block(
            out.hidden[:, :, 0], torch.zeros(2, 3, dtype=torch.long), from_target=False, ttt_kv=[out.kv]
        )
    with pytest.raises(ValueError, match=r"ttt_valid cuts must lie in 1..K=4"):
        drafter.forward_block(
            out.hidden[:, :, 0], torch.zeros(2, 3, dtype=torch.long), from_target=False, ttt_kv=[out.kv], ttt_valid=[5]
        )
    with pytest.raises(ValueError, match="unknown specblock config fields"):
        SpecBlockConfig.from_dict({**drafter.config.to_dict(), "depth": 3})
    with pytest.raises(ValueError, match="widths must give 4"):
        SpecBlockConfig.from_dict({**drafter.config.to_dict(), "widths": [2, 4]})
    assert SpecBlockConfig.from_dict(drafter.config.to_dict()) == drafter.config


def test_native_round_trip(tmp_path):
    drafter = make_drafter(draft_vocab=40)
    target = {"name": "tiny", "config_hash": "c", "weights_hash": "w", "num_hidden_layers": 4, "hidden_size": 32}
    out = save_native(
        drafter,
        tmp_path / "sb",
        target=target,
        recipe={"kind": "specblock", "lr": 5e-5},
        metrics={"val/tau_sim": 2.0},
        extra={"trained_blocks": 3},
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.json", "model.safetensors", "recipe.yaml"]
    embed = drafter.embed_tokens.weight
    loaded = load_native(out, embed_weight=embed).eval()
    own = {k: v for k, v in drafter.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, own[name]), name
    features, tokens = torch.randn(1, 3, 96), torch.randint(0, VOCAB, (1, 3))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.forward_block(features, tokens, from_target=True).logits,
            drafter.forward_block(features, tokens, from_target=True).logits,
        )
    from safetensors.torch import load_file

    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))  # the frozen embedding stays out
    import json

    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert (block["kind"], block["block_size"], block["num_layers"], block["widths"]) == (
        "specblock",
        K,
        2,
        [2, 4, 6, 4],
    )
    assert block["vocab"] == {"vocab_size": VOCAB, "draft_vocab_size": 40} and block["trained_blocks"] == 3
    with pytest.raises(ValueError, match="already exists"):
        save_native(drafter, out, target=target)
    with pytest.raises(ValueError, match="not a SpecBlock export"):
        load_native(tmp_path)


def tiny_target(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(target_config()).eval()


def test_load_specblock_runs_only_on_its_target(tmp_path):
    model = tiny_target(0)
    model.save_pretrained(tmp_path / "target")
    drafter = make_drafter(draft_vocab=40)
    out = save_native(drafter, tmp_path / "sb", target=target_record(str(tmp_path / "target")))
    target = LoadedModel(str(tmp_path / "target"), ModelRunner.from_hf_model(model, max_seq_len=32), None, model)
    loaded = load_specblock(str(out), target)
    assert loaded.embed_tokens.weight.data_ptr() == target.runner.embed_tokens.weight.data_ptr()  # shared
    other_model = tiny_target(5)
    other_model.save_pretrained(tmp_path / "other")  # same config, other weights
    other = LoadedModel(str(tmp_path / "other"), ModelRunner.from_hf_model(other_model, max_seq_len=32), None, None)
    with pytest.raises(ValueError, match=r"was trained for target '.*target' \(config \w+, weights \w+\), not"):
        load_specblock(str(out), other)
