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
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import admitted_alone
from safetensors.torch import load_file
# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.models import Eagle3DraftModel
from test_eagle3_export import AUX, DRAFT_VOCAB, VOCAB, lightning_ckpt, make_drafter, tiny_target
from transformers import AutoConfig

from benchmarks.speculators_peer import (features, full_accuracy, load_theirs, our_loss, our_steps, their_forward,
                                         their_loss_mask)
from core.assets import portable_model_reference, target_record
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from core.drafters.eagle3.kind import load_eagle3
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain import export as export_cli


STEPS, DECAY = 3, 0.8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_target(tmp_path_factory)


def saved_tiny_target(tmp_path_factory) -> LoadedModel:
    """A tiny random Llama target (untied head) saved as an HF directory, and its runner."""
    directory = tmp_path_factory.mktemp("target")
    model = tiny_target(0)
    model.save_pretrained(directory)
    return LoadedModel(str(directory), ModelRunner.from_hf_model(model, max_seq_len=64), None, model)


def export_speculators(tmp_path: Path, target: LoadedModel, drafter: Eagle3Drafter, *extra: str,
                       via_native: bool = False) -> Path:
    """Our Lightning checkpoint -> format=speculators; ``via_native``: first format=native, then that directory
    re-exported, as ``make demo`` does."""
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(target.name))
    if via_native:
        assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
        ckpt = tmp_path / "native"
    out = tmp_path / "speculators"
    assert export_cli.main([f"ckpt={ckpt}", "format=speculators", f"out={out}", *extra]) == 0
    return out


def assert_loaded_exactly(theirs: Eagle3DraftModel, directory: Path, target: torch.nn.Module) -> None:
    """Every tensor of the file in the model, every model tensor from the file or (verifier-owned) the target:
    nothing missing, unexpected or left at the library's NaN / random initialisation."""
    file = load_file(str(directory / "model.safetensors"))
    state = theirs.state_dict()
    verifier_owned = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(state) - verifier_owned == set(file) - verifier_owned, set(state) ^ set(file)
    for name, tensor in file.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    t2d = state["t2d"].bool()
    head = target.get_output_embeddings().weight.detach()  # tied targets: the embedding itself
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight.detach())
    assert torch.equal(state["verifier_lm_head.weight"], head[t2d])  # not random, even when the head is tied
    assert torch.equal(state["verifier_norm.weight"], target.model.norm.weight.detach())
    assert not any(torch.isnan(v).any() for v in state.values() if v.is_floating_point())


# ------------------------------------------------------------------------------------------------------------
# One batch through both training forwards


def check_training_forward_agrees(target: LoadedModel, drafter: Eagle3Drafter, theirs: Eagle3DraftModel,
                                  ids: torch.Tensor, supervised: torch.Tensor, tol: float) -> None:
    """One sequence through both training forwards, speculators' loss mask chosen to score our rows."""
    aux, pre_norm = features(target, ids, drafter.config.aux_layer_ids)
    steps = our_steps(drafter, target, ids, aux, pre_norm, supervised, STEPS)
    ours, per_step, entropies = our_loss(steps, DECAY)
    mask = their_loss_mask(target, pre_norm, supervised, drafter.t2d)
    drafts, their_loss, metrics = their_forward(theirs, ids, aux, pre_norm, mask, STEPS, DECAY)
    for j, (student, teacher, rows) in enumerate(steps):
        entropy = -(teacher * teacher.clamp_min(1e-30).log()).sum(-1).mean()
        kl = metrics[f"loss_{j}_sum"] / DECAY**j
        torch.testing.assert_close(kl, per_step[j] - entropy, rtol=tol, atol=tol)  # soft-CE = KL + H(teacher)
        assert torch.equal(drafts[j][0, rows], student.argmax(-1)), f"step {j}: drafted tokens differ"
    for j, acc in enumerate(full_accuracy(steps, ids.shape[1])):
        assert metrics[f"full_acc_{j}_sum"].item() / metrics[f"full_acc_{j}_total"].item() == pytest.approx(acc)
    torch.testing.assert_close(their_loss, ours - entropies, rtol=tol, atol=tol)
    # equal gradients on every parameter both train (speculators freezes lm_head; we train it)
    assert not theirs.lm_head.weight.requires_grad and drafter.lm_head.weight.requires_grad
    ours.backward()
    their_loss.backward()
    for name, param in theirs.named_parameters():
        if param.requires_grad:
            mine = drafter.get_parameter(name.replace("layers.0.", "midlayer."))
            torch.testing.assert_close(param.grad, mine.grad, rtol=100 * tol, atol=tol, msg=name)


# ------------------------------------------------------------------------------------------------------------
# Drafted chains


def our_chain(target: LoadedModel, drafter: Eagle3Drafter, prompt: list[int], gamma: int):
    """The γ tokens our engine drafts after the prompt (eagle3_tree with one child per node = a greedy chain),
    with the features and next tokens it read."""
    algo = build_algorithm("eagle3_tree", target.runner, drafter, tree_depth=gamma, tree_topk=1, tree_total=gamma + 1)
    engine, row = admitted_alone(algo, prompt, max_new_tokens=64)
    start = SimpleNamespace(features=row.draft.features[None], next_tokens=list(row.draft.next_tokens))
    (tree,) = algo.draft_trees([row], algo.new_drafter_cache(1), [None])
    assert tree.parents == list(range(-1, gamma - 1))  # a chain
    return tree.tokens, start


def their_chain(theirs: Eagle3DraftModel, start, ours: list[int], gamma: int) -> list[int]:
    """What speculators drafts from the same context: its TTT forward over the context rows, the last row fed,
    step by step, the chain so far (rows after the last only append keys nobody earlier reads)."""
    tokens = torch.tensor(start.next_tokens + ours[: gamma - 1])[None]
    rows = len(start.next_tokens)
    hidden = torch.cat([start.features, start.features.new_zeros(1, gamma - 1, start.features.shape[-1])], 1)
    with torch.no_grad():
        drafts = theirs(hidden, tokens, torch.zeros_like(tokens), ttt_steps=gamma,
                        position_ids=torch.arange(tokens.shape[1])[None] + 1)
    chain = [int(d[0, rows - 1]) for d in drafts]
    return [c + int(theirs.d2t[c]) for c in chain]


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
    assert Eagle3DraftModel.from_pretrained(str(tmp_path / "a")).config.speculators_config.verifier.name_or_path \
        == str(copy)
    assert export_cli.main([f"ckpt={ckpt}", "format=speculators", "verifier=org/model", f"out={tmp_path / 'b'}"]) == 0
    assert '"name_or_path": "org/model"' in (tmp_path / "b" / "config.json").read_text()  # a hub id, as given
    capsys.readouterr()
    for args, needle in [(["format=sglang", "verifier=org/model"], "speculators layout only"),
                         (["format=speculators", f"verifier={tmp_path / 'none'}"], "is not a directory"),
                         (["format=speculators", f"verifier={tmp_path}"], "has no config.json")]:
        assert export_cli.main([f"ckpt={ckpt}", *args, f"out={tmp_path / 'c'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def library_drafter(tiny, **flags) -> Eagle3DraftModel:
    """An EAGLE-3 drafter as speculators itself builds one for ``tiny`` (``flags``: its EAGLE-3.1 options)."""
    layer = AutoConfig.from_pretrained(tiny.name)
    layer.num_hidden_layers = 1  # the draft's own decoder: one layer shaped like the target's
    used = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    return Eagle3DraftModel.from_training_args(layer, t2d=t2d, d2t=used - torch.arange(DRAFT_VOCAB),
                                               verifier_name_or_path=tiny.name, draft_vocab_size=DRAFT_VOCAB,
                                               norm_before_residual=True, ttt_steps=3, draft_attn_impl="eager",
                                               target_layer_ids=[i + 1 for i in AUX], **flags)


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
    first, second = load_file(str(tmp_path / "theirs" / "model.safetensors")), load_file(str(again / "model.safetensors"))
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
    drafter = Eagle3Drafter(Eagle3Config.for_target(model.config, draft_vocab_size=len(used), aux_layer_ids=aux_ids),
                            embed_weight=model.model.embed_tokens.weight.detach())
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
