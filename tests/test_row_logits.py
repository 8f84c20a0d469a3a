"""Verification logits by row (inference/row_logits.py): the rows a walk reads equal the batched lm_head's, and
the algorithms give the same tokens whether rows are computed on demand (CPU) or all at once (GPU mode)."""

from __future__ import annotations

import pytest
import torch
from test_algorithms import GREEDY, runner, tiny_llama
from test_eagle3_tree import PROMPT, random_drafter

from inference import row_logits
from inference.algorithms import build_algorithm
from inference.row_logits import RowLogits, WarpedRows, lazy_rows_on
from inference.sampling import SamplingParams
from inference.verify import tree_walk


def test_rows_on_demand_equal_the_batched_lm_head():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(7, 16)
    full = lm_head(hidden).detach()
    rows = RowLogits(hidden, lm_head, known=full[:2])
    assert len(rows) == 7 and rows.device == hidden.device
    torch.testing.assert_close(rows.stack([0, 3, 6]), full[[0, 3, 6]])
    assert rows[3] is rows[3]  # computed once
    assert set(rows._rows) == {3, 6}  # the known prefix is never recomputed, unread rows never computed
    with pytest.raises(IndexError):
        rows[7]
    computed = RowLogits.computed(full)
    torch.testing.assert_close(computed.stack(range(7)), full)
    with pytest.raises(ValueError, match="needs the final hidden states or the computed logits"):
        RowLogits(None, None)
    assert lazy_rows_on("cpu") and not lazy_rows_on(torch.device("meta"))


def test_tree_walk_reads_only_the_root_and_its_path():
    """A chain 0 -> 1 -> 2 whose target agrees on the first two nodes: rows 0, 1, 2 are read, rows 3-4 never."""
    vocab = 5
    probs = torch.zeros(5, vocab)
    probs[0, 1] = probs[1, 2] = probs[2, 4] = probs[3, 0] = probs[4, 0] = 1.0
    read = []

    def warp(row):
        read.append(row)
        return row

    rows = WarpedRows(RowLogits.computed(probs), warp)
    walk = tree_walk([1, 2, 3, 0], [-1, 0, 1, 0], rows)
    assert walk.path == [0, 1] and walk.tokens.tolist() == [1, 2, 4]
    assert len(read) == 3
    assert tree_walk([1, 2, 3, 0], [-1, 0, 1, 0], probs).tokens.tolist() == [1, 2, 4]  # tensors still work


@pytest.mark.parametrize("algorithm, options, temperature", [
    ("eagle3_tree", {"tree_depth": 3, "tree_topk": 3, "tree_total": 12}, 0.0),
    ("eagle3_tree", {"tree_depth": 3, "tree_topk": 3, "tree_total": 12}, 1.0),
    ("self_draft", {"branch_len": 5, "branch_num": 3}, 0.0),
    ("self_draft", {"branch_len": 5, "branch_num": 3}, 1.0),
    # all-at-once rows take the grid's argmax over the full vocabulary: other proposals, same greedy output
    ("self_draft", {"branch_len": 4, "branch_num": 2, "grid_vocab": 40}, 0.0),
])
def test_same_tokens_with_rows_on_demand_or_all_at_once(monkeypatch, algorithm, options, temperature):
    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    drafter = random_drafter(target, draft_vocab=60) if algorithm == "eagle3_tree" else None
    sampling = GREEDY if temperature == 0 else SamplingParams(temperature=temperature)
    outputs = {}
    for lazy in (True, False):
        from inference.algorithms import feature_drafting, self_draft

        for module in (row_logits, feature_drafting, self_draft):
            monkeypatch.setattr(module, "lazy_rows_on", lambda device, lazy=lazy: lazy)
        args = (runner(target),) if drafter is None else (runner(target), drafter)
        built = build_algorithm(algorithm, *args, **options)
        generator = torch.Generator().manual_seed(5)
        outputs[lazy] = [built.generate(p, max_new_tokens=30, sampling=sampling, generator=generator).tokens
                         for p in (PROMPT, [3, 14, 15, 92, 65])]
    assert outputs[True] == outputs[False]
