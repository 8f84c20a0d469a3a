"""Verification logits by row (inference/row_logits.py): the rows a walk reads equal the batched lm_head's, the
algorithms give the same tokens whether rows are computed on demand (CPU) or all at once (GPU mode), and in exact
mode a row read through RowLogits is bitwise what decoding its path gives (the runner's logits_from_hidden)."""

from __future__ import annotations

import pytest
import torch
from tiny_targets import GREEDY, runner, tiny_llama
from eagle3_tree_builders import PROMPT, random_drafter
from exact_helpers import DTYPES, exact_runner
from family_models import tiny_model

from core.prompts import load_prompts, prompt_turns, render_prompt
from inference import row_logits
from inference.algorithms import build_algorithm
from inference.algorithms.self_draft import NodeLogits
from inference.exactness import tree_mask
from inference.row_logits import RowLogits, WarpedRows, lazy_rows_on
from inference.transformers_runner import TransformersRunner
from inference.sampling import SamplingParams
from inference.verify import tree_walk


def test_rows_on_demand_equal_the_batched_lm_head():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(7, 16)
    full = lm_head(hidden).detach()
    rows = RowLogits(hidden, lambda h: lm_head(h).detach().float(), known=full[:2])
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


def test_rows_are_computed_on_demand_on_a_cpu_unless_the_forward_scores_them_all():
    model = tiny_llama(0)
    assert lazy_rows_on(runner(model))
    assert not lazy_rows_on(TransformersRunner(model, max_seq_len=32))  # its forward scored every row already


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere2", "llama"])
def test_the_fallbacks_logits_from_hidden_are_its_forwards(family):
    """Gemma-2 soft-caps its logits, Granite divides and Cohere scales them after the lm_head: the fallback's
    logits_from_hidden applies the same, and the vocabulary limit."""
    fallback = TransformersRunner(tiny_model(family), max_seq_len=32)
    output = fallback.forward(torch.tensor([[5, 17, 33, 9, 71, 40]]), return_last_hidden=True)
    torch.testing.assert_close(fallback.logits_from_hidden(output.last_hidden), output.logits)
    fallback.logit_vocab = 50
    limited = fallback.logits_from_hidden(output.last_hidden[0, 2:4])
    torch.testing.assert_close(limited[:, :50], output.logits[0, 2:4, :50])
    assert bool((limited[:, 50:] == float("-inf")).all())


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


@pytest.mark.parametrize(
    "algorithm, options, temperature",
    [
        ("eagle3_tree", {"tree_depth": 3, "tree_topk": 3, "tree_total": 12}, 0.0),
        ("eagle3_tree", {"tree_depth": 3, "tree_topk": 3, "tree_total": 12}, 1.0),
        ("self_draft", {"branch_len": 5, "branch_num": 3}, 0.0),
        ("self_draft", {"branch_len": 5, "branch_num": 3}, 1.0),
        # all-at-once rows take the grid's argmax over the full vocabulary: other proposals, same greedy output
        ("self_draft", {"branch_len": 4, "branch_num": 2, "grid_vocab": 40}, 0.0),
    ],
)
def test_same_tokens_with_rows_on_demand_or_all_at_once(monkeypatch, algorithm, options, temperature):
    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    drafter = random_drafter(target, draft_vocab=60) if algorithm == "eagle3_tree" else None
    sampling = GREEDY if temperature == 0 else SamplingParams(temperature=temperature)
    outputs = {}
    for lazy in (True, False):
        from inference.algorithms import feature_drafting, self_draft

        for module in (row_logits, feature_drafting, self_draft):
            monkeypatch.setattr(module, "lazy_rows_on", lambda target, lazy=lazy: lazy)
        args = (runner(target),) if drafter is None else (runner(target), drafter)
        built = build_algorithm(algorithm, *args, **options)
        generator = torch.Generator().manual_seed(5)
        outputs[lazy] = [
            built.generate(p, max_new_tokens=30, sampling=sampling, generator=generator).tokens
            for p in (PROMPT, [3, 14, 15, 92, 65])
        ]
    assert outputs[True] == outputs[False]


# -- exact mode: rows on demand are AR's, bit for bit ---------------------------------------------------------------

# A tree of 11 rows: row 0 the root (the last emitted token), rows 1..8 two chains of 4 (a Self-Draft grid's
# columns), rows 9..10 candidates below the root and inside a chain.
GRID_PARENTS = [-1, 0, 1, 2, 3, 0, 5, 6, 7, 0, 2]
GRID_ROWS = 8


def rows_as_the_algorithms_read_them(target, tokens, mask, positions) -> dict[str, torch.Tensor]:
    """Every row's logits of one verification forward, read as the tree algorithms read them (each row computed
    when read: inference.algorithms.feature_drafting.FeatureTrees.verify) and as Self-Draft does (the root
    with the forward, the grid's rows in one call, the rest when read: NodeLogits.grid_argmax)."""
    output = target.forward(
        tokens, positions=positions, attention_mask=mask, return_last_hidden=True, logit_rows=slice(0, 1)
    )
    tree = RowLogits(output.last_hidden[0], target.logits_from_hidden)
    grid = NodeLogits(
        output.last_hidden[0], target.logits_from_hidden, known=output.logits[0], head_weight=target.lm_head.weight
    )
    grid.grid_argmax(GRID_ROWS, None)
    assert set(grid._rows) == set(range(1, 1 + GRID_ROWS)) and not tree._rows
    return {"tree": tree.stack(range(len(tree))), "grid": grid.stack(range(len(grid)))}


def decoded_paths(target, context: int, tokens: torch.Tensor, parents: list[int]) -> dict[int, torch.Tensor]:
    """Each node's logits from decoding its path token by token after ``context`` cached tokens (AR's calls), in
    one depth-first pass: a node's ancestors are in the cache when it is decoded."""
    children = {node: [c for c, p in enumerate(parents) if p == node] for node in range(-1, len(parents))}
    decoded, stack = {}, [(child, 0) for child in reversed(children[-1])]
    while stack:
        node, depth = stack.pop()
        target.truncate(context + depth)
        decoded[node] = target.forward(tokens[:, node : node + 1]).logits[0, -1]
        stack.extend((child, depth + 1) for child in reversed(children[node]))
    return decoded


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_read_through_row_logits_are_bitwise_the_decoded_paths(smollm2, dtype):
    """On SmolLM2 in exact mode, each verification row's logits as the tree algorithms and Self-Draft obtain them
    equal decoding that node's path token by token (AR's calls), bit for bit: rows computed after the forward, one
    at a time or a grid's at once, take the forward's own path."""
    model, tokenizer = smollm2
    target = exact_runner(model, dtype, max_seq_len=256)
    text = render_prompt(tokenizer, prompt_turns(load_prompts("gsm_symbolic", n=1)[0]))
    context, mask, depth = 16, *tree_mask(GRID_PARENTS)  # a short context: SmolLM2's fp32 prefill is slow here
    # real text on the chains: the prompt's own next tokens, so the logits are those of a real verification
    tokens = torch.tensor([[text[context + d + (i > 4)] for i, d in enumerate(depth)]])
    target.reset(1)
    target.forward(torch.tensor([text[:context]]))
    decoded = decoded_paths(target, context, tokens, GRID_PARENTS)
    target.truncate(context)
    read = rows_as_the_algorithms_read_them(target, tokens, mask, torch.tensor([depth]) + context)
    for rows, logits in read.items():
        for node in range(len(GRID_PARENTS)):
            assert torch.equal(logits[node], decoded[node]), f"node {node} ({rows} rows)"
