"""kind=draft_lm: layer-drop init, the distillation loss and acceptance metric, a short fit, export, engine load."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl
from transformers import LlamaConfig, LlamaForCausalLM

from core.drafters.draft_lm import evenly_spaced_layers, layer_drop_init
from core.overrides import OverrideError
from spectrain import fit as fit_cli
from spectrain.losses import soft_cross_entropy
from spectrain.metrics import SimulatedAcceptance, token_acceptance

REPO = Path(__file__).resolve().parents[2]


def test_evenly_spaced_layers():
    assert evenly_spaced_layers(30, 4) == [0, 10, 19, 29]
    assert evenly_spaced_layers(30, 1) == [0]
    assert evenly_spaced_layers(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="between 1 and the target's 30"):
        evenly_spaced_layers(30, 31)


def test_layer_drop_keeping_every_layer_reproduces_the_target():
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=50,
        )
    ).eval()
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    same = layer_drop_init(target, [0, 1, 2, 3]).eval()
    torch.testing.assert_close(same(ids).logits, target(ids).logits)
    dropped = layer_drop_init(target, [0, 3]).eval()
    assert dropped.config.num_hidden_layers == 2
    torch.testing.assert_close(dropped.model.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    assert dropped.model.layers[1].mlp.up_proj.weight.data_ptr() != target.model.layers[3].mlp.up_proj.weight.data_ptr()


def test_soft_cross_entropy_is_kl_plus_entropy_on_masked_positions():
    torch.manual_seed(0)
    student, teacher_logits = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    teacher = teacher_logits.softmax(-1)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    loss = soft_cross_entropy(student, teacher, mask)
    log_q = student.log_softmax(-1)
    expected = torch.stack([-(teacher[b, t] * log_q[b, t]).sum() for b, t in [(0, 0), (0, 2), (1, 2)]]).mean()
    torch.testing.assert_close(loss, expected)
    assert soft_cross_entropy(teacher_logits, teacher, mask) < loss  # the teacher itself is the minimiser


def test_simulated_acceptance_matches_brute_force():
    torch.manual_seed(0)
    gamma = 3
    alpha = torch.rand(2, 7)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    metric = SimulatedAcceptance(gamma)
    metric.update(alpha, valid)
    result = metric.compute()
    chains, starts = torch.zeros(gamma, dtype=torch.float64), 0
    for b, t in itertools.product(range(2), range(7 - gamma + 1)):
        if valid[b, t : t + gamma].all():
            starts += 1
            for k in range(gamma):
                chains[k] += alpha[b, t : t + k + 1].double().prod()
    chains /= starts
    assert result["tau_sim"].item() == pytest.approx(1 + chains.sum().item(), abs=1e-12)
    assert result["acc_1"].item() == pytest.approx(chains[0].item(), abs=1e-12)
    assert result["acc_2"].item() == pytest.approx((chains[1] / chains[0]).item(), abs=1e-12)


def test_token_acceptance_greedy_and_sampled():
    p = torch.tensor([[0.7, 0.2, 0.1]])
    q_logits = torch.log(torch.tensor([[0.5, 0.4, 0.1]]))
    assert token_acceptance(q_logits, p, greedy=True).item() == 1.0
    assert token_acceptance(q_logits, p, greedy=False).item() == pytest.approx(0.5 + 0.2 + 0.1)


@pytest.fixture()
def draft_recipe(tmp_path: Path):
    """The real draftlm_smollm2 recipe pointed at a tiny random target and a small JSONL source."""
    target = save_tiny_target(tmp_path / "target", layers=4, hidden=32)
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():  # a random tiny target is nearly uniform; sharpen it so there is something to distil
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(target)
    source = write_jsonl(tmp_path / "chats.jsonl", 120)
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    args = [
        "recipe=draftlm_smollm2",
        f"target={target}",
        f"source=jsonl:{source}",
        "n_samples=40",
        "n_val_samples=4",
        "max_len=64",
        "batch_size=4",
        "num_layers=2",
        "max_steps=6",
        "val_check_interval=3",
        "checkpoint_every_n_steps=3",
        "warmup_steps=2",
        f"runs_dir={tmp_path / 'runs'}",
        "lr=1e-2",
        "log_every_n_steps=1",
    ]
    return recipes, args, target


def test_draft_lm_fit_lowers_the_loss_exports_and_loads_in_the_engine(draft_recipe, tmp_path):
    from inference.algorithms import build_algorithm
    from inference.drafters import load_draft_lm, load_lm
    from inference.sampling import SamplingParams

    recipes, args, target = draft_recipe
    cfg = fit_cli.compose_recipe(args, directory=recipes)
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 6
    metrics = result["metrics"]
    assert 1.0 <= metrics["val/tau_sim"] <= 1.0 + cfg.model.gamma
    import csv

    rows = list(csv.DictReader(open(next((tmp_path / "runs" / "draftlm_smollm2" / "logs").glob("*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]  # distillation makes progress on the training stream
    from spectrain import export as export_cli

    ckpt = tmp_path / "runs" / "draftlm_smollm2" / "checkpoints" / "last.ckpt"
    assert export_cli.main([f"ckpt={ckpt}", "format=sglang", f"out={tmp_path / 'x'}"]) == 2  # EAGLE-3 layouts only
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'export'}"]) == 0

    target_lm = load_lm(str(target), max_seq_len=128)
    draft = load_draft_lm(str(tmp_path / "export"), target_lm, max_seq_len=128)
    block = draft.model.config.spectrain
    assert block["kind"] == "draft_lm" and block["kept_layers"] == [0, 3]
    # the metrics of the last validation before the checkpoint was written travel with the export
    assert 1.0 <= block["metrics"]["val/tau_sim"] <= 1.0 + cfg.model.gamma and block["metrics"]["global_step"] == 6
    # it records the chat template it was trained on; serving it under another one is refused in one line
    from core.assets import AssetError, chat_template_hash

    assert block["target"]["chat_template"] == "auto"
    assert block["target"]["chat_template_hash"] == chat_template_hash(target_lm.tokenizer)
    plain = load_lm(str(target), max_seq_len=128, chat_template="none")
    with pytest.raises(AssetError, match="trained on prompts rendered with chat_template=auto"):
        load_draft_lm(str(tmp_path / "export"), plain, max_seq_len=128)
    prompt = [1, 2, 3, 4]
    greedy = SamplingParams(0.0)
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=12, sampling=greedy)
    sps = build_algorithm("sps", target_lm.runner, draft.runner, gamma=3)
    assert sps.generate(prompt, max_new_tokens=12, sampling=greedy).tokens == reference.tokens


def test_unknown_model_key_for_draft_lm_is_refused(draft_recipe):
    recipes, args, _ = draft_recipe
    with pytest.raises(OverrideError, match="unknown key 'model.depth'"):
        fit_cli.compose_recipe([*args, "+model.depth=3"], directory=recipes)


def test_the_window_key_reaches_the_online_data(draft_recipe):
    recipes, args, _ = draft_recipe
    assert fit_cli.compose_recipe(args, directory=recipes).data.window == "start"
    assert fit_cli.compose_recipe(args + ["window=answer"], directory=recipes).data.window == "answer"


def test_token_teacher_trains_the_draft_vocabulary_without_running_the_target(draft_recipe, tmp_path, monkeypatch):
    """recipe draftlm_smollm2_gsm (teacher=tokens, train_vocab=K): the loss is cross-entropy on the next token over
    the K lowest ids only, labels outside them carry no loss and count as rejections, and no batch runs the
    target (its capture is never called)."""
    import torch.nn.functional as F

    from data_prep.capture import HiddenCapture
    from spectrain.kinds.draft_lm.module import DraftLMModule

    recipes, args, _ = draft_recipe
    args = ["recipe=draftlm_smollm2_gsm", *args[1:]]
    cfg = fit_cli.compose_recipe([*args, "train_vocab=300"], directory=recipes)
    assert cfg.model.teacher == "tokens" and cfg.model.train_vocab == 300
    module = DraftLMModule(cfg)
    ids = torch.tensor([[5, 250, 299, 300, 7, 40000, 12]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 0]]),
    }
    loss, greedy, sampled, mask = module._step(batch)
    full = module.drafter(input_ids=ids).logits[0, :-1]
    torch.testing.assert_close(module._logits(batch)[0], module.drafter(input_ids=ids).logits[0, :, :300])
    labels = ids[0, 1:]
    supervised = [t for t in range(6) if mask[0, t] and labels[t] < 300]  # 250, 299 and 7: not 300 nor 40000
    assert supervised == [0, 1, 3]
    expected = F.cross_entropy(full[supervised, :300], labels[supervised])
    torch.testing.assert_close(loss, expected)
    assert greedy[0, 2] == 0 and greedy[0, 4] == 0 and sampled[0, 2] == 0  # undraftable labels: rejections
    torch.testing.assert_close(sampled[0, 0], full[0, :300].softmax(-1)[250])

    def no_capture(*a, **k):
        raise AssertionError("the target ran during teacher=tokens training")

    monkeypatch.setattr(HiddenCapture, "__call__", no_capture)
    result = fit_cli.fit(fit_cli.compose_recipe(args, directory=recipes))
    assert result["trained"] and result["global_step"] == 6
    with pytest.raises(ValueError, match="train_vocab needs model.teacher=tokens"):
        DraftLMModule(fit_cli.compose_recipe([*args, "teacher=target"], directory=recipes))


def _rare_label_batch():
    """Labels (ids[1:]) 250 299 300 7 40000 12 20000 40000 9 with K = 300: 300 and 40000 are supervised ids >= K
    (the batch's extra ids), 20000 is >= K but unsupervised (no loss either way), 9 is unsupervised."""
    ids = torch.tensor([[5, 250, 299, 300, 7, 40000, 12, 20000, 40000, 9]])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 0]]),
    }


def _draft_lm_modules(draft_recipe, *overrides):
    from spectrain.kinds.draft_lm.module import DraftLMModule

    recipes, args, _ = draft_recipe
    args = ["recipe=draftlm_smollm2_gsm", *args[1:], "train_vocab=300"]
    return [DraftLMModule(fit_cli.compose_recipe([*args, *extra], directory=recipes)) for extra in overrides]


def test_train_vocab_labels_adds_the_batchs_rare_label_ids_to_the_trained_logits(draft_recipe):
    """train_vocab_labels=true: the training loss is cross-entropy over the columns [0, K) plus the batch's distinct
    supervised label ids >= K, so a rare label carries loss and its gradient reaches the trainable layers (with the
    option off it carries none); the acceptance metrics and validation stay over the K lowest ids."""
    import torch.nn.functional as F

    on, off = _draft_lm_modules(draft_recipe, ["train_vocab_labels=true"], [])
    assert on.train_vocab_labels and not off.train_vocab_labels
    batch = _rare_label_batch()
    ids, labels = batch["input_ids"], batch["input_ids"][0, 1:]
    loss, greedy, _, mask = on._step(batch, batch_labels=True)
    full = on.drafter(input_ids=ids).logits[0, :-1]
    columns = [*range(300), 300, 40000]  # the batch's extra ids, sorted: 20000 is not supervised
    column_of = {i: c for c, i in enumerate(columns)}
    supervised = [t for t in range(9) if mask[0, t]]
    assert supervised == [0, 1, 2, 3, 4, 5, 7]
    expected = F.cross_entropy(
        full[supervised][:, columns], torch.tensor([column_of[int(labels[t])] for t in supervised])
    )
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    assert greedy[0, 4] == 0 and greedy[0, 7] == 0  # a draft_vocab=K argmax never drafts 40000
    with pytest.warns(UserWarning, match="self.log"):  # training_step takes the extended softmax (no trainer here)
        torch.testing.assert_close(on.training_step(batch, 0), loss)

    # Off (and validation with it on): today's loss, cross-entropy over the K lowest ids, labels >= K skipped.
    off_loss = off._step(batch)[0]
    below_k = [t for t in supervised if labels[t] < 300]
    torch.testing.assert_close(off_loss, F.cross_entropy(full[below_k, :300], labels[below_k]))
    assert torch.equal(on._step(batch)[0], off_loss)

    # Only the rare label supervised: with the option on it carries loss and a gradient into the decoder layers
    # and its own lm_head row; off, it carries neither.
    rare_only = {**batch, "loss_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 0, 0, 0, 0]])}
    for module, batch_labels in ((on, True), (off, False)):
        module.drafter.zero_grad()
        rare_loss = module._step(rare_only, batch_labels=batch_labels)[0]
        rare_loss.backward()
        layer_grad = module.drafter.model.layers[-1].mlp.down_proj.weight.grad.abs().sum()
        row_grad = module.drafter.lm_head.weight.grad[40000].abs().sum()
        if batch_labels:
            # this batch's only extra id is 40000 (300 is no longer a supervised label)
            expected_rare = -full[4, [*range(300), 40000]].log_softmax(-1)[-1]
            torch.testing.assert_close(rare_loss, expected_rare, atol=1e-6, rtol=0)
            assert layer_grad > 0 and row_grad > 0
        else:
            assert rare_loss == 0 and layer_grad == 0 and row_grad == 0


def test_train_vocab_labels_needs_train_vocab_and_the_token_teacher(draft_recipe):
    recipes, args, _ = draft_recipe
    args = ["recipe=draftlm_smollm2_gsm", *args[1:], "train_vocab_labels=true"]
    from spectrain.kinds.draft_lm.module import DraftLMModule

    for bad in (["train_vocab=0"], ["teacher=target"]):
        with pytest.raises(
            ValueError,
            match=r"^model.train_vocab_labels=true needs model.train_vocab=K > 0 and "
            r"model.teacher=tokens [^\n]*model.train_vocab_labels=false$",
        ):
            DraftLMModule(fit_cli.compose_recipe([*args, *bad], directory=recipes))
