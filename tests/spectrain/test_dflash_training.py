"""DFlash training: anchors in answer positions, the scored slots and their weights, the loss, recipes that dry-run,
and fit (online features) -> export -> the engine serving the trained drafter losslessly."""

from __future__ import annotations

import math

import pytest
import torch

from spectrain.kinds.dflash.losses import sample_anchors, scored_slots, slot_weights, weighted_kl


def test_anchors_are_distinct_sorted_answer_positions_away_from_the_end_and_seeded():
    mask = torch.zeros(3, 30, dtype=torch.bool)
    mask[0, 5:28] = True  # 23 answer tokens, the last 4 of the width excluded: 5..25
    mask[1, 10:13] = True  # 3 candidates: fewer than asked
    anchors, valid = sample_anchors(mask, 4, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (3, 8)
    first = anchors[0].tolist()
    assert valid[0].all() and first == sorted(set(first)) and all(5 <= p <= 25 for p in first)
    assert anchors[1, -3:].tolist() == [10, 11, 12] and valid[1].tolist() == [False] * 5 + [True] * 3
    assert not valid[2].any()
    again, _ = sample_anchors(mask, 4, 8, torch.Generator().manual_seed(0))
    other, _ = sample_anchors(mask, 4, 8, torch.Generator().manual_seed(1))
    assert torch.equal(again, anchors) and not torch.equal(other, anchors)
    wide, _ = sample_anchors(mask, 4, 100, torch.Generator().manual_seed(0))
    assert wide[0].tolist() == list(range(5, 26))  # every candidate once


def test_scored_slots_are_supervised_positions_after_the_anchor():
    supervised = torch.zeros(1, 12, dtype=torch.bool)
    supervised[0, 3:9] = True
    anchors, valid = torch.tensor([[0, 4, 7]]), torch.tensor([[False, True, True]])
    b, a, k, positions = scored_slots(anchors, valid, supervised, 4)
    # anchor 4: slots 1..3 at 5, 6, 7; anchor 7: slot 1 at 8 (9, 10 are not answer tokens); anchor 0 invalid
    assert list(zip(a.tolist(), k.tolist(), positions.tolist())) == [(1, 1, 5), (1, 2, 6), (1, 3, 7), (2, 1, 8)]
    assert b.tolist() == [0] * 4
    assert slot_weights(4, 4.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-0.25), math.exp(-0.5)])


def test_the_loss_is_the_weighted_kl_over_scored_slots():
    student = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    teacher = torch.tensor([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
    q = student.softmax(-1)
    kl = [(teacher[0] * (teacher[0] / q[0]).log()).sum(), -(q[1, 0]).log()]
    expected = (1.0 * kl[0] + 0.5 * kl[1]) / 2
    assert float(weighted_kl(student, teacher, torch.tensor([1.0, 0.5]))) == pytest.approx(float(expected))


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from tiny_targets import save_tiny_target, write_jsonl

    root = tmp_path_factory.mktemp("dflash")
    target = save_tiny_target(root / "target", layers=8, hidden=32, logit_scale=8.0)
    chats = write_jsonl(root / "chats.jsonl", 24)
    return root, target, chats


def test_recipes_validate_and_dry_run(tiny_setup):
    from spectrain import fit as fit_cli

    root, target, _ = tiny_setup
    for recipe in ("dflash_smollm2", "dflash_smollm2_gsm", "dflash_llama8b"):
        # the 8B recipe's mask token (128002) is beyond the tiny target's vocabulary: a SmolLM2 special token here
        cfg = fit_cli.compose_recipe(
            [f"recipe={recipe}", f"target={target}", "dry_run=true", "mask_token_id=16", f"runs_dir={root / 'dry'}"]
        )
        assert cfg.kind == "dflash" and cfg.data.layers == "dflash5"
        assert fit_cli.fit(cfg)["trained"] is False
    llama = fit_cli.compose_recipe(["recipe=dflash_llama8b", f"target={target}"])
    assert (llama.model.block_size, llama.model.num_layers, llama.model.loss_decay_gamma) == (16, 5, 7.0)
    assert (llama.trainer.strategy, llama.trainer.precision, llama.logger) == ("fsdp", "bf16-mixed", "wandb")
    with pytest.raises(fit_cli.RecipeError, match="model.mask_token_id is not set: give the id of a special token"):
        fit_cli.fit(
            fit_cli.compose_recipe(
                [
                    "recipe=dflash_smollm2",
                    f"target={target}",
                    "mask_token_id=null",
                    "dry_run=true",
                    f"runs_dir={root / 'dry'}",
                ]
            )
        )
    with pytest.raises(fit_cli.RecipeError, match="model.attention=flex is not one of block_sparse, dense"):
        fit_cli.fit(
            fit_cli.compose_recipe(
                [
                    "recipe=dflash_smollm2",
                    f"target={target}",
                    "attention=flex",
                    "dry_run=true",
                    f"runs_dir={root / 'dry'}",
                ]
            )
        )


def test_fit_exports_a_native_dir_that_the_engine_serves_losslessly(tiny_setup):
    import csv
    import json

    from core.drafters.dflash.layouts import load_native
    from inference.algorithms import build_algorithm
    from inference.drafters import load_lm
    from core.drafters.dflash.kind import load_dflash
    from inference.sampling import SamplingParams
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli

    root, target, chats = tiny_setup
    runs = root / "runs"
    cfg = fit_cli.compose_recipe(
        [
            "recipe=dflash_smollm2",
            f"target={target}",
            f"source=jsonl:{chats}",
            "n_samples=24",
            "n_val_samples=4",
            "max_len=64",
            "batch_size=4",
            "draft_vocab_size=512",
            "block_size=4",
            "num_layers=1",
            "max_anchors=16",
            "max_steps=8",
            "val_check_interval=4",
            "checkpoint_every_n_steps=4",
            "warmup_steps=2",
            "lr=5e-3",
            "log_every_n_steps=1",
            "data.dtype=fp32",
            f"runs_dir={runs}",
        ]
    )
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 8
    assert 1.0 <= result["metrics"]["val/tau_sim"] <= 4.0
    rows = list(csv.DictReader(open(next((runs / "dflash_smollm2" / "logs").glob("*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and losses[-1] < losses[0]

    ckpt = runs / "dflash_smollm2" / "checkpoints" / "last.ckpt"
    out = root / "native"
    assert export_cli.main([f"ckpt={ckpt}", f"out={out}"]) == 0
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["kind"] == "dflash" and block["block_size"] == 4 and block["mask_token_id"] == 16
    assert block["layers"]["ids"] == [1, 2, 3, 4, 5] and block["vocab"]["draft_vocab_size"] == 512
    assert "val/tau_sim" in json.loads((out / "metrics.json").read_text())
    trained = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    drafter = load_native(out)
    for name, tensor in drafter.state_dict().items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(tensor, trained["drafter." + name]), name

    # the engine serves the trained export losslessly (greedy: the target's own tokens), its head the target's rows
    target_lm = load_lm(str(target), max_seq_len=128)
    served = load_dflash(str(out), target_lm)
    assert torch.equal(served.lm_head.weight, trained["drafter.lm_head.weight"])
    greedy, prompt = SamplingParams(0.0), [1, 2, 3, 4, 5]
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=16, sampling=greedy)
    result = build_algorithm("dflash", target_lm.runner, served).generate(prompt, max_new_tokens=16, sampling=greedy)
    assert result.tokens == reference.tokens and result.stats.draft_forwards == result.stats.rounds


def test_the_dflash_layer_spec_spreads_layers_as_z_lab_does():
    from core.layer_ids import resolve_layers

    assert resolve_layers("dflash5", 36) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B-DFlash target_layer_ids
    assert resolve_layers("dflash5", 30) == [1, 8, 14, 20, 27] and resolve_layers("dflash1", 30) == [15]
    with pytest.raises(ValueError, match="layers=dflash6 gives .* for a 8-layer target: K must be in 1..5"):
        resolve_layers("dflash6", 8)
