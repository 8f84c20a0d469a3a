"""EAGLE-3.1 (``fc_norm``, ``norm_output``; docs/algorithms/eagle3.md §7): what each flag changes and what it
leaves alone, training and serving as one computation with the flags on (rows of a batched call bitwise their solo
calls in row-exact mode), a fit that trains them, the exports (native, and speculators checked by the installed
library itself: it loads our export, its training forward and drafted chain agree with ours, a checkpoint it writes
is imported and served losslessly) and the engine honouring what the export says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from speculators.models import Eagle3DraftModel
from drafter_rows_helpers import check_batched_rows_equal_solo, check_serving_chain_equals_training, eagle3
from eagle3_export_builders import VOCAB, lightning_ckpt, make_drafter
from eagle3_training_builders import eagle3_fit_setup
from speculators_builders import (
    assert_loaded_exactly,
    check_training_forward_agrees,
    export_speculators,
    library_drafter,
    our_chain,
    saved_tiny_target,
    their_chain,
)

from benchmarks.speculators_peer import load_theirs
from core.assets import target_record
from core.drafters.eagle3 import Eagle3Drafter
from core.drafters.eagle3.layouts import FC_NORM_TENSORS, expected_names, read_checkpoint
from core.drafters.peagle import PEagleConfig
from inference.algorithms import build_algorithm
from core.drafters.eagle3.kind import load_eagle3
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain import export as export_cli
from spectrain import fit as fit_cli
from spectrain.adapt.drafters import Eagle3Adaptable

FLAGS = {"fc_norm": True, "norm_output": True}
GREEDY = SamplingParams(0.0)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_target(tmp_path_factory)


def with_flags(drafter: Eagle3Drafter, **flags: bool) -> Eagle3Drafter:
    """A drafter with ``drafter``'s weights (the same tensors) and the flags ``flags``; fc_norm's norms keep
    ``drafter``'s when it has them, else ones."""
    config = type(drafter.config)(**{**drafter.config.to_dict(), "fc_norm": False, "norm_output": False, **flags})
    other = Eagle3Drafter(config, embed_weight=drafter.embed_tokens.weight)
    state = drafter.state_dict()
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= set(FC_NORM_TENSORS)
    return other.eval()


def test_flags_off_add_nothing_and_each_flag_changes_only_its_part(tiny):
    base = make_drafter(tiny.model.config).eval()
    assert not hasattr(base, "fc_norm") and not set(FLAGS) & set(base.config.to_dict())  # EAGLE-3's record
    assert set(base.state_dict()) - {"embed_tokens.weight"} == expected_names(base.config)
    assert expected_names(make_drafter(tiny.model.config, **FLAGS).config) == expected_names(base.config) | set(
        FC_NORM_TENSORS
    )
    with pytest.raises(ValueError, match="P-EAGLE runs without EAGLE-3.1's fc_norm and norm_output"):
        PEagleConfig(**base.config.to_dict(), mask_token_id=0, norm_output=True)  # its layouts carry neither
    ids, aux = torch.randint(0, VOCAB, (1, 9)), torch.randn(1, 9, 96)
    with torch.no_grad():
        off = base(ids, aux, steps=3)
        # norm_output: the same logits at step 0, the normed state handed on, so later steps differ
        normed = with_flags(base, norm_output=True)(ids, aux, steps=3)
        assert torch.equal(normed.logits[0], off.logits[0])
        assert torch.equal(normed.hidden[0], base.norm(off.hidden[0]))
        assert not torch.allclose(normed.logits[1], off.logits[1], atol=1e-3)
        # fc_norm: fc reads each aux layer through its own norm, nothing else changes
        fc_normed = with_flags(base, fc_norm=True)
        for i, norm in enumerate(fc_normed.fc_norm):
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
        slices = aux.chunk(3, dim=-1)
        by_hand = torch.cat([norm(x) for norm, x in zip(fc_normed.fc_norm, slices)], dim=-1)
        assert torch.equal(fc_normed.project(aux), base.project(by_hand))
        assert torch.equal(fc_normed(ids, aux).logits[0], base(ids, by_hand).logits[0])


def test_training_time_test_equals_serving_a_chain_with_the_flags(tiny):
    """Step j of the training forward at row i == serving rows 0..i, then j drafted rows fed their own hidden."""
    model = make_drafter(tiny.model.config, **FLAGS).eval()
    length, steps, row = 9, 4, 3
    ids, aux = torch.randint(0, VOCAB, (1, length)), torch.randn(1, length, 96)
    with torch.no_grad():
        trained = model(ids, aux, steps=steps)
    check_serving_chain_equals_training(model, ids, aux, trained, row, steps, cache_len=32)


@pytest.mark.parametrize("exact", [pytest.param(True, id="row_exact"), pytest.param(False, id="padded")])
def test_batched_rows_equal_their_solo_calls_with_the_flags(exact):
    drafter = eagle3(exact, **FLAGS)
    assert all(norm.exact == exact for norm in drafter.fc_norm)  # the new norms follow the mode too
    check_batched_rows_equal_solo(drafter, [5, 2, 7], exact, 32)


def test_export_loads_in_the_engine_losslessly_and_honours_the_flags(tmp_path, tiny, capsys):
    drafter = make_drafter(tiny.model.config, **FLAGS)
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(tiny.name))
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
    loaded = load_eagle3(str(tmp_path / "native"), tiny)
    assert loaded.config.fc_norm and loaded.config.norm_output
    for name, tensor in drafter.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[name], tensor), name
    prompts = [[5, 17, 3, 44, 8], [9, 2, 61, 7, 30, 12, 4]]
    reference = [
        build_algorithm("ar", tiny.runner).generate(p, max_new_tokens=12, sampling=GREEDY).tokens for p in prompts
    ]
    tree = build_algorithm("eagle3_tree", tiny.runner, loaded, tree_depth=3, tree_topk=2, tree_total=6)
    assert tree.generate(prompts[0], max_new_tokens=12, sampling=GREEDY).tokens == reference[0]
    two_rows = ModelRunner.from_hf_model(tiny.model, max_seq_len=64, max_batch_size=2)
    side_by_side = build_algorithm("eagle3_tree", two_rows, loaded, tree_depth=3, tree_topk=2, tree_total=6)
    batched = side_by_side.generate_batch(prompts, max_new_tokens=12, sampling=GREEDY)  # the engine's batched rows
    assert [r.tokens for r in batched] == reference
    # the engine drafts with what the export says: other fc_norm weights, or norm_output off, draft differently
    chain, start = our_chain(tiny, loaded, prompts[1], 4)
    with torch.no_grad():
        loaded.fc_norm[1].weight.mul_(3.0)
    assert our_chain(tiny, loaded, prompts[1], 4)[0] != chain
    with torch.no_grad():
        loaded.fc_norm[1].weight.div_(3.0)
    assert our_chain(tiny, loaded, prompts[1], 4)[0] == chain
    loaded.config.norm_output = False
    assert our_chain(tiny, loaded, prompts[1], 4)[0] != chain
    # the sglang layout has no such fields: refused in one line, nothing written
    capsys.readouterr()
    assert export_cli.main([f"ckpt={ckpt}", "format=sglang", f"out={tmp_path / 'sglang'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sglang layout has no EAGLE-3.1 fields" in err and "\n" not in err, err
    assert not (tmp_path / "sglang").exists()


def test_speculators_loads_our_eagle31_export_and_agrees(tmp_path, tiny):
    drafter = make_drafter(tiny.model.config, **FLAGS)
    drafter.use_target_embedding(tiny.model.model.embed_tokens.weight.detach())
    directory = export_speculators(tmp_path, tiny, drafter)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["fc_norm"] is True and raw["norm_output"] is True and raw["norm_before_fc"] is False
    assert set(FC_NORM_TENSORS) <= set(load_file(str(directory / "model.safetensors")))
    theirs = Eagle3DraftModel.from_pretrained(str(directory))
    assert theirs.config.fc_norm and theirs.config.norm_output and len(theirs.fc_norm) == 3
    assert_loaded_exactly(theirs, directory, tiny.model)
    theirs = load_theirs(directory)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 24))
    supervised = torch.zeros(1, 24, dtype=torch.bool)
    supervised[0, 6:20] = True
    check_training_forward_agrees(tiny, drafter, theirs, ids, supervised, tol=1e-5)  # fc_norm's gradients too
    ours, start = our_chain(tiny, drafter, [5, 17, 3, 44, 8, 61, 2, 9], 4)
    assert their_chain(theirs, start, ours, 4) == ours
    # and back: the import reads the flags and the tensors it wrote
    assert export_cli.main([f"import={directory}", f"out={tmp_path / 'back'}"]) == 0
    back = read_checkpoint(tmp_path / "back")
    assert back.config == drafter.config
    assert all(torch.equal(back.tensors[n], t) for n, t in drafter.state_dict().items() if n in back.tensors)


def test_library_eagle31_checkpoint_imports_and_serves_losslessly(tmp_path, tiny):
    theirs = library_drafter(tiny, **FLAGS)
    with torch.no_grad():  # trained-looking weights: the library initialises its norms to ones
        for name, param in theirs.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                param.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "theirs")
    assert export_cli.main([f"import={tmp_path / 'theirs'}", f"target={tiny.name}", f"out={tmp_path / 'n'}"]) == 0
    drafter = load_eagle3(str(tmp_path / "n"), tiny)
    assert drafter.config.fc_norm and drafter.config.norm_output
    assert torch.equal(drafter.fc_norm[2].weight, theirs.fc_norm[2].weight.detach())
    prompt = [5, 17, 3, 44, 8]
    reference = build_algorithm("ar", tiny.runner).generate(prompt, max_new_tokens=12, sampling=GREEDY)
    tree = build_algorithm("eagle3_tree", tiny.runner, drafter, tree_depth=3, tree_topk=2, tree_total=6)
    assert tree.generate(prompt, max_new_tokens=12, sampling=GREEDY).tokens == reference.tokens
    ours, start = our_chain(tiny, drafter, [5, 17, 3, 44, 8, 61, 2, 9], 4)
    assert their_chain(theirs.eval(), start, ours, 4) == ours


def test_fit_trains_the_flags_and_exports_them(tmp_path):
    recipes, args, target = eagle3_fit_setup(
        tmp_path, "eagle31_smollm2_gsm", chats=40, samples=16, steps=2, every=2, warmup=1
    )
    cfg = fit_cli.compose_recipe(args, directory=recipes)
    assert cfg.model.fc_norm and cfg.model.norm_output  # what the recipe sets
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 2
    ckpt = tmp_path / "runs" / "eagle31_smollm2_gsm" / "checkpoints" / "last.ckpt"
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
    exported = read_checkpoint(tmp_path / "native")
    assert exported.config.fc_norm and exported.config.norm_output
    assert all((exported.tensors[n] != 1).any() for n in FC_NORM_TENSORS)  # trained from their ones


def test_serving_time_adapter_scores_the_drafter_as_it_drafts(tiny):
    """``adapt=bandit``'s head arm reuses the drafter's hidden states: with norm_output they are already normed, so
    its loss must equal the full arm's at the same weights (the final norm applied once)."""
    drafter = make_drafter(tiny.model.config, **FLAGS)
    adaptable = Eagle3Adaptable(drafter)
    record = adaptable.synthetic_record(24, prompt_len=6)
    with torch.no_grad():
        full = float(adaptable.loss_closure(record, "full")())
        assert float(adaptable.loss_closure(record, "head")()) == pytest.approx(full, rel=1e-5)
