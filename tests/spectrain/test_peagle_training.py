"""P-EAGLE training: scored rows, the recipes (validated and dry-run), bad model fields, and fit (online features) ->
export -> the engine serving the trained drafter losslessly."""

from __future__ import annotations

import pytest
import torch

from spectrain.kinds.peagle.losses import batch_chains, cod_sample, every_chain, scored_rows


def test_scored_rows_predict_supervised_tokens_and_full_chains_cover_every_scored_anchor():
    supervised = torch.zeros(1, 12, dtype=torch.bool)
    supervised[0, 4:10] = True
    scored = scored_rows(supervised)
    assert scored[0].nonzero().flatten().tolist() == [2, 3, 4, 5, 6, 7]  # row q predicts token q + 2
    anchors, depths = every_chain(scored[0], 3)  # every chain whose rows are all scored, sorted by (anchor, depth)
    assert list(zip(anchors.tolist(), depths.tolist())) == [
        (2, 1),
        (2, 2),
        (3, 1),
        (3, 2),
        (4, 1),
        (4, 2),
        (5, 1),
        (5, 2),
        (6, 1),
    ]
    drawn = cod_sample(scored[0], 6, 0.7, 0.2, None, torch.Generator().manual_seed(0))
    # COD: a chain's rows after its anchor are all scored (its anchor row need not be)
    assert len(drawn[0]) > 4 and all(bool(scored[0, a + 1 : a + d + 1].all()) for a, d in zip(*drawn))
    layout = batch_chains([(anchors, depths), (anchors[:2], depths[:2])], "cpu")
    assert layout.valid.sum(1).tolist() == [9, 2] and layout.anchors[1, -2:].tolist() == [2, 2]
    assert layout.valid[1].tolist() == [False] * 7 + [True] * 2  # padded at the front: still sorted


def test_a_rows_chains_do_not_depend_on_world_size_or_its_batch():
    from types import SimpleNamespace

    from spectrain.kinds.peagle.module import PEagleModule

    def stub(seed: int = 7) -> SimpleNamespace:  # what PEagleModule._chains reads of the module
        model = SimpleNamespace(down_sample_ratio=0.7, down_sample_ratio_min=0.2, max_anchors=0)
        return SimpleNamespace(
            cfg=SimpleNamespace(seed=seed, model=model), drafter=SimpleNamespace(config=SimpleNamespace(num_depths=4))
        )

    def chains(module, scored, attention, salt, first_row, every=False):
        return [
            list(zip(a.tolist(), d.tolist()))
            for a, d in PEagleModule._chains(module, scored, attention, salt, first_row, every)
        ]

    lengths = [30, 16, 21, 17]
    generator = torch.Generator().manual_seed(0)
    attention = torch.zeros(4, 30, dtype=torch.long)
    supervised = torch.zeros(4, 30, dtype=torch.bool)
    for i, n in enumerate(lengths):  # right-padded rows, answers from position 3
        attention[i, :n] = 1
        supervised[i, 3:n] = torch.rand(n - 3, generator=generator) < 0.8
    scored = scored_rows(supervised)
    one = chains(stub(), scored, attention, 11, 0)  # 1 process x 4 rows
    two = []
    for rank in range(2):  # 2 processes x 2 rows, each padded to its own width
        rows, width = slice(2 * rank, 2 * rank + 2), max(lengths[2 * rank : 2 * rank + 2])
        two += chains(stub(), scored_rows(supervised[rows, :width]), attention[rows, :width], 11, 2 * rank)
    assert one == two and all(len(row) > 3 for row in one)
    for row, sc in zip(one, scored):  # every chain row is a scored row
        assert all(sc[a + d] for a, d in row)
    assert chains(stub(), scored, attention, 12, 0) != one and chains(stub(8), scored, attention, 11, 0) != one
    full = chains(stub(), scored, attention, 11, 0, every=True)  # validation: no draw, whatever the salt
    assert full == chains(stub(8), scored, attention, 12, 0, every=True)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from tiny_targets import save_tiny_target, write_jsonl

    root = tmp_path_factory.mktemp("peagle")
    target = save_tiny_target(root / "target", layers=8, hidden=32, logit_scale=8.0)
    chats = write_jsonl(root / "chats.jsonl", 24)
    return root, target, chats


def test_recipes_validate_and_dry_run(tiny_setup):
    from spectrain import fit as fit_cli

    root, target, _ = tiny_setup
    for recipe in ("peagle_smollm2", "peagle_smollm2_gsm"):
        cfg = fit_cli.compose_recipe(
            [f"recipe={recipe}", f"target={target}", "dry_run=true", f"runs_dir={root / 'dry'}"]
        )
        assert cfg.kind == "peagle" and cfg.data.layers == "eagle3" and cfg.model.mask_token_id == 16
        assert fit_cli.fit(cfg)["trained"] is False
    gsm = fit_cli.compose_recipe(["recipe=peagle_smollm2_gsm", f"target={target}"])
    assert (gsm.model.num_depths, gsm.model.down_sample_ratio, gsm.data.max_len) == (6, 0.7, 640)
    for override, message in [
        ("mask_token_id=null", "model.mask_token_id is not set: give the id of a special token"),
        ("attention=flex", "model.attention=flex is not one of block_sparse, dense"),
        ("down_sample_ratio=0", r"model.down_sample_ratio must be in \(0, 1\]"),
    ]:
        with pytest.raises(fit_cli.RecipeError, match=message):
            fit_cli.fit(
                fit_cli.compose_recipe(
                    ["recipe=peagle_smollm2", f"target={target}", override, "dry_run=true", f"runs_dir={root / 'dry'}"]
                )
            )


def test_fit_exports_a_native_dir_that_the_engine_serves_losslessly(tiny_setup):
    import csv
    import json

    from core.drafters.peagle.layouts import load_native
    from inference.algorithms import build_algorithm
    from inference.drafters import load_lm
    from core.drafters.peagle.kind import load_peagle
    from inference.sampling import SamplingParams
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli

    root, target, chats = tiny_setup
    runs = root / "runs"
    cfg = fit_cli.compose_recipe(
        [
            "recipe=peagle_smollm2",
            f"target={target}",
            f"source=jsonl:{chats}",
            "n_samples=24",
            "n_val_samples=4",
            "max_len=64",
            "batch_size=4",
            "draft_vocab_size=512",
            "num_depths=4",
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
    assert 1.0 <= result["metrics"]["val/tau_sim"] <= 5.0
    rows = list(csv.DictReader(open(next((runs / "peagle_smollm2" / "logs").glob("*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and losses[-1] < losses[0]

    ckpt = runs / "peagle_smollm2" / "checkpoints" / "last.ckpt"
    out = root / "native"
    assert export_cli.main([f"ckpt={ckpt}", f"out={out}"]) == 0
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["kind"] == "peagle" and block["num_depths"] == 4 and block["mask_token_id"] == 16
    assert block["layers"]["ids"] == [1, 3, 4] and block["vocab"]["draft_vocab_size"] == 512
    assert "val/tau_sim" in json.loads((out / "metrics.json").read_text())
    trained = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert trained["drafter.mask_hidden"].shape == (1, 1, 96)
    for name, tensor in load_native(out).state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(tensor, trained["drafter." + name]), name

    target_lm = load_lm(str(target), max_seq_len=128)
    served = load_peagle(str(out), target_lm)
    greedy, prompt = SamplingParams(0.0), [1, 2, 3, 4, 5]
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=16, sampling=greedy)
    result = build_algorithm("peagle", target_lm.runner, served).generate(prompt, max_new_tokens=16, sampling=greedy)
    assert result.tokens == reference.tokens and result.stats.draft_forwards == result.stats.rounds
