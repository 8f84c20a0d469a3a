"""Our EAGLE-3 exports against vLLM's drafter library itself (``speculators`` 0.9.0, installed by ``make install``).

The checks run the library's own code, not a re-implementation: ``Eagle3DraftModel.from_pretrained`` on our
speculators export, its training forward (TTT loss, per-step accuracies, drafted tokens) against ours on the same
weights and batch, the chain it drafts for a context against our engine's, and a checkpoint the library writes
imported, served and re-exported by us. Where the conventions differ, the test pins the difference:

* rows: both pair the target's features at position i with token i+1 (speculators' ``shift_batch``); speculators'
  RoPE positions start at 1, ours at 0 (relative, so the same attention);
* loss mask: speculators scores row i when the INPUT token i+1 is an answer token; we score it when the PREDICTED
  token i+2 is, and only when the target's argmax is in the draft vocabulary. Fed ``loss_mask[p] =
  supervised[p+1] & in_vocab[p]`` it scores exactly our rows;
* loss: speculators' KL(p‖q) vs our soft cross-entropy (= KL + H(p)): equal gradients, values differ by the
  teacher's entropy; both weight step j by decay^j and average each step over its scored rows;
* teacher: speculators applies the target's final norm itself (``verifier_norm``) to the last decoder layer's
  output; our datasets store the normed state;
* ``lm_head``: speculators freezes it (a copy of the target's head over the draft vocabulary); we train it;
* accuracies: speculators' ``full_acc_j`` counts rows whose steps 0..j are all right over the rows step j scores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.models import Eagle3DraftModel
from doc_commands import benchmark_commands
from eagle3_export_builders import AUX, VOCAB, lightning_ckpt, make_drafter
from speculators_builders import (
    DECAY,
    STEPS,
    assert_loaded_exactly,
    check_training_forward_agrees,
    export_speculators,
    library_drafter,
    our_chain,
    saved_tiny_target,
    their_chain,
)

from benchmarks.speculators_peer import features, load_theirs, our_loss, our_steps, parse_args
from core.assets import portable_model_reference, target_record
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from core.drafters.eagle3.kind import load_eagle3
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain import export as export_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_target(tmp_path_factory)


# ------------------------------------------------------------------------------------------------------------
# One batch through both training forwards


# ------------------------------------------------------------------------------------------------------------
# Drafted chains


# ------------------------------------------------------------------------------------------------------------
# Tests on a tiny random Llama target


def test_speculators_loads_our_export_with_nothing_missing(tmp_path, tiny):
    drafter = make_drafter(tiny.model.config)
    directory = export_speculators(tmp_path, tiny, drafter)
    verifier = json.loads((directory / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(Path(tiny.name).resolve())
    theirs = Eagle3DraftModel.from_pretrained(str(directory))  # exactly what a user types
    assert_loaded_exactly(theirs, directory, tiny.model)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in AUX]


def test_speculators_training_forward_equals_ours(tmp_path, tiny):
    drafter = make_drafter(tiny.model.config)
    drafter.use_target_embedding(tiny.model.model.embed_tokens.weight.detach())
    theirs = load_theirs(export_speculators(tmp_path, tiny, drafter))
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 24))
    supervised = torch.zeros(1, 24, dtype=torch.bool)
    supervised[0, 6:20] = True  # an answer in the middle: both mask edges are exercised
    check_training_forward_agrees(tiny, drafter, theirs, ids, supervised, tol=1e-5)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_drafts_our_chain(tmp_path, tiny, norm_before_residual):
    drafter = make_drafter(tiny.model.config, norm_before_residual=norm_before_residual)
    drafter.use_target_embedding(tiny.model.model.embed_tokens.weight.detach())
    theirs = load_theirs(export_speculators(tmp_path, tiny, drafter))
    gamma = 4
    ours, start = our_chain(tiny, drafter, [5, 17, 3, 44, 8, 61, 2, 9], gamma)
    assert their_chain(theirs, start, ours, gamma) == ours


def test_export_names_a_loadable_verifier_or_refuses(tmp_path, tiny, capsys):
    drafter = make_drafter(tiny.model.config)
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(tiny.name))
    copy = shutil.copytree(tiny.name, tmp_path / "moved_target")
    assert export_cli.main([f"ckpt={ckpt}", "format=speculators", f"verifier={copy}", f"out={tmp_path / 'a'}"]) == 0
    assert Eagle3DraftModel.from_pretrained(str(tmp_path / "a")).config.speculators_config.verifier.name_or_path == str(
        copy
    )
    assert export_cli.main([f"ckpt={ckpt}", "format=speculators", "verifier=org/model", f"out={tmp_path / 'b'}"]) == 0
    assert '"name_or_path": "org/model"' in (tmp_path / "b" / "config.json").read_text()  # a hub id, as given
    capsys.readouterr()
    for args, needle in [
        (["format=sglang", "verifier=org/model"], "speculators layout only"),
        (["format=speculators", f"verifier={tmp_path / 'none'}"], "is not a directory"),
        (["format=speculators", f"verifier={tmp_path}"], "has no config.json"),
    ]:
        assert export_cli.main([f"ckpt={ckpt}", *args, f"out={tmp_path / 'c'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_library_checkpoint_imports_serves_and_reexports_identically(tmp_path, tiny):
    """A checkpoint speculators itself writes -> import= -> lossless eagle3_tree -> format=speculators again."""
    theirs = library_drafter(tiny)
    with torch.no_grad():  # trained-looking weights: the library initialises its norms to ones
        for name, param in theirs.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                param.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "theirs")
    native, again = tmp_path / "native", tmp_path / "again"
    assert export_cli.main([f"import={tmp_path / 'theirs'}", f"target={tiny.name}", f"out={native}"]) == 0
    drafter = load_eagle3(str(native), tiny)
    assert drafter.config.norm_before_residual and drafter.config.aux_layer_ids == AUX
    greedy, prompt = SamplingParams(0.0), [5, 17, 3, 44, 8]
    reference = build_algorithm("ar", tiny.runner).generate(prompt, max_new_tokens=12, sampling=greedy)
    tree = build_algorithm("eagle3_tree", tiny.runner, drafter, tree_depth=3, tree_topk=2, tree_total=6)
    assert tree.generate(prompt, max_new_tokens=12, sampling=greedy).tokens == reference.tokens
    assert export_cli.main([f"ckpt={native}", "format=speculators", f"out={again}"]) == 0
    first, second = (
        load_file(str(tmp_path / "theirs" / "model.safetensors")),
        load_file(str(again / "model.safetensors")),
    )
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and torch.equal(tensor, second[name]), name
    assert_loaded_exactly(load_theirs(again), again, tiny.model)


# ------------------------------------------------------------------------------------------------------------
# The embedded SmolLM2 (tied embeddings) with a drafter trained on its features


@pytest.fixture(scope="module")
def smollm2_trained(smollm2, tmp_path_factory):
    """An EAGLE-3 drafter for SmolLM2 trained for a few steps with our TTT loss on the target's own features,
    exported as ``make demo`` does (native, then that directory as speculators; the verifier by default)."""
    model, tokenizer = smollm2
    target = LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=96), tokenizer, model)
    vocab = model.config.vocab_size
    text = "Speculative decoding drafts a few tokens and the target checks them in one forward pass."
    ids = torch.tensor([tokenizer(text)["input_ids"][:40]])
    aux_ids = [1, 13, 26]
    with torch.no_grad():
        aux, pre_norm = features(target, ids, aux_ids)
        teacher = model.lm_head(model.model.norm(pre_norm))[0]
    used = torch.unique(torch.cat([ids[0], teacher.argmax(-1), torch.arange(256)]))  # a reduced vocabulary
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    torch.manual_seed(0)
    drafter = Eagle3Drafter(
        Eagle3Config.for_target(model.config, draft_vocab_size=len(used), aux_layer_ids=aux_ids),
        embed_weight=model.model.embed_tokens.weight.detach(),
    )
    drafter.set_vocab_map(used - torch.arange(len(used)), t2d)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(model.lm_head.weight[used])
    supervised = torch.ones_like(ids, dtype=torch.bool)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(6):
        loss, _, _ = our_loss(our_steps(drafter, target, ids, aux, pre_norm, supervised, STEPS), DECAY)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    directory = tmp_path_factory.mktemp("smollm2_export")
    return target, drafter, export_speculators(directory, target, drafter, via_native=True), ids


@pytest.mark.real_model
def test_smollm2_export_loads_and_agrees_in_speculators(smollm2_trained):
    target, drafter, directory, ids = smollm2_trained
    verifier = json.loads((directory / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == portable_model_reference("smollm2") != "smollm2"  # never our alias
    assert "lm_head.weight" not in load_file(str(Path(verifier["name_or_path"]) / "model.safetensors"))  # tied
    assert_loaded_exactly(Eagle3DraftModel.from_pretrained(str(directory)), directory, target.model)
    theirs = load_theirs(directory).eval()
    drafter.zero_grad()
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    supervised[0, 8:] = True
    check_training_forward_agrees(target, drafter, theirs, ids, supervised, tol=2e-4)
    gamma = 4
    ours, start = our_chain(target, drafter, ids[0, :20].tolist(), gamma)
    assert their_chain(theirs, start, ours, gamma) == ours


@pytest.mark.parametrize(
    ("where", "argv"), [(where, argv) for where, _, argv in benchmark_commands("speculators_peer")]
)
def test_the_documented_peer_benchmark_commands_parse(where, argv):
    """Here, where speculators is imported anyway (tests/benchmarks/test_bench_cli.py parses the other benchmarks')."""
    assert parse_args(argv).threads == 1, where
