"""EAGLE-3 against speculators: exporting to its format, loading it, and comparing chains."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from eagle3_export_builders import AUX, DRAFT_VOCAB, VOCAB, lightning_ckpt, tiny_target
from engine_helpers import admitted_alone
from safetensors.torch import load_file
from speculators.models import Eagle3DraftModel
from transformers import AutoConfig

from benchmarks.speculators_peer import features, full_accuracy, our_loss, our_steps, their_forward, their_loss_mask
from core.assets import target_record
from core.drafters.eagle3 import Eagle3Drafter
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from inference.runner import ModelRunner
from spectrain import export as export_cli

STEPS, DECAY = 3, 0.8


def saved_tiny_target(tmp_path_factory) -> LoadedModel:
    """A tiny random Llama target (untied head) saved as an HF directory, and its runner."""
    directory = tmp_path_factory.mktemp("target")
    model = tiny_target(0)
    model.save_pretrained(directory)
    return LoadedModel(str(directory), ModelRunner.from_hf_model(model, max_seq_len=64), None, model)


def export_speculators(
    tmp_path: Path, target: LoadedModel, drafter: Eagle3Drafter, *extra: str, via_native: bool = False
) -> Path:
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


def check_training_forward_agrees(
    target: LoadedModel,
    drafter: Eagle3Drafter,
    theirs: Eagle3DraftModel,
    ids: torch.Tensor,
    supervised: torch.Tensor,
    tol: float,
) -> None:
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
        drafts = theirs(
            hidden,
            tokens,
            torch.zeros_like(tokens),
            ttt_steps=gamma,
            position_ids=torch.arange(tokens.shape[1])[None] + 1,
        )
    chain = [int(d[0, rows - 1]) for d in drafts]
    return [c + int(theirs.d2t[c]) for c in chain]


def library_drafter(tiny, **flags) -> Eagle3DraftModel:
    """An EAGLE-3 drafter as speculators itself builds one for ``tiny`` (``flags``: its EAGLE-3.1 options)."""
    layer = AutoConfig.from_pretrained(tiny.name)
    layer.num_hidden_layers = 1  # the draft's own decoder: one layer shaped like the target's
    used = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    return Eagle3DraftModel.from_training_args(
        layer,
        t2d=t2d,
        d2t=used - torch.arange(DRAFT_VOCAB),
        verifier_name_or_path=tiny.name,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True,
        ttt_steps=3,
        draft_attn_impl="eager",
        target_layer_ids=[i + 1 for i in AUX],
        **flags,
    )
