"""DFlash export round trips: exporting, loading speculators' side, and comparing the two."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from engine_helpers import admitted_alone
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

from core.drafters.dflash import DFlashDrafter
from inference.algorithms import build_algorithm
from inference.drafters import LoadedModel
from inference.sampling import SamplingParams
from spectrain import export as export_cli

GREEDY, PROMPT = SamplingParams(0.0), [5, 17, 3, 44, 8, 61, 2, 9]


VERIFIER_OWNED = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def export(*args: str) -> None:
    assert export_cli.main(list(args)) == 0


def load_theirs(directory: Path) -> DFlashDraftModel:
    """The library's loader; eager attention because its default flex attention fails on short CPU inputs."""
    config = DFlashSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    return DFlashDraftModel.from_pretrained(str(directory), config=config).eval()


def assert_loaded_exactly(theirs: DFlashDraftModel, directory: Path, target: torch.nn.Module) -> None:
    """Every tensor of the file in the model, every model tensor from the file or (verifier-owned) the target:
    nothing missing, unexpected or left at the library's NaN initialisation."""
    file, state, vocab = load_file(str(directory / "model.safetensors")), theirs.state_dict(), target.config.vocab_size
    assert not VERIFIER_OWNED & set(file)
    reloaded = VERIFIER_OWNED | ({"lm_head.weight"} if theirs.draft_vocab_size == vocab else set())
    assert set(state) - reloaded == set(file), set(state) ^ set(file)
    for name, tensor in file.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    rows = state["t2d"].bool() if "t2d" in state else torch.ones(vocab, dtype=torch.bool)
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight.detach())
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight.detach()[rows])
    assert torch.equal(state["verifier_lm_head.weight"], target.lm_head.weight.detach()[rows])
    assert torch.equal(state["verifier_norm.weight"], target.model.norm.weight.detach())
    assert not any(torch.isnan(v).any() for v in state.values() if v.is_floating_point())


def assert_same_tensors(a: Path, b: Path) -> None:
    first, second = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert first.keys() == second.keys(), set(first) ^ set(second)
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and torch.equal(tensor, second[name]), name


def our_block(
    target: LoadedModel, drafter: DFlashDrafter, prompt: list[int] = PROMPT
) -> tuple[list[int], torch.Tensor, object]:
    """The block our engine drafts after the prompt (target ids), its draft-vocabulary logits and the prefill."""
    algo = build_algorithm("dflash", target.runner, drafter)
    engine, row = admitted_alone(algo, prompt)
    start = SimpleNamespace(features=row.draft.features[None], root=row.pending[0])
    logits = drafter.draft(
        drafter.new_cache(max(64, len(prompt) + 2 * drafter.config.block_size)), start.features, start.root
    )[0]
    drafts, _ = engine.strategy._draft(logits, GREEDY, None)
    return drafts.tolist(), logits, start


def their_block(theirs: DFlashDraftModel, start, prompt: list[int] = PROMPT) -> tuple[list[int], torch.Tensor]:
    """What the library drafts from the same context: its training forward with one anchor, at the position after
    the prompt (the root token), reading the prompt's features; the positions after the block are padding."""
    n, width = len(prompt), len(prompt) + 2 * theirs.block_size
    features = torch.cat([start.features, start.features.new_zeros(1, width - n, start.features.shape[-1])], 1)
    ids = torch.tensor([prompt + [start.root] + [0] * (width - n - 1)])
    anchor = torch.zeros(1, width)
    anchor[0, n] = 1.0  # the only eligible anchor
    hidden = theirs.config.transformer_layer_config.hidden_size  # the verifier's last state: the teacher, unused here
    with torch.no_grad():
        _, logits, _, _, _ = theirs._backbone_forward(
            features,
            ids,
            anchor,
            features.new_zeros(1, width, hidden),
            torch.zeros(1, width, dtype=torch.long),
            max_anchors=1,
        )
    logits = logits[0, 1:]  # slot 0 is the anchor
    drafted = logits.argmax(-1)
    if theirs.d2t is not None:
        drafted = drafted + theirs.d2t[drafted]
    return drafted.tolist(), logits
