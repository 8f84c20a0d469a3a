"""The drafter's sliding-window attention (``attention_window``, docs/algorithms/eagle3.md §8): off adds nothing and
a window wider than the context changes nothing (bitwise); training and serving count it alike past the window;
drafts change only once the context is longer than the window; serving stays lossless (EAGLE-3 tree and P-EAGLE,
solo and batched rows, row-exact calls bitwise their solo calls); every export records it (native, speculators as
the installed library reads it; the sglang layout refuses it); and the long-context benchmark runs on it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from speculators.models import Eagle3DraftModel
from drafter_rows_helpers import check_batched_rows_equal_solo, check_serving_chain_equals_training, eagle3
from eagle3_export_builders import VOCAB, lightning_ckpt, make_drafter
from peagle_export_builders import make_peagle
from engine_helpers import admitted_alone
from speculators_builders import export_speculators, saved_tiny_target
from tiny_targets import SMOLLM2_VOCAB, save_tiny_target, set_random_vocab_map, smollm2_tokenizer
from transformers import AutoConfig

from benchmarks import tau_context
from core.assets import target_record
from core.drafters.eagle3 import MIN_WINDOW, Eagle3Config, Eagle3Drafter
from core.drafters.eagle3.layouts import read_checkpoint
from core.drafters.peagle.attention import ChainLayout
from core.errors import UserError
from core.prompts import render_prompt
from inference.algorithms import build_algorithm
from core.drafters.eagle3.kind import load_eagle3
from inference.drafters import LoadedModel
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain import export as export_cli

W = MIN_WINDOW
GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target of the export tests, with room for prompts longer than a window."""
    saved = saved_tiny_target(tmp_path_factory)
    return LoadedModel(saved.name, ModelRunner.from_hf_model(saved.model, max_seq_len=112), None, saved.model)


def windowed(drafter: Eagle3Drafter, window: int) -> Eagle3Drafter:
    """The same module (weights shared) under another window; ``drafter`` keeps its own config."""
    other = Eagle3Drafter(replace(drafter.config, attention_window=window), embed_weight=drafter.embed_tokens.weight)
    other.load_state_dict(drafter.state_dict())
    return other.eval()


def serve(drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor):
    """The rows of one sequence served in one call (causal), as a drafter reads a prompt."""
    with torch.no_grad():
        length = ids.shape[1] - 1
        return drafter.step(
            ids[:, 1:], drafter.project(aux[:, :length]), torch.arange(length)[None], drafter.new_cache(64)
        )


def test_off_adds_nothing_and_a_window_wider_than_the_context_changes_nothing(tiny):
    base = make_drafter(tiny.model.config).eval()
    assert "attention_window" not in base.config.to_dict()  # EAGLE-3's record, as before the field existed
    wide = windowed(base, 64)
    assert wide.config.to_dict()["attention_window"] == 64
    ids, aux = torch.randint(0, VOCAB, (2, 40)), torch.randn(2, 40, 96)
    with torch.no_grad():
        off, on = base(ids, aux, steps=3), wide(ids, aux, steps=3)
    for j in range(3):  # positions < 40 + 3 <= 64: the same masks, the same computation
        assert torch.equal(off.logits[j], on.logits[j]) and torch.equal(off.hidden[j], on.hidden[j])
    assert torch.equal(serve(base, ids[:1], aux[:1]).logits, serve(wide, ids[:1], aux[:1]).logits)
    with pytest.raises(UserError, match=rf"attention_window=8 is narrower .* or attention_window >= {W}$"):
        Eagle3Config(**{**base.config.to_dict(), "attention_window": 8})


def test_training_time_test_equals_serving_a_chain_past_the_window(tiny):
    """Step j of the training forward at row i == serving rows 0..i, then j drafted rows fed their own hidden, with a
    context longer than the window (and the window changes those logits)."""
    model = windowed(make_drafter(tiny.model.config), W)
    length, steps, row = 48, 4, 40
    ids, aux = torch.randint(0, VOCAB, (1, length)), torch.randn(1, length, 96)
    with torch.no_grad():
        trained = model(ids, aux, steps=steps)
        full = windowed(model, 0)(ids, aux, steps=steps)
    check_serving_chain_equals_training(model, ids, aux, trained, row, steps, cache_len=64)
    for j in range(1, steps):  # past the window, the window changes what is drafted
        assert not torch.allclose(trained.logits[j][0, row], full.logits[j][0, row], atol=1e-4)
    # rows whose every position stays inside the window are the full attention's, bitwise
    assert torch.equal(trained.logits[0][:, :W], full.logits[0][:, :W])


def test_drafts_differ_only_where_the_context_passes_the_window(tiny):
    base = make_drafter(tiny.model.config).eval()
    ids, aux = torch.randint(0, VOCAB, (1, 46)), torch.randn(1, 46, 96)
    off, on = serve(base, ids, aux), serve(windowed(base, W), ids, aux)
    assert torch.equal(off.logits[:, :W], on.logits[:, :W])  # rows at positions < W read the same keys
    assert not torch.allclose(off.logits[:, W:], on.logits[:, W:], atol=1e-4)


@pytest.mark.parametrize("exact", [pytest.param(True, id="row_exact"), pytest.param(False, id="padded")])
def test_batched_rows_equal_their_solo_calls_under_a_window(exact):
    drafter = eagle3(exact, attention_window=W)
    check_batched_rows_equal_solo(drafter, [40, 9, 33], exact, 64)


def test_windowed_drafters_serve_losslessly_and_draft_with_their_window(tiny):
    prompts = [[(7 * i + 3) % VOCAB for i in range(50)], [(5 * i + 1) % VOCAB for i in range(41)]]
    reference = [
        build_algorithm("ar", tiny.runner).generate(p, max_new_tokens=8, sampling=GREEDY).tokens for p in prompts
    ]
    two_rows = ModelRunner.from_hf_model(tiny.model, max_seq_len=112, max_batch_size=2)
    base = make_drafter(tiny.model.config)
    base.use_target_embedding(tiny.model.model.embed_tokens.weight.detach())
    peagle = make_peagle(tiny.model.config, attention_window=W)
    for drafter, name, options in (
        (windowed(base, W), "eagle3_tree", dict(tree_depth=3, tree_topk=2, tree_total=6)),
        (peagle.eval(), "peagle", {}),
    ):
        solo = build_algorithm(name, tiny.runner, drafter, **options)
        assert [solo.generate(p, max_new_tokens=8, sampling=GREEDY).tokens for p in prompts] == reference
        side_by_side = build_algorithm(name, two_rows, drafter, **options)
        assert [r.tokens for r in side_by_side.generate_batch(prompts, max_new_tokens=8, sampling=GREEDY)] == reference
    # the engine drafts with the window: past it, the root of its first tree reads other logits than the full
    # attention's
    roots = []
    for window in (W, 0):
        tree = build_algorithm(
            "eagle3_tree", tiny.runner, windowed(base, window), tree_depth=2, tree_topk=2, tree_total=4
        )
        _, row = admitted_alone(tree, prompts[0])
        logits: dict[int, torch.Tensor] = {}
        tree.draft_trees([row], tree.new_drafter_cache(1), [logits])
        roots.append(logits[-1])
    assert not torch.allclose(roots[0], roots[1], atol=1e-4)
    # P-EAGLE's chain attention has no window: training one is refused, serving honours it
    with pytest.raises(ValueError, match="P-EAGLE trains without a sliding window; .*train with attention_window=0"):
        peagle(
            torch.zeros(1, 4, dtype=torch.long),
            torch.zeros(1, 4, 96),
            ChainLayout(
                torch.zeros(1, 1, dtype=torch.long),
                torch.ones(1, 1, dtype=torch.long),
                torch.ones(1, 1, dtype=torch.bool),
            ),
        )


def test_exports_record_the_window(tmp_path, tiny, capsys):
    drafter = make_drafter(tiny.model.config, attention_window=48)
    drafter.use_target_embedding(tiny.model.model.embed_tokens.weight.detach())
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(tiny.name))
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
    raw = json.loads((tmp_path / "native" / "config.json").read_text())
    assert raw["spectrain"]["architecture"]["attention_window"] == 48
    assert load_eagle3(str(tmp_path / "native"), tiny).config.attention_window == 48
    # speculators: the fields the library's model reads, and back
    directory = export_speculators(tmp_path, tiny, drafter)
    layer = json.loads((directory / "config.json").read_text())["transformer_layer_config"]
    assert (layer["sliding_window"], layer["use_sliding_window"], layer["layer_types"]) == (
        48,
        True,
        ["sliding_attention"],
    )
    theirs = Eagle3DraftModel.from_pretrained(str(directory))
    assert theirs.sliding_window == 48 and theirs.sliding_window_indices == [0] and not theirs.uses_full_attn
    assert export_cli.main([f"import={directory}", f"out={tmp_path / 'back'}"]) == 0
    assert read_checkpoint(tmp_path / "back").config == drafter.config
    # a drafter without a window writes none of those fields
    (tmp_path / "plain").mkdir()
    plain = export_speculators(tmp_path / "plain", tiny, make_drafter(tiny.model.config))
    assert not {"sliding_window", "layer_types"} & set(
        json.loads((plain / "config.json").read_text())["transformer_layer_config"]
    )
    # the sglang layout has no such field: refused in one line, nothing written
    capsys.readouterr()
    assert export_cli.main([f"ckpt={ckpt}", "format=sglang", f"out={tmp_path / 'sglang'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sglang layout has no sliding-window field" in err and "\n" not in err, err
    assert not (tmp_path / "sglang").exists()


def test_long_context_bench_fills_each_length_and_stays_lossless(tmp_path):
    """The benchmark on a tiny target with SmolLM2's tokenizer: each prompt is the longest that fits its length
    (one more solved problem would not), and every run, windowed or not, answers as AR does."""
    target = save_tiny_target(tmp_path / "target", layers=4, hidden=32, logit_scale=30.0)
    torch.manual_seed(0)
    config = Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    drafter = Eagle3Drafter(config)
    set_random_vocab_map(drafter, SMOLLM2_VOCAB, 256)
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(str(target)))
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'exports' / 'eagle3'}"]) == 0
    out = tmp_path / "out"
    assert (
        tau_context.main(
            [
                f"target={target}",
                f"drafters={tmp_path / 'exports'}",
                "algorithms=eagle3_tree",
                "contexts=[200,400]",
                f"attention_windows=[{W}]",
                "n_prompts=1",
                "max_new_tokens=6",
                "max_seq_len=512",
                "tree_depth=2",
                "tree_topk=2",
                "tree_total=4",
                "warmup=false",
                f"out={out}",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    runs = {(r["algorithm"], r["attention_window"], r["context"]): r for r in results["runs"]}
    assert set(runs) == {(a, w, c) for a, w in (("ar", 0), ("eagle3_tree", 0), ("eagle3_tree", W)) for c in (200, 400)}
    assert all(r["greedy_equal_to_ar"] for r in runs.values())
    short, long = runs["ar", 0, 200], runs["ar", 0, 400]
    assert short["prompt_tokens"][0] <= 200 < long["prompt_tokens"][0] <= 400 and short["shots"] < long["shots"]
    questions, shots = tau_context.shots_and_questions(1)
    k = long["shots"][0]
    one_more = render_prompt(
        smollm2_tokenizer(),
        [t for s in shots[: k + 1] for t in s.turns[:2]]
        + [{"role": "user", "content": questions[0].first_user_message}],
    )
    assert len(one_more) > 400
    assert (out / "tau_context.png").stat().st_size > 0
