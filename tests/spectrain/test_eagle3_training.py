"""kind=eagle3: training-time-test loss alignment, a short fit, export in every layout, engine load and greedy
equality of eagle3_tree with AR."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from eagle3_training_builders import eagle3_fit_setup
from transformers import LlamaConfig

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from spectrain import fit as fit_cli
from spectrain.kinds.eagle3.losses import scored_rows, teacher_in_draft_vocab, teacher_rows, ttt_targets
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance


def test_chain_acceptance_across_steps_matches_brute_force():
    torch.manual_seed(0)
    alphas = [torch.rand(2, 5) for _ in range(3)]
    masks = [torch.ones(2, 5, dtype=torch.bool) for _ in range(3)]
    masks[2][0, 4] = False
    metric = SimulatedAcceptance(3)
    metric.update(alphas, masks)
    starts = [(b, t) for b in range(2) for t in range(5) if all(m[b, t] for m in masks)]
    chains = [
        sum(torch.stack([alphas[j][b, t] for j in range(k + 1)]).prod().item() for b, t in starts) / len(starts)
        for k in range(3)
    ]
    assert metric.compute()["tau_sim"].item() == pytest.approx(1 + sum(chains), abs=1e-6)


@pytest.fixture()
def eagle3_recipe(tmp_path: Path):
    return eagle3_fit_setup(tmp_path)


def test_eagle3_fit_exports_and_serves_losslessly(eagle3_recipe, tmp_path):
    from inference.algorithms import build_algorithm
    from inference.drafters import load_lm
    from core.drafters.eagle3.kind import load_eagle3
    from inference.sampling import SamplingParams
    from spectrain import export as export_cli

    recipes, args, target = eagle3_recipe
    cfg = fit_cli.compose_recipe(args, directory=recipes)
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 6
    assert 1.0 <= result["metrics"]["val/tau_sim"] <= 1.0 + cfg.model.gamma
    rows = list(csv.DictReader(open(next((tmp_path / "runs" / "eagle3_smollm2" / "logs").glob("*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]

    ckpt = tmp_path / "runs" / "eagle3_smollm2" / "checkpoints" / "last.ckpt"
    for layout in ("native", "sglang", "speculators"):
        assert export_cli.main([f"ckpt={ckpt}", f"format={layout}", f"out={tmp_path / layout}"]) == 0
    config = (tmp_path / "native" / "config.json").read_text()
    assert '"draft_vocab_size": 512' in config

    target_lm = load_lm(str(target), max_seq_len=128)
    drafter = load_eagle3(str(tmp_path / "native"), target_lm)
    greedy = SamplingParams(0.0)
    prompt = [1, 2, 3, 4, 5]
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=16, sampling=greedy)
    tree = build_algorithm("eagle3_tree", target_lm.runner, drafter, tree_depth=3, tree_topk=2, tree_total=8)
    assert tree.generate(prompt, max_new_tokens=16, sampling=greedy).tokens == reference.tokens


def test_eagle3_recipe_refuses_gamma_beyond_ttt_steps(eagle3_recipe):
    recipes, args, _ = eagle3_recipe
    cfg = fit_cli.compose_recipe([*args, "gamma=5"], directory=recipes)
    with pytest.raises(ValueError, match="model.gamma=5 exceeds model.ttt_steps=3"):
        fit_cli.fit(cfg)


def test_scored_rows_loss_equals_the_masked_loss_over_every_row():
    """Training scores only the rows a loss reads; per step the loss must equal ttt_targets' masked loss."""
    torch.manual_seed(0)
    target = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        num_hidden_layers=4,
    )
    drafter = Eagle3Drafter(
        Eagle3Config.for_target(target, draft_vocab_size=48, aux_layer_ids=[0, 1, 2]), embed_weight=torch.randn(96, 32)
    )
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[torch.randperm(96)[:48]] = True
    draft_ids = t2d.nonzero()[:, 0]
    drafter.set_vocab_map(draft_ids - torch.arange(48), t2d)
    batch, length, steps = 3, 12, 4
    ids = torch.randint(0, 96, (batch, length))
    aux, last = torch.randn(batch, length, 96), torch.randn(batch, length, 32)
    attention = torch.ones(batch, length, dtype=torch.bool)
    attention[1, 9:] = False  # a padded row
    supervised = attention.clone()
    supervised[:, :4] = False  # the prompt
    weight = torch.randn(96, 32) * 3
    project = lambda h: h @ weight.T  # noqa: E731

    full = drafter(ids, aux, steps=steps, attention_mask=attention)
    restricted, in_vocab = teacher_in_draft_vocab(project(last), drafter.t2d)
    expected = [
        soft_cross_entropy(s, t, m)
        for s, (t, m) in zip(full.logits, ttt_targets(restricted, in_vocab, supervised, steps))
    ]
    hidden = drafter(ids, aux, steps=steps, attention_mask=attention, heads=False).hidden
    assert len(drafter(ids, aux, steps=1, heads=False).logits) == 0
    index, probs = teacher_rows(project, last, supervised, drafter.t2d)
    for j in range(steps):
        b, i, n = scored_rows(index, j)
        got = soft_cross_entropy(drafter.head(hidden[j][b, i]), probs[n], torch.ones(len(b), dtype=torch.bool))
        torch.testing.assert_close(got, expected[j])
        assert len(b) > 0
