"""H-RAD (SpecBranch's rollback-aware classifier): features and layer convention, labels, class weighting,
temperature calibration, metrics, recipes, and traces -> fit -> export -> load_hrad end to end."""

from __future__ import annotations

import csv
import math
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_targets import save_tiny_target, write_jsonl
from transformers import LlamaConfig, LlamaForCausalLM

from core.drafters.hrad import (
    HRAD,
    HRADConfig,
    HRADError,
    capture_layers,
    check_boundaries,
    hrad_labels,
    load_hrad,
    stack_lastk,
)
from data_prep.traces import hrad_class
from spectrain.kinds.hrad.calibration import fit_temperature
from spectrain.kinds.hrad.data import class_weights
from spectrain.kinds.hrad.report import classification_metrics, confusion_png

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny_llama(seed: int = 0, layers: int = 5, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=61,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def test_features_are_the_last_4_hf_hidden_states_at_the_position_before_the_branch_token():
    from inference.runner import ModelRunner

    model = tiny_llama(layers=5)
    runner = ModelRunner.from_hf_model(model, max_seq_len=32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    layers = capture_layers(5, 4)
    assert layers == [1, 2, 3]  # outputs of layers L-4 .. L-2; the 4th block is the final-normed state
    out = runner(ids, capture_layers=layers, return_last_hidden=True)
    lastk = stack_lastk(out.hidden, out.last_hidden, layers)  # [1, T, K, d]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    assert lastk.shape == (1, 8, 4, 32)
    torch.testing.assert_close(lastk, torch.stack(ref[-4:], dim=-2), atol=1e-5, rtol=1e-4)
    # branch token at position 5: features at position 4, embedding of token ids[0, 5]; z is 5d wide
    hrad = HRAD(HRADConfig(hidden_size=32)).eval()
    z = hrad.features(lastk[:, 4], runner.embed_tokens(ids[:, 5]))
    assert z.shape == (1, 5 * 32) and z.dtype == torch.float32
    torch.testing.assert_close(z[0, :128], torch.cat([h[0, 4] for h in ref[-4:]]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(z[0, 128:], model.model.embed_tokens.weight[ids[0, 5]], atol=0, rtol=0)
    widths = [m.out_features for m in hrad.mlp if isinstance(m, torch.nn.Linear)]
    assert hrad.mlp[0].in_features == 160 and widths == [256, 64, 3]
    assert hrad(lastk[0], runner.embed_tokens(ids[0])).shape == (8, 3)


def test_labels_follow_the_boundaries():
    accepted = torch.tensor([0, 1, 2, 3, 6, 7])  # branch token included (num_accepted of a γ=7 round)
    default = hrad_labels(accepted, [1, 6])
    assert default.tolist() == [-1, 0, 1, 1, 1, 2]
    assert default.tolist()[1:] == [hrad_class(int(n), 7) for n in accepted[1:]]  # = data_prep.traces' label
    assert hrad_labels(accepted, [2, 5]).tolist() == [-1, 0, 0, 1, 2, 2]
    assert check_boundaries([1, 3], 4) == [1, 3]
    for bad in ([0, 3], [2, 2], [1, 4], [1], "1,3"):
        with pytest.raises(HRADError, match="1 <= b1 < b2 <= gamma-1 = 3"):
            check_boundaries(bad, 4)


def test_class_weights_give_every_class_the_same_total_weight():
    labels = torch.tensor([0] * 6 + [1] * 3 + [2])
    weights = class_weights(labels)
    torch.testing.assert_close(weights, torch.tensor([10 / 18, 10 / 9, 10 / 3]))
    per_class = torch.stack([weights[c] * (labels == c).sum() for c in range(3)])
    torch.testing.assert_close(per_class, torch.full((3,), 10 / 3))
    # the weighted loss is then the mean over classes of each class's mean loss
    logits = torch.randn(10, 3)
    losses = F.cross_entropy(logits, labels, reduction="none")
    balanced = torch.stack([losses[labels == c].mean() for c in range(3)]).mean()
    torch.testing.assert_close(F.cross_entropy(logits, labels, weight=weights), balanced)
    assert class_weights(torch.tensor([0, 0, 2])).tolist()[1] == 1.0  # absent class: finite weight


def test_temperature_calibration_lowers_val_nll_of_an_overconfident_model():
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 3, generator=generator)
    labels = torch.multinomial(true_logits.softmax(-1), 1, generator=generator).squeeze(1)
    overconfident = 3.0 * true_logits
    temperature = fit_temperature(overconfident, labels)
    assert temperature == pytest.approx(3.0, rel=0.1)
    report = classification_metrics(overconfident, labels, temperature)
    assert report["nll_calibrated"] < report["nll"] - 0.1
    assert report["ece"] < report["ece_raw"] / 3
    assert report["recall"] == classification_metrics(overconfident, labels)["recall"]  # argmax unchanged
    # already calibrated logits stay (nearly) as they are, and calibration never makes the NLL worse
    assert fit_temperature(true_logits, labels) == pytest.approx(1.0, abs=0.1)
    calibrated = classification_metrics(true_logits, labels, fit_temperature(true_logits, labels))
    assert calibrated["nll_calibrated"] <= calibrated["nll"]


def test_metrics_recall_confusion_ece_and_png():
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    predicted = torch.tensor([0, 1, 1, 1, 0, 2])
    logits = torch.log(F.one_hot(predicted, 3).float() * 0.7 + 0.1)  # confidence 0.8 on every prediction
    report = classification_metrics(logits, labels)
    assert report["recall"] == pytest.approx({"all_reject": 0.5, "confidence": 2 / 3, "all_accept": 1.0})
    assert report["confusion"] == [[1, 1, 0], [1, 2, 0], [0, 0, 1]]
    assert report["balanced_accuracy"] == pytest.approx((0.5 + 2 / 3 + 1) / 3)
    # one bin holds every prediction: ECE = |accuracy - confidence| = |4/6 - 0.8|
    assert report["ece_raw"] == pytest.approx(abs(4 / 6 - 0.8), abs=1e-6)
    absent = classification_metrics(logits[:5], labels[:5])  # no all_accept row: its recall is undefined
    assert absent["recall"]["all_accept"] is None and absent["support"]["all_accept"] == 0
    assert absent["balanced_accuracy"] == pytest.approx((0.5 + 2 / 3) / 2)
    png = confusion_png(report["confusion"])
    assert png.startswith(PNG_SIGNATURE) and png == confusion_png(report["confusion"])  # deterministic bytes


# ---------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Tiny target + a perturbed copy as draft: acceptance traces recorded with data_prep.traces."""
    from data_prep.traces import parse_args, record_traces
    from inference.drafters import load_draft_lm, load_lm

    root = tmp_path_factory.mktemp("hrad")
    target_dir = save_tiny_target(root / "target", layers=4)
    draft_dir = save_tiny_target(root / "draft", layers=4, noise=0.002)
    prompts = write_jsonl(root / "chats.jsonl", 16)
    target = load_lm(str(target_dir), device="cpu", max_seq_len=160)
    draft = load_draft_lm(str(draft_dir), target, device="cpu", max_seq_len=160)
    out = root / "traces"
    args = [
        f"target={target_dir}",
        f"drafter={draft_dir}",
        f"source=jsonl:{prompts}",
        "n_samples=16",
        "gamma=4",
        "max_new_tokens=24",
        "max_seq_len=160",
        "device=cpu",
        f"out={out}",
    ]
    manifest = record_traces(parse_args(args), target=target, draft=draft)
    assert manifest["layers"]["spec"] == "last4"
    return {"root": root, "target_dir": target_dir, "draft_dir": draft_dir, "out": out, "target": target}


def fit_args(traces, *extra: str) -> list[str]:
    return [
        "recipe=hrad_smollm2",
        f"target={traces['target_dir']}",
        f"dataset_dir={traces['out']}",
        f"runs_dir={traces['root'] / 'runs'}",
        "max_steps=12",
        "val_check_interval=6",
        "checkpoint_every_n_steps=6",
        "log_every_n_steps=1",
        "batch_size=8",
        "warmup_steps=2",
        "val_fraction=0.25",
        *extra,
    ]


def test_recipes_dry_run_and_refuse_absent_paths(traces, capsys):
    from spectrain import fit as fit_cli

    for recipe in ("hrad_smollm2", "hrad_llama8b"):
        args = [
            f"recipe={recipe}",
            f"target={traces['target_dir']}",
            f"dataset_dir={traces['out']}",
            f"runs_dir={traces['root'] / 'dry'}",
            "dry_run=true",
        ]
        assert fit_cli.fit(fit_cli.compose_recipe(args))["trained"] is False
    assert fit_cli.main(["recipe=hrad_llama8b", "dry_run=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "/models/Llama-3.1-8B-Instruct" in err
    assert fit_cli.main(["recipe=hrad_llama8b", f"target={traces['target_dir']}", "dry_run=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "/data/spectrain/traces/hrad_llama8b has no manifest.json" in err
    # traces recorded for another target, other K, unknown balance mode: refused before any work
    other = save_tiny_target(traces["root"] / "other", seed=1, layers=4)
    for extra, message in (
        (f"target={other}", "was recorded with target"),
        ("layers=last3", "holds last4"),
        ("balance=oversample", "model.balance=oversample"),
        ("layers=eagle3", "data.layers=last4"),
    ):
        assert fit_cli.main([*fit_args(traces), extra, "dry_run=true"]) == 2
        assert message in capsys.readouterr().err


def test_traces_fit_export_load_predict_and_refuse_foreign_target(traces, tmp_path):
    from inference.drafters import load_lm
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli

    result = fit_cli.fit(fit_cli.compose_recipe(fit_args(traces, "run_name=hrad_e2e")))
    assert result["trained"] and result["global_step"] == 12
    run = traces["root"] / "runs" / "hrad_e2e"
    rows = list(csv.DictReader(open(next((run / "logs").glob("*/metrics.csv")))))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {
        "train/loss",
        "train/recall_all_reject",
        "train/ece",
        "val/nll",
        "val/ece",
        "val/ece_raw",
        "val/recall_confidence",
        "val/confusion_2_2",
        "val/temperature",
    } <= logged
    assert (run / "checkpoints" / "confusion_matrix.png").read_bytes().startswith(PNG_SIGNATURE)
    report = json.loads((run / "checkpoints" / "hrad_metrics.json").read_text())
    assert report["nll_calibrated"] <= report["nll"] and sum(map(sum, report["confusion"])) == report["count"]
    counts = report["data"]["class_counts"]
    assert sum(counts["val"]) == report["count"] and all(n > 0 for n in counts["train"]), counts

    out = tmp_path / "export"
    assert export_cli.main([f"ckpt={run / 'checkpoints' / 'last.ckpt'}", f"out={out}"]) == 0
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["kind"] == "hrad" and block["last_k"] == 4 and block["hidden_size"] == 32
    assert block["boundaries"] == [1, 3] and block["gamma"] == 4 and block["epsilon"] == 0.3
    assert block["temperature"] == pytest.approx(report["temperature"])
    assert block["layers"]["ids"] == [0, 1, 2] and (out / "confusion_matrix.png").is_file()

    target = traces["target"]
    predictor = load_hrad(out, target.runner)
    n = 5
    probs = predictor.predict(torch.randn(n, 4, 32), torch.randn(n, 32))
    assert probs.shape == (n, 3) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(n))
    assert predictor.capture_layers == [0, 1, 2] and predictor.epsilon == 0.3 and predictor.gamma == 4
    with pytest.raises(ValueError, match=r"hidden_lastk must be \[n, 4, 32\]"):
        predictor.predict(torch.randn(n, 3, 32), torch.randn(n, 32))

    same_shape = load_lm(str(save_tiny_target(tmp_path / "other", seed=7, layers=4)), device="cpu", max_seq_len=32)
    with pytest.raises(HRADError, match="other weights"):
        load_hrad(out, same_shape)
    wider = load_lm(str(save_tiny_target(tmp_path / "wide", layers=4, hidden=64)), device="cpu", max_seq_len=32)
    with pytest.raises(HRADError, match=r"was trained for target .* not this one \(hidden 64"):
        load_hrad(out, wider.runner)
    assert (
        export_cli.main(
            [f"ckpt={run / 'checkpoints' / 'last.ckpt'}", f"out={tmp_path / 'x'}", f"target={tmp_path / 'other'}"]
        )
        == 2
    )


def test_balanced_sampler_and_prompt_level_split(traces):
    from spectrain import fit as fit_cli
    from spectrain.kinds.hrad.data import HRADDataModule, split_prompts

    datamodule = HRADDataModule(fit_cli.compose_recipe(fit_args(traces, "balance=sampler", "boundaries=[2,3]")))
    datamodule.setup("fit")
    counts = datamodule.class_counts["train"]
    assert max(counts) > 2 * min(counts) > 0, f"want imbalanced classes in this test: {counts}"
    loader = datamodule.train_dataloader()  # one loader per fit: its generator moves on every epoch
    drawn = torch.cat([batch[-1] for _ in range(30) for batch in loader])
    frequencies = torch.bincount(drawn, minlength=3).float() / len(drawn)
    torch.testing.assert_close(frequencies, torch.full((3,), 1 / 3), atol=0.05, rtol=0)
    hidden, emb, confidence, _ = datamodule.train_set[0]
    assert hidden.shape == (4, 32) and emb.shape == (32,) and emb.dtype == torch.float32
    assert confidence.shape == () and 0 < float(confidence) <= 1  # draft_max_probs[1] of the row

    prompts = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 5])
    held_out = split_prompts(prompts, 0.34, seed=0)
    assert set(prompts[held_out].tolist()).isdisjoint(prompts[~held_out].tolist())
    assert len(prompts[held_out].unique()) == 2  # round(0.34 * 6) prompts


def test_confidence_feature_trains_exports_and_serves_and_old_exports_still_load(traces, tmp_path):
    """model.confidence_feature adds the draft's confidence at the first continuation token (draft_max_probs[1])
    as the last of 5d+1 inputs; the export records it; an export written before the key existed loads as off."""
    from data_prep.shards import ShardReader
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli
    from spectrain.kinds.hrad.data import HRADDataModule
    from spectrain.kinds.hrad.traces import first_continuation_confidence

    recipe = fit_cli.compose_recipe(fit_args(traces, "run_name=hrad_conf", "confidence_feature=true"))
    datamodule = HRADDataModule(recipe)
    datamodule.setup("fit")
    reader = ShardReader(traces["out"])
    column = first_continuation_confidence(reader)
    rows = [reader.row(i, ["draft_max_probs"])["draft_max_probs"] for i in range(3)]
    assert column[:3].tolist() == pytest.approx([float(r[1]) for r in rows])
    assert len(datamodule.feature_mean) == 5 * 32 + 1
    used = torch.cat([datamodule.train_set.confidence, datamodule.val_set.confidence])
    assert datamodule.feature_mean[-1] == pytest.approx(float(datamodule.train_set.confidence.mean()), rel=1e-4)
    assert datamodule.summary["confidence_feature"] and 0 < float(used.min()) <= float(used.max()) <= 1

    result = fit_cli.fit(recipe)
    assert result["trained"]
    out = tmp_path / "export"
    assert (
        export_cli.main([f"ckpt={traces['root'] / 'runs' / 'hrad_conf' / 'checkpoints' / 'last.ckpt'}", f"out={out}"])
        == 0
    )
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["confidence_feature"] is True and block["config"]["confidence_feature"] is True
    predictor = load_hrad(out, traces["target"].runner)
    assert predictor.confidence_feature and predictor.model.mlp[0].in_features == 5 * 32 + 1
    hidden, emb = datamodule.val_set.hidden[:2].float(), datamodule.val_set.emb[:2]
    assert predictor.predict(hidden, emb, torch.tensor([0.05, 0.95])).shape == (2, 3)
    with torch.no_grad():  # the feature reaches the classifier (logits: calibrated probabilities may saturate)
        low, high = (predictor.model(hidden, emb, torch.full((2,), c)) for c in (0.05, 0.95))
    assert not torch.allclose(low, high)
    with pytest.raises(ValueError, match=r"pass confidence=\[2\]"):
        predictor.predict(hidden, emb)

    # an export from before the option: no confidence_feature key anywhere -> 5d inputs, as it was trained
    old = tmp_path / "old"
    model = HRAD(HRADConfig(hidden_size=32, gamma=4, boundaries=[1, 3]))
    from core.drafters.hrad import save_native

    save_native(model, old, target=block["target"])
    config = json.loads((old / "config.json").read_text())
    config["spectrain"].pop("confidence_feature")
    config["spectrain"]["config"].pop("confidence_feature")
    (old / "config.json").write_text(json.dumps(config))
    legacy = load_hrad(old, traces["target"].runner)
    assert not legacy.confidence_feature and legacy.predict(hidden, emb).shape == (2, 3)


def test_confidence_path_logit_trains_exports_and_serves(traces, tmp_path, capsys):
    """model.confidence_path=logit through the recipe: trained, exported with the key, served by load_hrad with
    confidence=; an unknown path is refused in one line before any work."""
    from spectrain import export as export_cli
    from spectrain import fit as fit_cli

    result = fit_cli.fit(
        fit_cli.compose_recipe(
            fit_args(traces, "run_name=hrad_conf_logit", "confidence_feature=true", "model.confidence_path=logit")
        )
    )
    assert result["trained"]
    run = traces["root"] / "runs" / "hrad_conf_logit" / "checkpoints"
    assert json.loads((run / "hrad_metrics.json").read_text())["data"]["confidence_path"] == "logit"
    out = tmp_path / "export"
    assert export_cli.main([f"ckpt={run / 'last.ckpt'}", f"out={out}"]) == 0
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["confidence_path"] == "logit" and block["config"]["confidence_feature"] is True
    predictor = load_hrad(out, traces["target"].runner)
    assert predictor.confidence_path == "logit" and predictor.model.mlp[0].in_features == 5 * 32
    assert float(predictor.model.confidence_logit.weight.detach().abs().sum()) > 0  # refitted from its zero start
    fusion = json.loads((out / "metrics.json").read_text())["fusion"]
    assert fusion["mlp_scale"] == pytest.approx(float(predictor.model.mlp_scale)) == block["mlp_scale"]
    hidden, emb = torch.randn(2, 4, 32), torch.randn(2, 32)
    probs = predictor.predict(hidden, emb, torch.tensor([0.05, 0.95]))
    assert probs.shape == (2, 3) and torch.allclose(probs.sum(-1), torch.ones(2))

    capsys.readouterr()
    for extra, message in (
        ("model.confidence_path=late", "confidence_path='late' is not one of input, logit"),
        ("model.confidence_path=logit", "needs confidence_feature=true"),
    ):
        assert fit_cli.main([*fit_args(traces), extra, "dry_run=true"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err


def test_auc_and_the_offline_feature_comparison(traces, tmp_path):
    """benchmarks.hrad_features: the Mann-Whitney AUC (ties count half), and one run over the fixture's traces
    giving every arm (hidden, hidden+conf, hidden+conf_logit trained per seed; conf alone) on the held-out
    prompts."""
    from benchmarks.hrad_features import HRADFeaturesConfig, auc, run, table

    positive = torch.tensor([True, True, False, False])
    assert auc(torch.tensor([0.9, 0.8, 0.1, 0.2]), positive) == 1.0
    assert auc(torch.tensor([0.1, 0.2, 0.9, 0.8]), positive) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), positive) == 0.5
    assert auc(torch.tensor([0.9, 0.3, 0.3, 0.1]), positive) == pytest.approx(0.875)  # one tie: half a pair
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([True, True])))

    cfg = HRADFeaturesConfig(
        target=str(traces["target_dir"]),
        traces=[str(traces["out"])],
        seeds=[0, 1],
        steps=8,
        batch_size=8,
        warmup_steps=2,
        bootstrap=50,
        out=str(tmp_path / "auc.json"),
    )
    summary = run(cfg)
    arms = {(r["trained_on"], r["features"]) for r in summary["results"]}
    assert arms == {
        (None, "conf"),
        ("sps:traces", "hidden"),
        ("sps:traces", "hidden+conf"),
        ("sps:traces", "hidden+conf_logit"),
    }
    for r in summary["results"]:
        assert 0 <= r["auc"] <= 1 and r["evaluated_on"] == "sps:traces"
        assert len(r.get("auc_per_seed", [0, 0])) == 2
    counts = summary["class_counts"]["sps:traces"]
    assert min(counts["held_out"][0], sum(counts["held_out"][1:])) > 0
    assert json.loads((tmp_path / "auc.json").read_text())["held_out_prompts"] == summary["held_out_prompts"]
    assert "| – (no training) | sps:traces | conf |" in table(summary)


# ------------------------------------------------------------------------------ confidence_path=logit


def fake_target_record(hidden: int = 32) -> dict:
    return {"name": "tiny", "num_layers": 4, "hidden_size": hidden, "vocab_size": 61, "embed_probe": [[0.0]]}


def test_confidence_path_logit_export_round_trips_and_old_exports_load_as_input(tmp_path):
    """confidence_path=logit: the MLP reads 5d inputs, the confidence its own Linear(1→3), logits = α·MLP + W·c + b;
    save_native/load_native keep the key, α and every weight (same logits); an export without the key loads as
    "input", as it was trained."""
    from core.drafters.hrad import HRADPredictor, load_native, save_native

    torch.manual_seed(0)
    model = HRAD(
        HRADConfig(hidden_size=32, gamma=4, boundaries=[1, 3], confidence_feature=True, confidence_path="logit")
    ).eval()
    assert model.mlp[0].in_features == 5 * 32 and len(model.feature_mean) == 5 * 32 + 1
    assert model.confidence_logit.weight.abs().sum() == 0 and float(model.mlp_scale) == 1.0  # as training starts
    with torch.no_grad():
        model.confidence_logit.weight.copy_(torch.tensor([[-2.0], [0.5], [1.0]]))
        model.mlp_scale.fill_(0.25)
        model.feature_mean.normal_()
        model.feature_std.uniform_(0.5, 2.0)
        model.temperature.fill_(1.3)
    hidden, emb, conf = torch.randn(6, 4, 32), torch.randn(6, 32), torch.rand(6)
    with torch.no_grad():
        logits = model(hidden, emb, conf)
        # late fusion: moving the confidence shifts the logits by W·Δc/std, whatever the MLP says
        shifted = model(hidden, emb, conf + 0.1)
    std = float(model.feature_std[-1])
    torch.testing.assert_close(
        shifted - logits, (0.1 / std) * model.confidence_logit.weight.T.expand(6, 3), atol=1e-5, rtol=1e-4
    )
    with torch.no_grad():
        mlp_logits, c = model.fusion_inputs(model.features(hidden, emb, conf))
        torch.testing.assert_close(logits, 0.25 * mlp_logits + model.confidence_logit(c))

    out = save_native(model, tmp_path / "logit", target=fake_target_record())
    block = json.loads((out / "config.json").read_text())["spectrain"]
    assert block["confidence_path"] == "logit" and block["config"]["confidence_path"] == "logit"
    assert block["mlp_scale"] == 0.25
    loaded, block = load_native(out)
    assert loaded.config == model.config and loaded.config.confidence_path == "logit"
    assert float(loaded.mlp_scale) == 0.25
    predictor = HRADPredictor(loaded, block)
    assert predictor.confidence_feature and predictor.confidence_path == "logit"
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, emb, conf), logits)
    torch.testing.assert_close(predictor.predict(hidden, emb, conf), model.calibrated_probs(logits))
    with pytest.raises(ValueError, match=r"pass confidence=\[6\]"):
        predictor.predict(hidden, emb)

    # written before confidence_path existed: no key anywhere -> "input" (the confidence as the MLP's last input)
    torch.manual_seed(1)
    old_model = HRAD(HRADConfig(hidden_size=32, gamma=4, boundaries=[1, 3], confidence_feature=True)).eval()
    old = save_native(old_model, tmp_path / "old", target=fake_target_record())
    config = json.loads((old / "config.json").read_text())
    config["spectrain"].pop("confidence_path")
    config["spectrain"]["config"].pop("confidence_path")
    (old / "config.json").write_text(json.dumps(config))
    legacy, legacy_block = load_native(old)
    assert legacy.config.confidence_path == "input" and legacy.confidence_logit is None
    assert not hasattr(legacy, "mlp_scale") and "mlp_scale" not in legacy_block
    assert legacy.mlp[0].in_features == 5 * 32 + 1
    with torch.no_grad():
        torch.testing.assert_close(legacy(hidden, emb, conf), old_model(hidden, emb, conf))
    assert HRADPredictor(legacy, legacy_block).confidence_path == "input"


def test_unknown_confidence_path_is_refused_in_one_line(tmp_path):
    from core.drafters.hrad import load_native, save_native

    for kwargs, message in (
        ({"confidence_feature": True, "confidence_path": "late"}, r"confidence_path='late' is not one of input, logit"),
        ({"confidence_path": "logit"}, "confidence_path=logit .* needs confidence_feature=true"),
    ):
        with pytest.raises(HRADError, match=message) as info:
            HRADConfig(hidden_size=32, **kwargs)
        assert "\n" not in str(info.value)
    # an export whose config names a path this code does not know
    out = save_native(
        HRAD(HRADConfig(hidden_size=32, gamma=4, boundaries=[1, 3])), tmp_path / "x", target=fake_target_record()
    )
    config = json.loads((out / "config.json").read_text())
    config["spectrain"]["config"].update(confidence_feature=True, confidence_path="bilinear")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HRADError, match="confidence_path='bilinear' is not one of"):
        load_native(out)


def test_logit_path_recovers_a_confidence_only_signal_from_few_noisy_rows():
    """Synthetic rows where only the draft's confidence predicts class 0 and the 5d = 2,880 'hidden' inputs are
    noise (a few hundred rows, as on the GSM traces): trained the recipe's way (MLP, then the fusion refitted on
    held-out prompts), the late-fusion H-RAD ranks held-out rows by P(class 0) nearly as well as the confidence
    itself, and gives the MLP little weight; the input path, trained alike, does not get there."""
    from benchmarks.hrad_features import HRADFeaturesConfig, Split, auc, train_hrad

    generator = torch.Generator().manual_seed(0)
    n, d = 700, 576

    def rows(count: int) -> Split:
        confidence = torch.rand(count, generator=generator)
        class0 = torch.rand(count, generator=generator) < torch.sigmoid(-12 * (confidence - 0.4))
        rest = 1 + (torch.rand(count, generator=generator) < confidence).long()  # class 2 likelier when confident
        labels = torch.where(class0, torch.zeros_like(rest), rest)
        hidden = torch.randn(count, 4, d, generator=generator) * torch.logspace(0, 2, d)  # a few huge channels
        return Split(hidden, torch.randn(count, d, generator=generator), confidence, labels, torch.arange(count) // 20)

    train, test = rows(500), rows(n - 500)
    cfg = HRADFeaturesConfig(steps=150)
    model = train_hrad(train, "hidden+conf_logit", cfg, seed=0, gamma=4, boundaries=[1, 3])
    with torch.no_grad():
        p0 = model(test.hidden, test.emb, test.confidence).softmax(-1)[:, 0]
    reference = auc(1 - test.confidence, test.labels == 0)
    late = auc(p0, test.labels == 0)
    assert reference > 0.85  # the signal is there
    assert late > reference - 0.03, (late, reference)
    weight = model.confidence_logit.weight.detach()
    assert float(weight[0]) < float(weight[2])  # low confidence -> class 0
    assert float(model.mlp_scale) < 0.5  # held-out rows give the noise-fitting MLP little weight
    early = train_hrad(train, "hidden+conf", cfg, seed=0, gamma=4, boundaries=[1, 3])
    with torch.no_grad():
        drowned = auc(early(test.hidden, test.emb, test.confidence).softmax(-1)[:, 0], test.labels == 0)
    assert drowned < late - 0.05, (drowned, late)
