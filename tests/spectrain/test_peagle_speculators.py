"""Our P-EAGLE drafter, COD sampling, loss and gradients against vLLM's drafter library itself (``speculators`` 0.9.0,
``PEagleDraftModel``), on the same weights, batch and sampled rows.

Conventions pinned here: the library's batch is EAGLE-3's ``shift_batch``-ed one (row q = the target's features at q
and token q + 1, its teacher the target's distribution at q + 1), the same rows as ours; its ``loss_mask[q]`` is our
``scored_rows`` (token q + 2 supervised); its teacher applies the target's final norm itself (``verifier_norm``) to the
last layer's output, ours reads the normed state; its loss divides by (scored rows + 1e-5), ours by the scored rows;
it trains the token embedding (``embed_requires_grad``), we keep the target's frozen.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.models.peagle.data import generate_cod_sample_indices
from speculators.proposals.greedy import GreedyTokenProposalConfig
from dflash_interop_builders import target_features
from eagle3_export_builders import AUX, DRAFT_VOCAB, VOCAB, tiny_target
from peagle_export_builders import DEPTHS, MASK, make_peagle
from speculators_builders import assert_loaded_exactly
from transformers import AutoConfig, LlamaConfig

from core.assets import target_record
from core.drafters.eagle3.layouts import CheckpointError
from core.drafters.peagle import PEagleDrafter
from core.drafters.peagle.layouts import read_checkpoint
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from core.drafters.peagle.kind import load_peagle
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain import export as export_cli
from spectrain.kinds.dflash.losses import weighted_kl
from spectrain.kinds.peagle.losses import batch_chains, cod_sample, scored_rows

RATIO, RATIO_MIN = 0.7, 0.2


def theirs_for(ours: PEagleDrafter) -> PEagleDraftModel:
    """The library's model with our drafter's shapes and weights (eager attention: its flex attention fails on short
    CPU inputs)."""
    c = ours.config
    layer = LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.resolved_head_dim,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
    )
    layer._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=c.draft_vocab_size,
        norm_before_residual=c.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in AUX],
        mask_token_id=c.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.num_depths)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    theirs = PEagleDraftModel(config)
    state = {name.replace("midlayer.", "layers.0."): t for name, t in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"] and not unexpected
    return theirs


def test_norm_before_residual_defaults_are_pinned():
    # speculators defaults both kinds to False; vLLM's config conversion (vllm/transformers_utils/configs/speculators/
    # algos.py) defaults update_eagle3 to True and update_peagle to False when the field is absent. Our exports always
    # write it; our reader of a foreign peagle config takes vLLM's False (the import test below).
    assert Eagle3SpeculatorConfig.model_fields["norm_before_residual"].default is False
    assert PEagleSpeculatorConfig.model_fields["norm_before_residual"].default is False
    assert PEagleSpeculatorConfig.model_fields["embed_requires_grad"].default is True


@pytest.mark.parametrize("max_anchors", [None, 9])
def test_cod_sampling_draws_the_librarys_rows(max_anchors):
    scored = torch.zeros(40, dtype=torch.bool)
    scored[5:18] = scored[21:37] = True  # two answers: chains stop at their ends
    torch.manual_seed(3)
    anchor_pos, depth = generate_cod_sample_indices(
        40,
        scored.float()[None],
        num_depths=6,
        down_sample_ratio=RATIO,
        down_sample_ratio_min=RATIO_MIN,
        max_anchors=max_anchors,
    )
    anchors, depths = cod_sample(scored, 6, RATIO, RATIO_MIN, max_anchors, torch.Generator().manual_seed(3))
    theirs = sorted(zip(anchor_pos[40:].tolist(), depth[40:].tolist()))
    assert list(zip(anchors.tolist(), depths.tolist())) == theirs and len(theirs) > (20 if max_anchors is None else 8)
    assert bool(scored[anchors + depths].all())  # every chain row is a scored row
    assert depths.bincount().tolist()[1:] == [int(x) for x in depth.bincount().tolist()[1:]]


def test_the_training_forward_loss_and_gradients_agree_with_the_library():
    target = tiny_target(0)
    ours = make_peagle(target.config)
    ours.use_target_embedding(target.model.embed_tokens.weight.detach())
    theirs = theirs_for(ours)
    head_rows = target.lm_head.weight.detach()[ours.draft_ids_in_target()]
    with torch.no_grad():  # the library's teacher: the target's final norm and head rows of the draft vocabulary
        theirs.verifier_lm_head.weight.copy_(head_rows)
        theirs.verifier_norm.weight.copy_(target.model.norm.weight)
    length = 40
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    supervised = torch.zeros(1, length, dtype=torch.bool)
    supervised[0, 8:30] = supervised[0, 33:] = True
    aux, pre_norm = target_features(target, ids, AUX)
    scored = scored_rows(supervised)

    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, out: captured.append(out))
    torch.manual_seed(0)
    _, their_loss, metrics = theirs(
        aux[:, :-1],
        ids[:, 1:],
        torch.zeros(1, length - 1, dtype=torch.long),
        loss_mask=scored[:, :-1].float(),
        verifier_last_hidden_states=pre_norm[:, 1:],
        loss_config=resolve_loss_config("kl_div", "eager"),
        num_depths=DEPTHS,
        down_sample_ratio=RATIO,
        down_sample_ratio_min=RATIO_MIN,
    )
    hook.remove()
    torch.manual_seed(0)
    anchor_pos, depth = generate_cod_sample_indices(
        length - 1, scored[:, :-1].float(), num_depths=DEPTHS, down_sample_ratio=RATIO, down_sample_ratio_min=RATIO_MIN
    )
    chains = cod_sample(scored[0], DEPTHS, RATIO, RATIO_MIN, None, torch.Generator().manual_seed(0))
    layout = batch_chains([chains], "cpu")
    out = ours(ids, aux, layout)

    # every row's logits: theirs in (depth, position) order, ours depth-0 rows then chains by (anchor, depth)
    mine = {(q, 0): h for q, h in enumerate(out.hidden[0])}
    mine.update(
        {(a, d): h for a, d, h in zip(layout.anchors[0].tolist(), layout.depths[0].tolist(), out.chain_hidden[0])}
    )
    their_logits = captured[0][0]
    our_logits = torch.stack([ours.head(mine[(a, d)]) for a, d in zip(anchor_pos.tolist(), depth.tolist())])
    torch.testing.assert_close(our_logits, their_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(our_logits.argmax(-1), their_logits.argmax(-1))  # every row drafts the same token

    rows = [(q, 0) for q in scored[0].nonzero().flatten().tolist()] + list(zip(*[t.tolist() for t in chains]))
    student = torch.stack([ours.head(mine[row]) for row in rows])
    positions = torch.tensor([a + d for a, d in rows])
    with torch.no_grad():  # ours: the normed final state (what our datasets store) through the head's rows
        teacher = (target.model.norm(pre_norm)[0, positions + 1] @ head_rows.T).softmax(-1)
    loss = weighted_kl(student, teacher, torch.ones(len(rows))) * len(rows) / (len(rows) + 1e-5)
    assert float(loss.detach()) == pytest.approx(float(their_loss.detach()), rel=1e-5)
    right = student.argmax(-1) == teacher.argmax(-1)
    depths = torch.tensor([d for _, d in rows])
    for d in range(DEPTHS):
        assert metrics[f"position_{d}_acc_sum"] == right[depths == d].sum()
        assert metrics[f"position_{d}_acc_total"] == (depths == d).sum() and (depths == d).sum() > 0
    loss.backward()
    their_loss.backward()
    theirs_params = dict(theirs.named_parameters())
    trained = [(name, p) for name, p in ours.named_parameters() if p.requires_grad]
    assert len(trained) >= 13 and "mask_hidden" in dict(trained)
    for name, param in trained:
        theirs_param = theirs_params[name.replace("midlayer.", "layers.0.")]
        if not theirs_param.requires_grad:  # the library freezes lm_head (the target's rows); we train it
            assert name == "lm_head.weight"
            continue
        torch.testing.assert_close(param.grad, theirs_param.grad, rtol=1e-4, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------------------
# Export, import and serving with the library's own loader and checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama target (untied head) saved as an HF directory, and its runner."""
    directory = tmp_path_factory.mktemp("target")
    model = tiny_target(0)
    model.save_pretrained(directory)
    return LoadedModel(str(directory), ModelRunner.from_hf_model(model, max_seq_len=96), None, model)


def lightning_ckpt(path: Path, drafter: PEagleDrafter, target: dict) -> Path:
    """What PEagleModule saves: the drafter as self.drafter, plus the spectrain block."""
    torch.save(
        {
            "state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()},
            "global_step": 3,
            "epoch": 0,
            "spectrain": {
                "kind": "peagle",
                "config": drafter.config.to_dict(),
                "target": target,
                "recipe": {"kind": "peagle"},
                "metrics": {"val/tau_sim": 2.0},
            },
        },
        path,
    )
    return path


def load_theirs(directory: Path) -> PEagleDraftModel:
    """The library's loader; eager attention because its default flex attention fails on short CPU inputs."""
    config = PEagleSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    return PEagleDraftModel.from_pretrained(str(directory), config=config)


def test_speculators_loads_our_export_with_nothing_missing(tmp_path, tiny):
    ours = make_peagle(tiny.model.config, norm_before_residual=True)
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", ours, target_record(tiny.name))
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
    out = tmp_path / "speculators"
    assert export_cli.main([f"ckpt={tmp_path / 'native'}", "format=speculators", f"out={out}"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"], config["mask_token_id"]) == (
        "peagle",
        ["PEagleSpeculator"],
        MASK,
    )
    assert config["norm_before_residual"] is True and config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in AUX]
    theirs = load_theirs(out)  # what a user types, eager attention aside
    assert_loaded_exactly(theirs, out, tiny.model)
    assert torch.equal(theirs.mask_hidden, ours.mask_hidden) and theirs.mask_token_id == MASK
    assert theirs.config.norm_before_residual is True


def test_library_checkpoint_imports_serves_and_reexports_identically(tmp_path, tiny):
    """A checkpoint speculators itself writes -> import= -> lossless peagle -> format=speculators again."""
    layer = AutoConfig.from_pretrained(tiny.name)
    layer.num_hidden_layers = 1  # the draft's own decoder: one layer shaped like the target's
    used = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    theirs = PEagleDraftModel.from_training_args(
        layer,
        t2d=t2d,
        d2t=used - torch.arange(DRAFT_VOCAB),
        verifier_name_or_path=tiny.name,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True,
        mask_token_id=MASK,
        num_depths=3,
        draft_attn_impl="eager",
        target_layer_ids=[i + 1 for i in AUX],
    )
    with torch.no_grad():  # trained-looking weights: the library initialises its norms to ones
        for name, param in theirs.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                param.uniform_(0.5, 1.5)
        theirs.embed_tokens.weight.add_(0.01)  # it trains the embedding (embed_requires_grad): not the target's now
    theirs.save_pretrained(tmp_path / "theirs")
    native, again = tmp_path / "native", tmp_path / "again"
    assert export_cli.main([f"import={tmp_path / 'theirs'}", f"target={tiny.name}", f"out={native}"]) == 0
    drafter = load_peagle(str(native), tiny)
    c = drafter.config
    assert (c.norm_before_residual, c.num_depths, c.mask_token_id, c.aux_layer_ids, c.own_embedding) == (
        True,
        3,
        MASK,
        AUX,
        True,
    )
    assert torch.equal(drafter.embed_tokens.weight, theirs.embed_tokens.weight)  # its own, not the target's
    greedy, prompt = SamplingParams(0.0), [5, 17, 3, 44, 8]
    reference = build_algorithm("ar", tiny.runner).generate(prompt, max_new_tokens=12, sampling=greedy)
    result = build_algorithm("peagle", tiny.runner, drafter).generate(prompt, max_new_tokens=12, sampling=greedy)
    assert result.tokens == reference.tokens and result.stats.draft_forwards == result.stats.rounds
    assert export_cli.main([f"ckpt={native}", "format=speculators", f"out={again}"]) == 0
    first = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    second = load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys() and "mask_hidden" in first
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and torch.equal(tensor, second[name]), name
    reloaded = load_theirs(again)
    assert torch.equal(reloaded.mask_hidden, theirs.mask_hidden)
    assert torch.equal(reloaded.embed_tokens.weight, theirs.embed_tokens.weight)

    # a foreign config without norm_before_residual reads as vLLM serves peagle (False), not EAGLE-3's True
    bare = Path(shutil.copytree(tmp_path / "theirs", tmp_path / "bare"))
    config = json.loads((bare / "config.json").read_text())
    del config["norm_before_residual"]
    (bare / "config.json").write_text(json.dumps(config))
    assert read_checkpoint(bare, target_record(tiny.name)).config.norm_before_residual is False
    del config["mask_token_id"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has no 'mask_token_id'; a P-EAGLE checkpoint needs it"):
        read_checkpoint(bare, target_record(tiny.name))
