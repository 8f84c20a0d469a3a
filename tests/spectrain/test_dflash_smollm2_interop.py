"""DFlash on the real SmolLM2-135M (tied embeddings, 30 layers) with a drafter TRAINED here for a few steps by
``spectrain.fit recipe=dflash_smollm2``, proven with vLLM's drafter library itself (``speculators`` 0.9.0), as the
tiny-target tests do (``test_dflash_export.py``, ``test_dflash_speculators.py``, whose helpers these reuse):

* our ``format=speculators`` export loads with ``DFlashDraftModel.from_pretrained``: nothing missing, unexpected or
  left at the library's NaN initialisation (its embedding and teacher head are SmolLM2's tied embedding);
* on one batch with the same anchors, the library's training forward and ours agree: block logits, scored slots,
  loss, per-slot argmax and gradients;
* the block the library drafts for a SmolLM2 context is our engine's;
* our ``format=dflash`` export through the library's ``dflash`` converter gives our speculators export's tensors;
* a checkpoint the library writes (``save_pretrained``, built as its trainer builds one for this verifier, over a
  reduced vocabulary of SmolLM2's tied head) is imported with ``import=``, served losslessly (greedy output equals
  AR) and re-exported with equal tensors.

Tolerances (fp32, SmolLM2's sizes): the two implementations sum in different orders (the library's eager
attention over a dense float mask, ours per block), so the logits over the 49,152-id vocabulary (|logit| up to ~70;
sums over 576-wide rows, a 5 x 576 fused input and 1,536-wide MLP rows) differ by float32 rounding: 1.1e-5 at most
here, i.e. ~100 ulps of the largest logit (float32 epsilon 1.2e-7 x 70 = 8e-6 per rounding). We allow 1e-4 (9x the
measured gap; a convention error, such as a shifted layer id, position or teacher, moves logits by O(1)). The loss,
a weighted mean over 56 slots, to 1e-5 relative as on the tiny target; every gradient tensor to 1e-4 relative plus
1e-5 of its largest entry (measured: at most 1e-6 of it; entries near zero make a purely relative bound
meaningless). Argmax tokens: equal in every slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.convert.dflash import DFlashConverter
from speculators.models.dflash import DFlashDraftModel
from dflash_export_builders import (
    GREEDY,
    assert_loaded_exactly,
    assert_same_tensors,
    export,
    load_theirs,
    our_block,
    their_block,
)
from dflash_interop_builders import check_training_forward_agrees
from tiny_targets import write_jsonl
from transformers import AutoConfig

from core.assets import portable_model_reference
from core.drafters.dflash.layouts import build_drafter, read_native
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from core.drafters.dflash.kind import load_dflash
from inference.runner import ModelRunner

pytestmark = pytest.mark.real_model

STEPS, BLOCK, MASK_ID, ANCHORS, LENGTH = 4, 8, 16, 8, 48
AUX = [1, 8, 14, 20, 27]  # layers=dflash5 on SmolLM2's 30 layers (z-lab's spread)
TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large target model then checks "
    "in a single forward pass, so generation gets faster while the output stays exactly the same."
)
LOGIT_TOL = 1e-4  # see above


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """A DFlash drafter for SmolLM2 trained for STEPS steps by ``spectrain.fit recipe=dflash_smollm2`` (online
    features in fp32, one draft layer, whole vocabulary so that the z-lab layout can hold it), exported as
    ``format=speculators`` and ``format=dflash``; SmolLM2 as our engine's target."""
    from spectrain import fit as fit_cli

    model, tokenizer = smollm2
    root = tmp_path_factory.mktemp("dflash_smollm2")
    chats = write_jsonl(root / "chats.jsonl", 12)
    runs = root / "runs"
    cfg = fit_cli.compose_recipe(
        [
            "recipe=dflash_smollm2",
            f"source=jsonl:{chats}",
            "n_samples=6",
            "n_val_samples=2",
            f"max_len={LENGTH}",
            "batch_size=2",
            "draft_vocab_size=0",
            "num_layers=1",
            f"max_anchors={ANCHORS}",
            f"max_steps={STEPS}",
            f"val_check_interval={STEPS}",
            f"checkpoint_every_n_steps={STEPS}",
            "warmup_steps=1",
            "lr=5e-3",
            "log_every_n_steps=1",
            "logger=csv",
            "data.dtype=fp32",
            "trainer.limit_val_batches=0",  # nothing here reads validation: a third of the run's SmolLM2 forwards
            f"runs_dir={runs}",
        ]
    )
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == STEPS
    ckpt = runs / "dflash_smollm2" / "checkpoints" / "last.ckpt"
    speculators, zlab = root / "speculators", root / "dflash"
    export(f"ckpt={ckpt}", "format=speculators", f"out={speculators}")
    export(f"ckpt={ckpt}", "format=dflash", f"out={zlab}")
    target = LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=160), tokenizer, model)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    trained_body = {name.removeprefix("drafter."): t for name, t in state.items() if name.startswith("drafter.")}
    return target, trained_body, speculators, zlab, root


def prompt_ids(tokenizer, n: int) -> list[int]:
    return tokenizer(TEXT)["input_ids"][:n]


def test_the_trained_export_loads_in_the_library_with_nothing_missing(trained):
    target, body, directory, _, _ = trained
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert (config["draft_vocab_size"], config["block_size"], config["target_hidden_size"]) == (49152, BLOCK, 576)
    assert config["mask_token_id"] == MASK_ID and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in AUX]  # hidden_states indices; 30 is the verifier's
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": portable_model_reference("smollm2"), "architectures": ["LlamaForCausalLM"]}
    assert "lm_head.weight" not in load_file(str(Path(verifier["name_or_path"]) / "model.safetensors"))  # tied
    file = load_file(str(directory / "model.safetensors"))
    for name, tensor in file.items():  # the trained weights, as the Lightning checkpoint holds them
        assert torch.equal(tensor, body[name]), name
    theirs = DFlashDraftModel.from_pretrained(str(directory))  # exactly what a user types
    assert theirs.config.aux_hidden_state_layer_ids == [i + 1 for i in AUX] and theirs.block_size == BLOCK
    assert_loaded_exactly(theirs, directory, target.model)


def test_the_training_forward_loss_argmax_and_gradients_agree_with_the_library(trained):
    target, _, directory, _, _ = trained
    model = target.model
    config, tensors, _ = read_native(directory)  # our drafter from our export, on SmolLM2's frozen weights
    ours = build_drafter(
        config,
        tensors,
        embed_weight=model.get_input_embeddings().weight.detach(),
        head_weight=model.lm_head.weight.detach(),
    )
    theirs = load_theirs(directory)
    ids = torch.tensor([target.tokenizer(TEXT * 2)["input_ids"][:LENGTH]])
    loss_mask = torch.zeros(1, LENGTH)
    loss_mask[0, 8:] = 1.0
    compared = check_training_forward_agrees(
        model,
        ours,
        theirs,
        ids,
        loss_mask,
        anchors=ANCHORS,
        logit_tol=LOGIT_TOL,
        loss_rtol=1e-5,
        grad_rtol=1e-4,
        grad_atol=0.0,
        grad_atol_of_max=1e-5,
    )
    assert compared["scored"] == ANCHORS * (BLOCK - 1)  # every anchor's block lies inside the answer
    assert 0 < compared["loss"] < 20
    print(
        f"[smollm2 dflash] loss {compared['loss']:.4f}, {compared['right']}/{compared['scored']} slots draft the "
        "target's argmax"
    )


def test_the_library_drafts_our_engines_block_for_a_smollm2_context(trained):
    target, _, directory, _, _ = trained
    prompt = prompt_ids(target.tokenizer, 20)
    served = load_dflash(str(directory), target)
    ours, our_logits, start = our_block(target, served, prompt)
    theirs, their_logits = their_block(load_theirs(directory), start, prompt)
    torch.testing.assert_close(their_logits, our_logits, rtol=LOGIT_TOL, atol=LOGIT_TOL)
    assert theirs == ours and len(ours) == BLOCK - 1


def test_the_native_layout_through_the_library_converter_equals_our_speculators_export(trained):
    target, _, ours, zlab, root = trained
    config = json.loads((zlab / "config.json").read_text())
    assert config["dflash_config"] == {"block_size": BLOCK, "mask_token_id": MASK_ID, "target_layer_ids": AUX}
    assert config["num_target_layers"] == 30 and config["architectures"] == ["DFlashDraftModel"]
    converted = root / "converted"
    DFlashConverter().convert(zlab, converted, base_model=portable_model_reference("smollm2"))  # validates too
    assert_same_tensors(converted, ours)
    theirs, mine = (json.loads((d / "config.json").read_text()) for d in (converted, ours))
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size", "sample_from_anchor"):
        assert theirs[key] == mine[key], key


def library_checkpoint(directory: Path, body: dict[str, torch.Tensor], used: torch.Tensor) -> Path:
    """What speculators' trainer writes for SmolLM2 (``from_training_args``: the draft layer shaped by the
    verifier's own config, the verifier's weights loaded), over the draft vocabulary ``used`` (target ids), holding
    our trained drafter's body; saved by the library."""
    verifier = portable_model_reference("smollm2")
    layer = AutoConfig.from_pretrained(verifier)
    layer.num_hidden_layers = 1
    vocab = len(used)
    t2d = torch.zeros(layer.vocab_size, dtype=torch.bool)
    t2d[used] = True
    theirs = DFlashDraftModel.from_training_args(
        layer,
        t2d=t2d,
        d2t=used - torch.arange(vocab),
        verifier_name_or_path=verifier,
        draft_vocab_size=vocab,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        target_layer_ids=[i + 1 for i in AUX],
        draft_attn_impl="eager",
    )
    own = {name: t for name, t in body.items() if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    missing, unexpected = theirs.load_state_dict(own, strict=False)
    assert not unexpected and sorted(missing) == [
        "d2t",
        "embed_tokens.weight",
        "lm_head.weight",
        "t2d",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    theirs.save_pretrained(directory)
    return directory


def test_a_library_checkpoint_is_imported_and_served_losslessly(trained):
    target, body, _, _, root = trained
    prompt = prompt_ids(target.tokenizer, 16)
    reference = build_algorithm("ar", target.runner).generate(prompt, max_new_tokens=24, sampling=GREEDY)
    # a reduced vocabulary holding what the target writes here (so some drafts can be accepted) and more
    used = torch.unique(torch.cat([torch.arange(2048), torch.tensor(prompt + reference.tokens)]))
    theirs = library_checkpoint(root / "theirs", body, used)
    file = load_file(str(theirs / "model.safetensors"))
    assert torch.equal(file["lm_head.weight"], target.model.get_input_embeddings().weight.detach()[used])  # tied
    native, again = root / "imported", root / "again"
    export(f"import={theirs}", "target=smollm2", f"out={native}")
    drafter = load_dflash(str(native), target)
    assert drafter.config.aux_layer_ids == AUX and drafter.config.draft_vocab_size == len(used)
    assert (drafter.config.block_size, drafter.config.mask_token_id, drafter.config.num_layers) == (BLOCK, MASK_ID, 1)
    assert torch.equal(drafter.draft_ids_in_target().cpu(), used)
    state = drafter.state_dict()
    assert set(state) == set(body)  # the tensors a trained drafter holds, no more (the target's head is not its own)
    for name, tensor in body.items():  # the trained body, read back under our names
        if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            assert torch.equal(state[name], tensor), name
    served = build_algorithm("dflash", target.runner, drafter).generate(prompt, max_new_tokens=24, sampling=GREEDY)
    assert served.tokens == reference.tokens and len(served.tokens) == 24
    assert served.stats.draft_forwards == served.stats.rounds
    export(f"ckpt={native}", "format=speculators", f"out={again}")
    assert_same_tensors(theirs, again)
