"""kind=specblock training (docs/algorithms/specblock.md §5, §10): losses by hand, cross-block alignment,
the LightningModule on a tiny target, recipes, and fit -> export -> load."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from specblock_builders import tiny_drafter

from core.errors import UserError

from spectrain.kinds.specblock.losses import (
    VALID_PREFIX,
    block_losses,
    frequency_weights,
    rank_labels,
    rank_of,
    smoothing_table,
    total_loss,
    unroll_blocks,
)


def one_hot_rows(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor([ids]), vocab).float()  # [1, S, V]


# ---------------------------------------------------------------------------------------------------------
# §10 test 3: smoothing table


def test_smoothing_table_rows_sum_to_one_and_match_spec():
    table = smoothing_table()
    spec = torch.tensor(
        [
            [0.7024, 0.1756, 0.0780, 0.0439],
            [0.0755, 0.6792, 0.1698, 0.0755],
            [0.0285, 0.0793, 0.7137, 0.1784],
            [0.0174, 0.0341, 0.0948, 0.8536],
        ]
    )
    assert torch.allclose(table.sum(-1), torch.ones(4), atol=1e-6)
    assert torch.allclose(table, spec, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# §10 test 5: frequency weights


def test_frequency_weights_are_min_one_budget_over_count():
    labels = torch.tensor([0] * 20 + [1] * 5 + [2] * 10 + [3] * 7)
    valid = torch.ones_like(labels, dtype=torch.bool)
    valid[-7:] = False  # invalid samples are not counted: class 3 has no samples -> weight 1
    assert frequency_weights(labels, valid, 10.0).tolist() == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert frequency_weights(labels, torch.ones_like(valid), 4.0).tolist() == pytest.approx([0.2, 0.8, 0.4, 4 / 7])
    assert frequency_weights(labels, valid, 0.0).tolist() == [1.0, 1.0, 1.0, 1.0]  # budget <= 0 disables


def test_rank_of_searches_the_top_ten():
    logits = torch.arange(20, 0, -1).float()  # token j has rank j + 1
    ids = torch.tensor([0, 1, 3, 4, 9, 10, 19])
    assert rank_of(logits.expand(7, 20), ids).tolist() == [1, 2, 4, 5, 10, 11, 11]
    assert rank_labels(logits.expand(7, 20), ids).tolist() == [0, 1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------------------------------------------------
# §10 test 4: valid-prefix mask


def test_valid_prefix_wrong_slot_one_zeroes_later_slots_loss_and_gradient():
    vocab, seq = 6, [1, 2, 3, 4, 5, 1]
    teacher = one_hot_rows(seq, vocab)
    pm = torch.ones(1, len(seq), dtype=torch.bool)
    logits = torch.zeros(1, len(seq), 4, vocab)
    for i in range(len(seq)):
        logits[0, i, 0, seq[i]] = 5.0  # slot 0 right
        logits[0, i, 1, 0] = 5.0  # slot 1 wrong (token 0 never occurs)
        for k in (2, 3):  # slots 2-3 right: they still must not count
            if i + k < len(seq):
                logits[0, i, k, seq[i + k]] = 5.0
    logits.requires_grad_(True)
    out = block_losses(logits, torch.zeros(1, len(seq), 4, 4), teacher, pm, 0)
    assert out.draft[0] > 0 and out.draft[1] > 0
    assert out.draft[2] == 0 and out.draft[3] == 0
    assert not out.draft_weight[..., 2:].any()
    out.draft.sum().backward()
    assert logits.grad[:, :, :2].abs().sum() > 0
    assert torch.equal(logits.grad[:, :, 2:], torch.zeros_like(logits.grad[:, :, 2:]))
    # the same logits with slot 1 right: every in-range slot counts
    fixed = logits.detach().clone()
    for i in range(len(seq) - 1):
        fixed[0, i, 1] = 0.0
        fixed[0, i, 1, seq[i + 1]] = 5.0
    weights = block_losses(fixed, torch.zeros(1, len(seq), 4, 4), teacher, pm, 0).draft_weight
    assert weights[0, :, 3].tolist() == [1, 1, 1, 0, 0, 0]  # anchor i slot 3 reads row i + 3


def _prefix_case():
    """8 rows, row 2 not supervised; slot k of anchor i greedy-right unless (7i + 3k) % 4 == 0, plus noise."""
    vocab, seq = 6, [1, 2, 3, 4, 5, 1, 2, 3]
    n = len(seq)
    teacher = one_hot_rows(seq, vocab)
    pm = torch.ones(1, n, dtype=torch.bool)
    pm[0, 2] = False
    generator = torch.Generator().manual_seed(0)
    logits = 0.5 * torch.randn(1, n, 4, vocab, generator=generator)
    for i in range(n):
        for k in range(4):
            right = (7 * i + 3 * k) % 4 != 0 and i + k < n
            logits[0, i, k, seq[i + k] if right else 0] += 5.0  # token 0 never occurs: a miss
    return logits, teacher, pm, seq


def _hand_prefix(logits, teacher, pm, seq):
    """Per slot, written out: the valid rows, the valid-prefix chain weights, and each row's soft CE."""
    n = len(seq)
    valid = [[bool(pm[0, i + k]) if i + k < n else False for i in range(n)] for k in range(4)]
    chain, weights, ces = [bool(pm[0, i]) for i in range(n)], [], []
    for k in range(4):
        weights.append([float(chain[i] and valid[k][i]) for i in range(n)])
        ces.append(
            [
                float(-(teacher[0, i + k] * logits[0, i, k].log_softmax(-1)).sum()) if i + k < n else 0.0
                for i in range(n)
            ]
        )
        chain = [chain[i] and i + k < n and int(logits[0, i, k].argmax()) == seq[i + k] for i in range(n)]
    anchored = [[float(pm[0, i] and valid[k][i]) for i in range(n)] for k in range(4)]
    return weights, anchored, ces


@pytest.mark.parametrize("mode", VALID_PREFIX)
def test_valid_prefix_modes_weigh_and_normalise_as_stated(mode):
    logits, teacher, pm, seq = _prefix_case()
    chain_w, valid_w, ces = _hand_prefix(logits, teacher, pm, seq)
    out = block_losses(logits, torch.zeros(1, len(seq), 4, 4), teacher, pm, 0, valid_prefix=mode)
    # chain and slot0_norm keep the valid-prefix weights; valid drops the chain (w = anchor valid · row valid)
    weights = valid_w if mode == "valid" else chain_w
    assert out.draft_weight[0].T.tolist() == weights
    assert 0 < sum(chain_w[3]) < sum(chain_w[1]) < sum(valid_w[1])  # the chain does thin the later slots here
    # the normaliser: each slot's own weighted rows, or slot 0's row count for every slot
    counts = [sum(weights[0]) if mode == "slot0_norm" else sum(weights[k]) for k in range(4)]
    assert out.draft_count.tolist() == counts
    expected = [sum(w * c for w, c in zip(weights[k], ces[k])) / counts[k] for k in range(4)]
    torch.testing.assert_close(out.draft, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # what the metrics count does not depend on the mode
    assert out.slot_valid[0].T.tolist() == [[bool(v) for v in row] for row in valid_w]
    if mode == "chain":  # the default is the reference, bitwise
        default = block_losses(logits, torch.zeros(1, len(seq), 4, 4), teacher, pm, 0)
        assert torch.equal(default.draft, out.draft) and torch.equal(default.draft_weight, out.draft_weight)


def test_valid_prefix_mode_leaves_the_rank_loss_and_refuses_unknown_modes():
    logits, teacher, pm, seq = _prefix_case()
    rank_logits = torch.randn(1, len(seq), 4, 4, generator=torch.Generator().manual_seed(1))
    for rank_mask in ("rank_chain", "draft_chain"):  # draft_chain is the valid-prefix chain in every mode
        ranks = [
            block_losses(logits, rank_logits, teacher, pm, 0, rank_mask=rank_mask, valid_prefix=mode).rank
            for mode in VALID_PREFIX
        ]
        assert all(torch.equal(r, ranks[0]) for r in ranks)
    with pytest.raises(ValueError, match="valid_prefix must be one of chain, slot0_norm, valid"):
        block_losses(logits, rank_logits, teacher, pm, 0, valid_prefix="none")


def test_rank_loss_equals_hand_value_for_one_sample():
    teacher = one_hot_rows([3, 0, 0], 8)
    pm = torch.tensor([[True, False, False]])
    logits = torch.zeros(1, 3, 1, 8)
    logits[0, 0, 0] = torch.arange(8, 0, -1).float()  # target token 3 has rank 4 -> bucket 1
    rank_logits = torch.tensor([2.0, 0.5, -1.0, 0.0]).view(1, 1, 1, 4).repeat(1, 3, 1, 1)  # predicts bucket 0
    out = block_losses(logits, rank_logits, teacher, pm, 0)
    soft = smoothing_table()[1]
    ce = -(soft * rank_logits[0, 0, 0].log_softmax(-1)).sum()
    assert out.labels[0, 0, 0] == 1 and out.rank_pred[0, 0, 0] == 0
    assert out.rank.item() == pytest.approx(3.0 * ce.item(), rel=1e-6)  # d = 1 + |1 - 0| + max(1 - 0, 0) = 3


def _rank_case():
    """Slot 0 greedy wrong (draft chain stops after it), rank head right at slot 0, wrong at slot 1."""
    vocab, seq = 6, [1, 2, 3, 4, 5, 1, 2, 3]
    teacher = one_hot_rows(seq, vocab)
    pm = torch.ones(1, len(seq), dtype=torch.bool)
    logits = torch.zeros(1, len(seq), 4, vocab)
    logits[..., 0] = 3.0  # token 0 is every slot's greedy choice: never the target
    for i in range(len(seq)):
        for k in range(4):
            if i + k < len(seq):
                logits[0, i, k, seq[i + k]] = 2.0  # the target is rank 2 -> bucket 1 everywhere
    rank_logits = torch.zeros(1, len(seq), 4, 4)
    rank_logits[:, :, 0, 1] = 4.0  # slot 0 predicts the right bucket
    rank_logits[:, :, 1:, 3] = 4.0  # slots 1-3 predict the wrong one
    return logits, rank_logits.requires_grad_(True), teacher, pm


@pytest.mark.parametrize("rank_mask, trained_slots", [("rank_chain", [0, 1]), ("draft_chain", [0])])
def test_rank_mask_variants_select_the_specified_slots(rank_mask, trained_slots):
    logits, rank_logits, teacher, pm = _rank_case()
    out = block_losses(logits, rank_logits, teacher, pm, 0, rank_mask=rank_mask)
    assert (out.labels[0, :5] == 1).all()
    out.rank.backward()
    per_slot = rank_logits.grad.abs().sum(dim=(0, 1, 3))
    # rank chain: breaks after the first rank error, that slot included; draft chain: after the first draft error
    assert [k for k in range(4) if per_slot[k] > 0] == trained_slots


def test_rank_mask_is_refused_when_unknown():
    logits, rank_logits, teacher, pm = _rank_case()
    with pytest.raises(ValueError, match="rank_mask must be one of rank_chain, draft_chain"):
        block_losses(logits, rank_logits, teacher, pm, 0, rank_mask="paper")


# ---------------------------------------------------------------------------------------------------------
# §10 test 9: cross-block alignment


def successor(x: torch.Tensor, vocab: int) -> torch.Tensor:
    return (5 * x + 3) % vocab  # a permutation of 0..15 when vocab = 16


@dataclass
class _Out:
    logits: torch.Tensor
    rank_logits: torch.Tensor
    hidden: torch.Tensor
    kv: object


class SuccessorOracle(torch.nn.Module):
    """A test double with the drafter's ``forward_block`` contract that knows the sequence's rule: slot k of a
    row holding token x predicts successor^{k+1}(x). It records what each block was given."""

    def __init__(self, vocab: int, block_size: int = 4, lag: int = 0):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        self.vocab, self.lag, self.calls = vocab, lag, []

    def forward_block(
        self, cond, tokens, *, from_target, first_block_kv=None, ttt_kv=(), ttt_valid=(), attention="block_sparse"
    ):
        self.calls.append(
            dict(
                cond=cond,
                tokens=tokens,
                from_target=from_target,
                first=first_block_kv,
                ttt_kv=ttt_kv,
                ttt_valid=ttt_valid,
            )
        )
        slots, x = [], tokens
        for _ in range(self.config.block_size + self.lag):
            x = successor(x, self.vocab)
            slots.append(x)
        slots = torch.stack(slots[self.lag :], -1)  # [B, S, K]
        logits = 20.0 * torch.nn.functional.one_hot(slots, self.vocab).float()
        hidden = slots.float()[..., None]  # G of slot k "is" the token it drafted
        return _Out(logits, torch.zeros(*slots.shape, 4), hidden, kv=f"kv{len(self.calls)}")


def test_cross_block_slot_k_of_block_b_is_scored_against_row_i_plus_offset_plus_k():
    vocab, length = 16, 24
    x = [7]
    for _ in range(length):
        x.append(int(successor(torch.tensor(x[-1]), vocab)))
    seq = torch.tensor([x[:length]])
    teacher = torch.nn.functional.one_hot(torch.cat([seq[:, 2:], seq[:, :2]], 1), vocab).float()  # row r: x_{r+2}
    pm = torch.zeros(1, length, dtype=torch.bool)
    pm[:, : length - 2] = True
    tokens = torch.cat([seq[:, 1:], seq[:, :1]], 1)  # row i holds x_{i+1}
    oracle = SuccessorOracle(vocab)
    cuts = [3, 2]
    out = unroll_blocks(oracle, torch.zeros(1, length, 6), tokens, teacher, pm, cuts)
    assert out.offsets == [0, 3, 5]
    for b, (block, off) in enumerate(zip(out.blocks, out.offsets)):
        for k in range(4):
            rows = [i for i in range(length) if pm[0, i] and i + off + k < length - 2]
            assert block.correct[0, rows, k].all(), (b, k)  # the oracle is right exactly when aligned
            assert block.slot_valid[0, :, k].tolist() == [i in rows for i in range(length)]
        assert block.draft.max() < 1e-6
    # later blocks: condition = G of slot M-1 (the drafted node), tokens M rows on, TTT validity = the cuts
    calls = oracle.calls
    assert [c["from_target"] for c in calls] == [True, False, False]
    assert torch.equal(calls[1]["cond"][..., 0].long()[:, : length - 4], calls[1]["tokens"][:, : length - 4])
    assert torch.equal(calls[2]["tokens"][:, : length - 6], seq[:, 6:])
    assert calls[1]["first"] == "kv1" and calls[2]["first"] == "kv1"
    assert calls[2]["ttt_kv"] == ("kv1", "kv2") and calls[2]["ttt_valid"] == (3, 2)
    # one row out of step: every slot wrong, every later slot masked by the valid prefix
    late = unroll_blocks(SuccessorOracle(vocab, lag=1), torch.zeros(1, length, 6), tokens, teacher, pm, cuts)
    for block in late.blocks:
        assert not block.correct[block.slot_valid].any()
        assert block.draft_weight[..., 1:].sum() == 0 and block.draft[0] > 1.0


def test_total_loss_weights_slots_by_point_eight_to_the_k():
    vocab, seq = 6, [1, 2, 3, 4, 5, 1]
    teacher = one_hot_rows(seq, vocab)
    pm = torch.ones(1, len(seq), dtype=torch.bool)
    torch.manual_seed(0)
    out = unroll_blocks(SuccessorOracle(vocab), torch.zeros(1, 6, 3), torch.tensor([seq]), teacher, pm, [2])
    expected = sum(0.8**k * (out.blocks[0].draft[k] + out.blocks[1].draft[k]) for k in range(4))
    assert total_loss(out, rank_weight=0.0).item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match=r"cuts must lie in 1..4"):
        unroll_blocks(SuccessorOracle(vocab), torch.zeros(1, 6, 3), torch.tensor([seq]), teacher, pm, [5])


# ---------------------------------------------------------------------------------------------------------
# The real drafter: §10 test 1 (second half) and the EAGLE-3 warm start


def test_rank_loss_alone_leaves_the_trunk_without_gradient():
    drafter, _ = tiny_drafter()
    aux, tokens = torch.randn(2, 7, 3 * 32), torch.randint(0, 96, (2, 7))
    teacher = torch.softmax(torch.randn(2, 7, 64), -1)
    pm = torch.ones(2, 7, dtype=torch.bool)
    out = unroll_blocks(drafter, aux, tokens, teacher, pm, [2, 3])
    torch.stack([b.rank for b in out.blocks]).sum().backward()
    trained = {name for name, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained == {"rank_head.0.weight", "rank_head.2.weight"}
    drafter.zero_grad(set_to_none=True)
    total_loss(unroll_blocks(drafter, aux, tokens, teacher, pm, [2, 3])).backward()  # the draft loss reaches all
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for name, p in drafter.named_parameters()
        if p.requires_grad and not name.startswith("rank_head")
    )


def test_slot_weight_zero_rank_weight_zero_one_block_trains_slot_zero_alone():
    """The 'slot 0 alone' arm: model.train_blocks=1 model.slot_weight=0 model.rank_weight=0 (cuts = [])."""
    drafter, _ = tiny_drafter()
    aux, tokens = torch.randn(2, 7, 3 * 32), torch.randint(0, 96, (2, 7))
    teacher = torch.softmax(torch.randn(2, 7, 64), -1)
    pm = torch.ones(2, 7, dtype=torch.bool)
    pm[1, 5:] = False  # later slots of the last anchors have no valid row: still no NaN
    # no chain (a random drafter's slot 0 is wrong everywhere): slots 1-3 carry a loss that slot_weight=0 must drop
    out = unroll_blocks(drafter, aux, tokens, teacher, pm, [], valid_prefix="valid")
    assert len(out.blocks) == 1 and (out.blocks[0].draft[1:] > 0).all()
    loss = total_loss(out, slot_weight=0.0, rank_weight=0.0)
    assert torch.equal(loss, out.blocks[0].draft[0])  # 0 ** 0 = 1: slot 0 at full weight, slots 1-3 at 0
    loss.backward()
    alone = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    unroll_blocks(drafter, aux, tokens, teacher, pm, [], valid_prefix="valid").blocks[0].draft[0].backward()
    reference = {name: p.grad for name, p in drafter.named_parameters() if p.grad is not None}
    assert alone.keys() == reference.keys() and not any(name.startswith("rank_head") for name in alone)
    for name, grad in alone.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=0, msg=name)
    assert reference["position_queries"].abs().sum() > 0  # slot 0 attends to earlier anchors' other slots


def test_warm_start_copies_what_maps_from_an_eagle3_checkpoint():
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from core.drafters.eagle3.layouts import Eagle3Checkpoint
    from core.drafters.specblock.layouts import warm_start_from_eagle3

    drafter, target = tiny_drafter()
    eagle = Eagle3Drafter(
        Eagle3Config.for_target(target, draft_vocab_size=64, aux_layer_ids=[1, 3, 4]),
        embed_weight=drafter.embed_tokens.weight,
    )
    ckpt = Eagle3Checkpoint.from_drafter(eagle, None)
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    copied = warm_start_from_eagle3(drafter, ckpt)
    state = drafter.state_dict()
    assert torch.equal(state["fc.weight"], eagle.fc.weight) and torch.equal(
        state["lm_head.weight"], eagle.lm_head.weight
    )
    assert torch.equal(state["cond_norm.weight"], eagle.midlayer.hidden_norm.weight)
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"], eagle.midlayer.self_attn.q_proj.weight[:, 32:])
    assert torch.equal(state["layers.0.mlp.down_proj.weight"], eagle.midlayer.mlp.down_proj.weight)
    assert torch.equal(state["fuse.weight"][:, :32], torch.eye(32))
    assert torch.equal(state["fuse.weight"][:, 32:], before["fuse.weight"][:, 32:])
    for name in ("layers.1.self_attn.q_proj.weight", "shift.0.weight", "position_queries", "rank_head.0.weight"):
        assert name not in copied and torch.equal(state[name], before[name])  # left at init
    wrong, _ = tiny_drafter(draft_vocab=32)
    with pytest.raises(ValueError, match="draft_vocab_size=64 but this SpecBlock drafter has 32"):
        warm_start_from_eagle3(wrong, ckpt)
    eagle31 = Eagle3Drafter(
        Eagle3Config.for_target(target, draft_vocab_size=64, aux_layer_ids=[1, 3, 4], fc_norm=True),
        embed_weight=drafter.embed_tokens.weight,
    )
    with pytest.raises(UserError, match="EAGLE-3.1 drafter \\(fc_norm\\).*plain EAGLE-3 export"):
        warm_start_from_eagle3(drafter, Eagle3Checkpoint.from_drafter(eagle31, None))


# ---------------------------------------------------------------------------------------------------------
# Recipes, fit -> export -> load


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from omegaconf import OmegaConf
    from tiny_targets import save_tiny_target, write_jsonl
    from transformers import LlamaForCausalLM

    from core.vocab import build_vocab_map
    from data_prep.extract import extract, parse_args
    from data_prep.vocab import counts_from_source

    root = tmp_path_factory.mktemp("specblock")
    target = save_tiny_target(root / "target", layers=8, hidden=32)
    chats = write_jsonl(root / "chats.jsonl", 24)
    # The recipe's 512-token draft vocabulary (counted over the chats): a random target's argmax would almost never
    # fall inside it, so the teacher's other rows are zeroed (their logits 0) and the rest sharpened.
    counting = OmegaConf.create(
        {"target": str(target), "source": f"jsonl:{chats}", "n_samples": 24, "max_len": 64, "split": "train", "seed": 0}
    )
    _, t2d = build_vocab_map(counts_from_source(counting)[0], 512)
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        model.lm_head.weight[~t2d] = 0.0
    model.save_pretrained(target)
    extract(
        parse_args(
            [
                f"target={target}",
                f"source=jsonl:{chats}",
                "n_samples=24",
                "max_len=64",
                "layers=eagle3",
                "dtype=fp32",
                "batch_size=8",
                f"out={root / 'feats'}",
            ]
        )
    )
    return root, target, chats


def test_recipes_validate_and_dry_run(tiny_setup, capsys):
    from spectrain import fit as fit_cli

    root, target, _ = tiny_setup
    for recipe in ("specblock_smollm2", "specblock_llama8b"):
        cfg = fit_cli.compose_recipe(
            [f"recipe={recipe}", f"target={target}", "dry_run=true", f"runs_dir={root / 'dry'}"]
        )
        assert cfg.model.block_size == 4 and cfg.model.num_layers == 2 and cfg.model.train_blocks == 3
        assert fit_cli.fit(cfg)["trained"] is False
    llama = fit_cli.compose_recipe(["recipe=specblock_llama8b", f"target={target}"])
    assert (llama.optim.lr, llama.optim.warmup_steps, llama.data.max_len) == (5e-5, 500, 1024)
    assert (llama.trainer.strategy, llama.trainer.precision, llama.logger) == ("fsdp", "bf16-mixed", "wandb")
    capsys.readouterr()
    missing = root / "no-such-llama"
    assert (
        fit_cli.main(["recipe=specblock_llama8b", f"target={missing}", "dry_run=true", f"runs_dir={root / 'dry'}"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: target={missing} is not usable") and "target=" in err[0]
    with pytest.raises(fit_cli.RecipeError, match="rank_mask=paper is not one of rank_chain, draft_chain"):
        fit_cli.fit(
            fit_cli.compose_recipe(
                [
                    "recipe=specblock_smollm2",
                    f"target={target}",
                    "rank_mask=paper",
                    "dry_run=true",
                    f"runs_dir={root / 'dry'}",
                ]
            )
        )


def test_experiment_keys_build_the_drafter_they_name_and_bad_values_are_one_line(tiny_setup, capsys):
    from spectrain import fit as fit_cli

    root, target, chats = tiny_setup
    base = [
        "recipe=specblock_smollm2",
        f"target={target}",
        f"source=jsonl:{chats}",
        f"dataset_dir={root / 'feats'}",
        f"val_dataset_dir={root / 'feats'}",
        "n_samples=24",
        "max_len=64",
        "batch_size=4",
        "draft_vocab_size=512",
        f"runs_dir={root / 'keys'}",
    ]
    default = fit_cli.compose_recipe(base)
    assert (default.model.init, default.model.valid_prefix) == ("random", "slot0_norm")
    eye = torch.eye(32)

    identity, _ = fit_cli.build_module_and_data(fit_cli.compose_recipe([*base, "model.init=identity"]))
    assert torch.equal(identity.drafter.fuse.weight[:, :32], eye)
    assert torch.equal(identity.drafter.shift[0].weight, torch.cat([eye, torch.zeros(32, 32)], dim=1))
    plain, _ = fit_cli.build_module_and_data(default)
    assert not torch.equal(plain.drafter.fuse.weight[:, :32], eye)

    # slot 0 alone, one layer: no shift, one block, the step's loss is slot 0's draft loss
    cfg = fit_cli.compose_recipe(
        [*base, "train_blocks=1", "slot_weight=0", "rank_weight=0", "num_layers=1", "valid_prefix=slot0_norm"]
    )
    module, data = fit_cli.build_module_and_data(cfg)
    assert len(module.drafter.layers) == 1 and len(module.drafter.shift) == 0
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    loss = module.training_step(batch, 0)
    aux, tokens, teacher, pm = module._rows(batch)
    alone = unroll_blocks(module.drafter, aux, tokens, teacher, pm, [], valid_prefix="slot0_norm")
    assert len(alone.blocks) == 1 and torch.equal(loss, alone.blocks[0].draft[0])
    loss.backward()
    assert all(p.grad is None for p in module.drafter.rank_head.parameters())

    for bad, line in (
        ("model.init=zeros", "model.init=zeros is not one of random, identity"),
        ("model.valid_prefix=none", "model.valid_prefix=none is not one of chain, slot0_norm, valid"),
        ("model.slot_weight=-0.5", "model.slot_weight and rank_weight must be >= 0"),
    ):
        capsys.readouterr()
        assert fit_cli.main([*base, bad, "dry_run=true"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], err


def test_fit_exports_a_native_dir_that_load_native_reads(tiny_setup):
    import csv
    import json

    from transformers import AutoModelForCausalLM

    from core.drafters.specblock import load_native
    from inference.algorithms import build_algorithm
    from inference.drafters import load_lm
    from core.drafters.specblock.kind import load_specblock
    from inference.sampling import SamplingParams
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli

    root, target, chats = tiny_setup
    runs = root / "runs"
    cfg = fit_cli.compose_recipe(
        [
            "recipe=specblock_smollm2",
            f"target={target}",
            f"source=jsonl:{chats}",
            f"dataset_dir={root / 'feats'}",
            f"val_dataset_dir={root / 'feats'}",
            "n_samples=24",
            "max_len=64",
            "batch_size=4",
            "draft_vocab_size=512",
            "max_steps=6",
            "val_check_interval=3",
            "checkpoint_every_n_steps=3",
            "warmup_steps=2",
            "lr=5e-3",
            "log_every_n_steps=1",
            f"runs_dir={runs}",
        ]
    )
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 6
    assert 1.0 <= result["metrics"]["val/tau_sim"] <= 5.0 and 0.0 <= result["metrics"]["val/rank_acc"] <= 1.0
    rows = list(csv.DictReader(open(next((runs / "specblock_smollm2" / "logs").glob("*/metrics.csv")))))
    first_slot = [float(r["train/draft_loss_b1_s0"]) for r in rows if r.get("train/draft_loss_b1_s0")]
    assert len(first_slot) == 6 and first_slot[-1] < first_slot[0]

    ckpt = runs / "specblock_smollm2" / "checkpoints" / "last.ckpt"
    out = root / "native"
    assert export_cli.main([f"ckpt={ckpt}", f"out={out}"]) == 0
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["kind"] == "specblock" and block["block_size"] == 4 and block["num_layers"] == 2
    assert block["vocab"]["draft_vocab_size"] == 512 and block["widths"] == [2, 4, 6, 4]
    assert block["layers"]["ids"] == [1, 3, 4] and block["training"]["train_blocks"] == 3
    assert "val/tau_sim" in json.loads((out / "metrics.json").read_text())
    from core.assets import AssetError, chat_template_hash, load_tokenizer

    assert block["target"]["chat_template_hash"] == chat_template_hash(load_tokenizer(target))
    with pytest.raises(AssetError, match="chat_template=auto"):  # served under another template: refused
        load_specblock(str(out), load_lm(str(target), max_seq_len=64, chat_template="none"))
    assert export_cli.main([f"ckpt={ckpt}", "format=sglang", f"out={root / 'sglang'}"]) == 2

    embed = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight.detach()
    drafter = load_native(out, embed_weight=embed)
    trained = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, trained["drafter." + name]), name
    assert int(drafter.t2d.sum()) == 512

    # the engine serves the trained export losslessly (greedy: the target's own tokens)
    target_lm = load_lm(str(target), max_seq_len=128)
    served = load_specblock(str(out), target_lm)
    greedy, prompt = SamplingParams(0.0), [1, 2, 3, 4, 5]
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=16, sampling=greedy)
    tree = build_algorithm("specblock_tree", target_lm.runner, served, width=2, budget=8)
    assert tree.generate(prompt, max_new_tokens=16, sampling=greedy).tokens == reference.tokens


def test_import_of_a_reference_release_checkpoint(tiny_setup, capsys):
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter, load_native
    from spectrain import export as export_cli
    from core.drafters.specblock.layouts import REFERENCE_NAMES

    root, target, _ = tiny_setup
    drafter = SpecBlockDrafter(
        SpecBlockConfig.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=64, aux_layer_ids=[1, 3, 4])
    )
    # the release's layout: input_layer.* / shift_proj.* names, its own embedding copy, a LlamaConfig + its fields
    reverse = {ours: theirs for theirs, ours in REFERENCE_NAMES.items()}
    weights = {
        reverse.get(name, name.replace("shift.", "shift_proj.", 1)): t.contiguous()
        for name, t in drafter.state_dict().items()
        if name != "embed_tokens.weight"
    }
    weights["input_layer.embed_tokens.weight"] = drafter.embed_tokens.weight.detach()
    release = root / "release"
    release.mkdir()
    save_file(weights, str(release / "model.safetensors"))
    fields = {
        "architectures": ["LlamaForCausalLMSpecBlock"],
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 1024,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 49152,
        "draft_vocab_size": 64,
        "diffspec_draft_token_num": 4,
        "rank_classes": 4,
    }
    (release / "config.json").write_text(json.dumps(fields))
    assert export_cli.main([f"import={release}", f"target={target}", f"out={root / 'imported'}"]) == 0
    block = json.loads((root / "imported" / "config.json").read_text())["spectrain"]
    assert block["block_size"] == 4 and block["num_layers"] == 2 and block["layers"]["ids"] == [1, 3, 4]
    assert block["rank_buckets"]["count"] == 4 and block["architecture"]["rms_norm_eps"] == 1e-6
    imported = load_native(root / "imported")
    for name, tensor in drafter.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(imported.state_dict()[name], tensor), name
    (release / "config.json").write_text(json.dumps({**fields, "rank_classes": 3}))
    capsys.readouterr()
    assert export_cli.main([f"import={release}", f"target={target}", f"out={root / 'three'}"]) == 2
    assert "rank_buckets must be 4" in capsys.readouterr().err
    assert export_cli.main([f"import={release}", f"out={root / 'no_target'}"]) == 2
