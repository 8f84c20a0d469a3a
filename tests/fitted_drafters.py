"""EAGLE-3, SpecBlock, DFlash and P-EAGLE drafters fit in a few dozen Adam steps to one sequence a tiny target decodes
greedily (its features from a plain transformers forward), so that, served on that sequence's prompt, they draft
what the target then emits: drafters that accept, for lossless tests that must see drafts kept, not only rejected.
Each is trained through its own training forward, on cross-entropy against the sequence's next tokens, over a reduced
draft vocabulary (DRAFT_VOCAB ids: the sequence's and random others), so serving maps draft ids back to the target's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter, shift_left
from core.drafters.peagle import PEagleConfig, PEagleDrafter
from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter
from spectrain.kinds.peagle.losses import batch_chains, every_chain
from spectrain.kinds.specblock.losses import total_loss, unroll_blocks

AUX = [0, 1, 2]  # the target's layers the drafters read (a 4-layer target: never its last, normed one)
MASK_TOKEN = 0
DRAFT_VOCAB = 256


def with_draft_vocabulary(drafter, sequence: list[int]):
    """Give ``drafter`` a draft vocabulary of DRAFT_VOCAB target ids holding every id of ``sequence``; returns it and
    [V] the draft id of each target id (-1 outside the draft vocabulary)."""
    vocab = drafter.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[sequence] = True
    others = (~t2d).nonzero().flatten()
    t2d[
        others[torch.randperm(len(others), generator=torch.Generator().manual_seed(0))[: DRAFT_VOCAB - int(t2d.sum())]]
    ] = True
    used = t2d.nonzero().flatten()
    drafter.set_vocab_map(used - torch.arange(DRAFT_VOCAB), t2d)
    return drafter, torch.where(t2d, t2d.cumsum(0) - 1, -1)


def aux_features(target: LlamaForCausalLM, sequence: list[int]) -> torch.Tensor:
    """[1, T, 3·H]: the outputs of the AUX layers at every position of ``sequence``."""
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in AUX], dim=-1)


def fit(drafter: torch.nn.Module, loss: Callable[[], torch.Tensor], steps: int, lr: float = 3e-3) -> torch.nn.Module:
    torch.manual_seed(0)
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    drafter.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    return drafter.eval()


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def fit_eagle3(target: LlamaForCausalLM, sequence: list[int], steps: int = 30, ttt_steps: int = 3) -> Eagle3Drafter:
    """Training-time test over ``ttt_steps`` steps: step j, row i predicts token i + 2 + j."""
    config = Eagle3Config.for_target(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX)
    torch.manual_seed(0)
    drafter, to_draft = with_draft_vocabulary(
        Eagle3Drafter(config, embed_weight=target.get_input_embeddings().weight.detach()), sequence
    )
    ids, features, length = torch.tensor([sequence]), aux_features(target, sequence), len(sequence)

    def loss() -> torch.Tensor:
        out = drafter(ids, features, steps=ttt_steps)
        return sum(
            next_token_loss(logits[:, : length - 2 - j], to_draft[ids[:, 2 + j :]])
            for j, logits in enumerate(out.logits)
        )

    return fit(drafter, loss, steps)


def fit_peagle(target: LlamaForCausalLM, sequence: list[int], depths: int = 6, steps: int = 30) -> PEagleDrafter:
    """Every row at depth 0 (row i predicts token i + 2) and every chain (anchor a, depth d predicts a + d + 2)."""
    config = PEagleConfig.for_target(
        target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX, mask_token_id=MASK_TOKEN, num_depths=depths
    )
    torch.manual_seed(0)
    drafter, to_draft = with_draft_vocabulary(
        PEagleDrafter(config, embed_weight=target.get_input_embeddings().weight.detach()), sequence
    )
    ids, features, length = torch.tensor([sequence]), aux_features(target, sequence), len(sequence)
    scored = torch.arange(length) < length - 2
    anchors, chain_depths = every_chain(scored, depths)
    chains = batch_chains([(anchors, chain_depths)], "cpu")
    chain_labels = to_draft[ids[0, anchors + chain_depths + 2]]

    def loss() -> torch.Tensor:
        out = drafter(ids, features, chains)
        return next_token_loss(drafter.head(out.hidden[:, : length - 2]), to_draft[ids[:, 2:]]) + next_token_loss(
            drafter.head(out.chain_hidden[0]), chain_labels
        )

    return fit(drafter, loss, steps)


def fit_specblock(
    target: LlamaForCausalLM, sequence: list[int], block_size: int = 4, steps: int = 30
) -> SpecBlockDrafter:
    """The library's SpecBlock objective (draft and rank losses) over two blocks, the second left at slot 2;
    the teacher is the sequence itself (row i holds token i + 1; slot k predicts token i + 2 + k)."""
    config = SpecBlockConfig.for_target(
        target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX, block_size=block_size
    )
    torch.manual_seed(0)
    drafter, to_draft = with_draft_vocabulary(
        SpecBlockDrafter(config, embed_weight=target.get_input_embeddings().weight.detach()), sequence
    )
    ids, features, length = torch.tensor([sequence]), aux_features(target, sequence), len(sequence)
    teacher = F.one_hot(to_draft[shift_left(ids, 2)].clamp(min=0), DRAFT_VOCAB).float()  # the last 2 rows: unscored
    rows = (torch.arange(length) < length - 2)[None]

    def loss() -> torch.Tensor:
        return total_loss(unroll_blocks(drafter, features, shift_left(ids, 1), teacher, rows, [2], attention="dense"))

    return fit(drafter, loss, steps)


def fit_dflash(target: LlamaForCausalLM, sequence: list[int], block_size: int = 8, steps: int = 30) -> DFlashDrafter:
    """A block at every anchor p: slot k >= 1 predicts token p + k (the head is the target's, frozen)."""
    config = DFlashConfig.for_target(
        target.config,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=AUX,
        block_size=block_size,
        num_layers=2,
        mask_token_id=MASK_TOKEN,
    )
    torch.manual_seed(0)
    drafter, to_draft = with_draft_vocabulary(
        DFlashDrafter(
            config,
            embed_weight=target.get_input_embeddings().weight.detach(),
            head_weight=target.lm_head.weight.detach(),
        ),
        sequence,
    )
    ids, features, length = torch.tensor([sequence]), aux_features(target, sequence), len(sequence)
    anchors = torch.arange(1, length - block_size + 1)[None]
    labels = to_draft[ids[0, anchors[0, :, None] + torch.arange(1, block_size)]]

    def loss() -> torch.Tensor:
        return next_token_loss(drafter.head(drafter(features, ids, anchors, attention="dense")[0, :, 1:]), labels)

    return fit(drafter, loss, steps)
