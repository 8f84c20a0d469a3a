"""DFlash in the layouts the engines load, proven with vLLM's drafter library itself (``speculators`` 0.9.0:
``DFlashDraftModel`` and its ``dflash`` converter), on a tiny random Llama target saved as an HF directory.

* ``format=speculators``: ``DFlashDraftModel.from_pretrained`` loads every tensor of it, nothing missing, unexpected
  or left at the library's NaN initialisation; the block the library drafts for a context equals our engine's;
* a checkpoint the library writes (``save_pretrained``) is imported with ``import=``, served losslessly by our
  engine and re-exported with every tensor equal;
* ``format=dflash`` (z-lab/SGLang) run through the library's converter gives the tensors of our speculators export;
* layer ids: speculators' ``aux_hidden_state_layer_ids`` are ours + 1 (z-lab's ``target_layer_ids`` are ours) and
  never the target's final layer (pinned below);
* bad input is a one-line error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dflash_export_builders import (
    GREEDY,
    PROMPT,
    assert_loaded_exactly,
    assert_same_tensors,
    export,
    load_theirs,
    our_block,
    their_block,
)
from eagle3_export_builders import tiny_target
from safetensors.torch import load_file, save_file

# Imported, never skipped: `make install` installs speculators, and a missing one must fail the suite.
from speculators.convert.dflash import DFlashConverter
from speculators.models.dflash import DFlashDraftModel
from tiny_targets import set_random_vocab_map
from transformers import AutoConfig

from core.assets import target_record
from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.dflash.layouts import save_native
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from core.drafters.dflash.kind import load_dflash
from inference.runner import ModelRunner
from spectrain import export as export_cli

VOCAB, LAYERS, AUX, BLOCK, MASK_ID = 97, 8, [1, 3], 4, 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    """A tiny random Llama target (untied head) saved as an HF directory, and its runner."""
    directory = tmp_path_factory.mktemp("target")
    model = tiny_target(0)
    model.save_pretrained(directory)
    return LoadedModel(str(directory), ModelRunner.from_hf_model(model, max_seq_len=64), None, model)


def make_drafter(target: LoadedModel, *, draft_vocab: int = 40, aux: list[int] = AUX, seed: int = 1) -> DFlashDrafter:
    """A drafter with every weight random (norms too: a swapped norm must show) sharing the target's embedding and
    head, over a random reduced vocabulary (``draft_vocab`` < VOCAB) or the whole one."""
    model = target.model
    config = DFlashConfig.for_target(
        model.config,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux,
        block_size=BLOCK,
        num_layers=2,
        mask_token_id=MASK_ID,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(
        config, embed_weight=model.get_input_embeddings().weight.detach(), head_weight=model.lm_head.weight.detach()
    )
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    if draft_vocab < VOCAB:
        set_random_vocab_map(drafter, VOCAB, draft_vocab)
    return drafter.eval()


def lightning_ckpt(path: Path, drafter: DFlashDrafter, target: LoadedModel) -> Path:
    """What DFlashModule saves: the drafter as self.drafter (frozen copies included), plus its checkpoint block."""
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save(
        {
            "state_dict": state,
            "global_step": 5,
            "epoch": 0,
            "spectrain": {
                "kind": "dflash",
                "config": drafter.config.to_dict(),
                "target": target_record(target.name),
                "recipe": {"kind": "dflash", "model": {"max_anchors": 16, "loss_decay_gamma": 4.0}},
                "metrics": {"val/tau_sim": 1.5},
            },
        },
        path,
    )
    return path


def exported(tmp_path: Path, drafter: DFlashDrafter, target: LoadedModel, layout: str, *extra: str) -> Path:
    ckpt = tmp_path / "last.ckpt"
    if not ckpt.exists():
        lightning_ckpt(ckpt, drafter, target)
    out = tmp_path / layout
    export(f"ckpt={ckpt}", f"format={layout}", f"out={out}", *extra)
    return out


def one_line_error(capsys, *args: str) -> str:
    capsys.readouterr()
    assert export_cli.main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


# ------------------------------------------------------------------------------------------------------------
# format=speculators


@pytest.mark.parametrize("draft_vocab", [40, VOCAB])
def test_speculators_export_loads_in_the_library_with_nothing_missing(tmp_path, tiny, draft_vocab):
    drafter = make_drafter(tiny, draft_vocab=draft_vocab)
    directory = exported(tmp_path, drafter, tiny, "speculators")
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert (config["draft_vocab_size"], config["block_size"], config["target_hidden_size"]) == (draft_vocab, BLOCK, 32)
    assert config["mask_token_id"] == MASK_ID and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in AUX] == [2, 4]  # hidden_states indices
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("qwen3", 2, VOCAB)
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal == {"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(Path(tiny.name).resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    block = config["spectrain"]
    assert block["kind"] == "dflash" and block["layout"] == "speculators" and block["layers"]["ids"] == AUX
    file = load_file(str(directory / "model.safetensors"))
    assert not any(name.startswith("verifier") for name in file) and "embed_tokens.weight" not in file
    if draft_vocab < VOCAB:  # the frozen head rows and the map, as the library saves a reduced vocabulary
        assert torch.equal(file["lm_head.weight"], tiny.model.lm_head.weight.detach()[drafter.draft_ids_in_target()])
        assert torch.equal(file["d2t"], drafter.d2t) and torch.equal(file["t2d"], drafter.t2d)
    else:
        assert not {"lm_head.weight", "d2t", "t2d"} & set(file)
    theirs = DFlashDraftModel.from_pretrained(str(directory))  # exactly what a user types
    assert theirs.config.aux_hidden_state_layer_ids == [2, 4] and theirs.config.mask_token_id == MASK_ID
    assert_loaded_exactly(theirs, directory, tiny.model)
    # our engine loads the speculators layout directly (the spectrain block names the target)
    served = load_dflash(str(directory), tiny)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(served.state_dict()[name], tensor), name


def test_layer_ids_speculators_plus_one_and_never_the_final_layer(tmp_path, tiny, capsys):
    """Our ids and z-lab's are output-of-layer ids; speculators' are ours + 1 and exclude the final layer (its
    converter drops it), so a drafter reading the final layer exports as dflash but not as speculators (pinned on
    the library's converter itself)."""
    drafter = make_drafter(tiny, draft_vocab=VOCAB, aux=[1, LAYERS - 1])
    zlab = exported(tmp_path, drafter, tiny, "dflash")
    assert json.loads((zlab / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, LAYERS - 1]
    converted = DFlashConverter()._build_config(json.loads((zlab / "config.json").read_text()), tiny.name, None)
    assert converted.aux_hidden_state_layer_ids == [2]  # z-lab id + 1, the final layer's (8) dropped
    err = one_line_error(capsys, f"ckpt={tmp_path / 'last.ckpt'}", "format=speculators", f"out={tmp_path / 'x'}")
    assert err == (
        "error: this drafter reads the target's final layer (output-of-layer id 7), which the "
        "speculators layout cannot name (speculators keeps that output as the verifier's last hidden "
        "state): export format=dflash (SGLang) or retrain without that layer (layers=dflashK stops at "
        "L - 3)"
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("draft_vocab", [40, VOCAB])
def test_the_library_drafts_our_engines_block(tmp_path, tiny, draft_vocab):
    drafter = make_drafter(tiny, draft_vocab=draft_vocab, seed=4)
    ours, our_logits, start = our_block(tiny, drafter)
    theirs, their_logits = their_block(load_theirs(exported(tmp_path, drafter, tiny, "speculators")), start)
    torch.testing.assert_close(their_logits, our_logits, rtol=1e-5, atol=1e-5)
    assert theirs == ours and len(ours) == BLOCK - 1


# ------------------------------------------------------------------------------------------------------------
# A checkpoint the library writes


def library_checkpoint(directory: Path, target: LoadedModel, draft_vocab: int) -> Path:
    """``DFlashDraftModel.from_training_args`` (as speculators' trainer builds it: the draft layers shaped by the
    verifier's config) with trained-looking norms, saved by the library."""
    layer = AutoConfig.from_pretrained(target.name)
    layer.num_hidden_layers = 2
    vocab = {}
    if draft_vocab < VOCAB:
        used = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:draft_vocab]).values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[used] = True
        vocab = {"t2d": t2d, "d2t": used - torch.arange(draft_vocab)}
    torch.manual_seed(5)
    theirs = DFlashDraftModel.from_training_args(
        layer,
        **vocab,
        verifier_name_or_path=target.name,
        draft_vocab_size=draft_vocab,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        target_layer_ids=[i + 1 for i in AUX],
        draft_attn_impl="eager",
    )
    with torch.no_grad():  # the library initialises its norms to ones
        for name, param in theirs.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                param.uniform_(0.5, 1.5)
    theirs.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("draft_vocab", [40, VOCAB])
def test_a_library_checkpoint_is_imported_served_losslessly_and_reexported_identically(tmp_path, tiny, draft_vocab):
    theirs = library_checkpoint(tmp_path / "theirs", tiny, draft_vocab)
    native, again = tmp_path / "native", tmp_path / "again"
    export(f"import={theirs}", f"target={tiny.name}", f"out={native}")
    drafter = load_dflash(str(native), tiny)
    assert drafter.config.aux_layer_ids == AUX and drafter.config.draft_vocab_size == draft_vocab
    assert (drafter.config.block_size, drafter.config.mask_token_id, drafter.config.num_layers) == (BLOCK, MASK_ID, 2)
    reference = build_algorithm("ar", tiny.runner).generate(PROMPT, max_new_tokens=12, sampling=GREEDY)
    served = build_algorithm("dflash", tiny.runner, drafter).generate(PROMPT, max_new_tokens=12, sampling=GREEDY)
    assert served.tokens == reference.tokens and served.stats.draft_forwards == served.stats.rounds
    ours, _, start = our_block(tiny, drafter)  # and the library drafts the block our engine drafts
    assert their_block(load_theirs(theirs), start)[0] == ours
    export(f"ckpt={native}", "format=speculators", f"out={again}")
    assert_same_tensors(theirs, again)
    assert_loaded_exactly(load_theirs(again), again, tiny.model)


def test_the_engine_refuses_a_foreign_checkpoint_and_names_import(tmp_path, tiny):
    theirs = library_checkpoint(tmp_path / "theirs", tiny, 40)
    with pytest.raises(
        ValueError,
        match=r"is a DFlash checkpoint without a spectrain block \(another tool's\); "
        r"import it first: python -m spectrain.export import=",
    ):
        load_dflash(str(theirs), tiny)


# ------------------------------------------------------------------------------------------------------------
# format=dflash (z-lab / SGLang) and the library's converter


def test_native_layout_through_the_library_converter_equals_our_speculators_export(tmp_path, tiny):
    drafter = make_drafter(tiny, draft_vocab=VOCAB, seed=6)
    zlab = exported(tmp_path, drafter, tiny, "dflash", "dtype=bfloat16")
    ours = exported(tmp_path, drafter, tiny, "speculators", "dtype=bfloat16")
    config = json.loads((zlab / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == LAYERS
    assert config["dflash_config"] == {"block_size": BLOCK, "mask_token_id": MASK_ID, "target_layer_ids": AUX}
    assert (config["model_type"], config["num_hidden_layers"], config["block_size"]) == ("qwen3", 2, BLOCK)
    file = load_file(str(zlab / "model.safetensors"))
    assert not {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"} & set(file)
    converted = tmp_path / "converted"
    DFlashConverter().convert(zlab, converted, base_model=tiny.name)  # validates with from_pretrained too
    assert_same_tensors(converted, ours)
    theirs = json.loads((converted / "config.json").read_text())
    mine = json.loads((ours / "config.json").read_text())
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size", "sample_from_anchor"):
        assert theirs[key] == mine[key], key
    assert theirs["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    # both layouts read back to the same module (ours: with its spectrain block; z-lab's own: with target=)
    foreign = tmp_path / "foreign"
    shutil.copytree(zlab, foreign)
    config.pop("spectrain")
    (foreign / "config.json").write_text(json.dumps(config))
    for source, args in ((zlab, []), (ours, []), (foreign, [f"target={tiny.name}"])):
        out = tmp_path / f"back_{source.name}"
        export(f"import={source}", *args, f"out={out}")
        reread = load_dflash(str(out), tiny)
        for name, tensor in drafter.state_dict().items():
            if name not in ("embed_tokens.weight", "lm_head.weight"):  # the target's, at the runner's dtype
                stored = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.is_floating_point() else tensor
                assert torch.equal(reread.state_dict()[name], stored), name


# ------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_dflash_input_is_one_line(tmp_path, tiny, capsys):
    drafter = make_drafter(tiny)  # a reduced vocabulary
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, tiny)
    native = tmp_path / "native"
    save_native(drafter, native, target=target_record(tiny.name))
    theirs = library_checkpoint(tmp_path / "theirs", tiny, 40)

    def broken(name: str, *, config=None, tensors=None) -> Path:
        copy = shutil.copytree(theirs, tmp_path / name)
        raw = json.loads((copy / "config.json").read_text())
        if config:
            config(raw)
        (copy / "config.json").write_text(json.dumps(raw))
        if tensors:
            weights = load_file(str(copy / "model.safetensors"))
            tensors(weights)
            save_file(weights, str(copy / "model.safetensors"))
        return copy

    no_mask = broken("no_mask", config=lambda c: c.pop("mask_token_id"))
    anchored = broken("anchored", config=lambda c: c.update(sample_from_anchor=True))
    extra = broken("extra", tensors=lambda w: w.update({"mtp_head.weight": torch.zeros(2)}))
    trained_head = broken("trained_head", tensors=lambda w: w["lm_head.weight"].mul_(2.0))
    other_target = tmp_path / "other_target"
    model = tiny_target(1)
    model.config.vocab_size = 50
    type(model)(model.config).save_pretrained(other_target)
    out = f"out={tmp_path / 'y'}"
    for args, message in [
        (
            (f"ckpt={ckpt}", "format=sglang", out),
            "a dflash drafter exports as format=native, speculators or dflash; 'sglang' is not a DFlash layout",
        ),
        (
            (f"ckpt={native}", "format=dflash", out),
            "the dflash (z-lab/SGLang) layout has no draft vocabulary (engines draft over the target's whole head) but "
            "this drafter drafts 40 of 97 ids: export format=speculators, or train with draft_vocab_size=0",
        ),
        (
            (f"import={theirs}", out),
            f"{theirs} is a DFlash checkpoint of another tool (speculators layout) and records no target: give "
            "target=NAME_OR_DIR (the model it drafts for)",
        ),
        (
            (f"import={no_mask}", f"target={tiny.name}", out),
            f"{no_mask}/config.json has no 'mask_token_id'; a DFlash checkpoint needs it",
        ),
        (
            (f"import={anchored}", f"target={tiny.name}", out),
            f"{anchored}/config.json sets sample_from_anchor=true (the anchor slot drafts too), which spectrain's DFlash "
            "does not run",
        ),
        (
            (f"import={extra}", f"target={tiny.name}", out),
            f"{extra}: speculators layout has unknown tensors ['mtp_head.weight'] and lacks []; refusing to skip or "
            "invent weights",
        ),
        (
            (f"import={trained_head}", f"target={tiny.name}", out),
            f"{trained_head}: its lm_head is not the target's head over the draft vocabulary (trained, or for another "
            "target?); spectrain's DFlash keeps the target's rows frozen, so it cannot run this drafter",
        ),
        (
            (f"import={theirs}", f"target={other_target}", out),
            f"drafter vocab_size 97 differs from target '{other_target}' vocab 50: it was trained for another "
            "tokenizer",
        ),
        (
            (f"import={native}", f"target={other_target}", out),
            f"{native} was trained for target '{tiny.name}', not '{other_target}'; use the target it was trained for",
        ),
    ]:
        assert one_line_error(capsys, *args) == f"error: {message}", args
    assert not (tmp_path / "y").exists()
