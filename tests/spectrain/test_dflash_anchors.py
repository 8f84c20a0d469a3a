"""DFlash training anchors are drawn per GLOBAL row: N processes with batch b draw, row for row, the anchors one
process with batch N·b draws, whatever else shares a row's batch (other lengths, so another padded width)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import spectrain.kinds.dflash.module as dflash_module
from spectrain.kinds.dflash.losses import sample_anchors
from spectrain.kinds.dflash.module import DFlashModule

BLOCK, MOST = 4, 5


def module_stub(seed: int = 7) -> SimpleNamespace:
    """What ``DFlashModule._anchors`` reads of the module."""
    return SimpleNamespace(
        cfg=SimpleNamespace(seed=seed, model=SimpleNamespace(max_anchors=MOST), data=SimpleNamespace(batch_size=2)),
        drafter=SimpleNamespace(config=SimpleNamespace(block_size=BLOCK)),
    )


def right_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(supervised, attention_mask) of rows of ``lengths``, right-padded to the longest; answers from position 3."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    supervised = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
        supervised[i, 3:n] = torch.rand(n - 3, generator=generator) < 0.8
    return supervised, attention


def per_row(anchors: torch.Tensor, valid: torch.Tensor) -> list[list[int]]:
    return [a[v].tolist() for a, v in zip(anchors, valid)]


def test_a_rows_anchors_do_not_depend_on_world_size_or_its_batch():
    lengths = [30, 16, 21, 17]
    supervised, attention = right_padded(lengths)
    stub = module_stub()
    one = per_row(*DFlashModule._anchors(stub, supervised, attention, salt=11, first_row=0))  # 1 process x 4
    two = []
    for rank in range(2):  # 2 processes x 2: each its own rows, padded to its own width
        rows = slice(2 * rank, 2 * rank + 2)
        width = max(lengths[rows])
        two += per_row(
            *DFlashModule._anchors(stub, supervised[rows, :width], attention[rows, :width], salt=11, first_row=2 * rank)
        )
    assert one == two
    assert all(len(a) == MOST for a in one)  # enough answer tokens: every row drew max_anchors
    for anchors, n, row in zip(one, lengths, supervised):  # each among its own answer tokens, its block inside it
        assert anchors == sorted(set(anchors)) and all(row[p] and p < n - BLOCK for p in anchors)
    # the row's own draw, not the batch's: the same as sample_anchors on that row alone with the row's generator
    alone = per_row(*DFlashModule._anchors(stub, supervised[1:2, :16], attention[1:2, :16], salt=11, first_row=1))
    assert alone == [one[1]]
    # another step, seed or global row draws other anchors
    assert per_row(*DFlashModule._anchors(stub, supervised, attention, salt=12, first_row=0)) != one
    assert per_row(*DFlashModule._anchors(module_stub(8), supervised, attention, salt=11, first_row=0)) != one
    assert per_row(*DFlashModule._anchors(stub, supervised, attention, salt=11, first_row=1)) != one


def test_a_row_without_anchors_is_padded_invalid():
    supervised, attention = right_padded([20, 6])  # row 1: no answer token before its last block
    anchors, valid = DFlashModule._anchors(module_stub(), supervised, attention, salt=0, first_row=0)
    assert valid[0].all() and not valid[1].any() and anchors.shape == (2, MOST)
    reference, _ = sample_anchors(
        supervised[:1], BLOCK, MOST, torch.Generator().manual_seed(((7 * 1_000_003) * 1_000_003) % (1 << 63))
    )
    assert torch.equal(anchors[0], reference[0])


def test_steps_seed_by_the_global_row_of_their_process(monkeypatch):
    """training_step passes rank·b (the process's first row of the global batch) and the step."""
    calls = []

    def slots(batch, salt, first_row):
        calls.append((salt, first_row))
        logits = torch.zeros(2, 5, requires_grad=True)
        return (
            logits,
            torch.full((2, 5), 0.2),
            torch.tensor([1, 2]),
            (torch.tensor([0, 0]), torch.tensor([0, 0])),
            (1, 1),
        )

    stub = module_stub()
    stub.__dict__.update(_slots=slots, global_step=9, weights=torch.ones(BLOCK), log=lambda *a, **k: None)
    batch = {"input_ids": torch.zeros(3, 8, dtype=torch.long)}
    monkeypatch.setattr(dflash_module, "process_rank", lambda: (1, 2))
    DFlashModule.training_step(stub, batch, 0)
    monkeypatch.setattr(dflash_module, "process_rank", lambda: (0, 1))
    DFlashModule.training_step(stub, batch, 0)
    assert calls == [(9, 3), (9, 0)]
