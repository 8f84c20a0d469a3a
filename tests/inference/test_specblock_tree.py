"""specblock_tree (docs/algorithms/specblock.md §6, §10 tests 10–12): tree rules and invariants, greedy equality with AR, exact sampling,
bookkeeping with an oracle drafter, and the real SmolLM2 target through inference.evaluate."""

from __future__ import annotations

import math

import pytest
import torch
from eagle3_tree_builders import random_drafter as eagle3_drafter
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from tiny_targets import GREEDY, runner, tiny_llama
from specblock_tree_builders import AUX, N_NEW, PROMPTS, random_drafter

from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter
from inference.algorithms import build_algorithm
from inference.sampling import SamplingParams
from inference.specblock_tree_builder import Nodes, TreeShape, gives_up, prune, slot_widths
from inference.verify import tree_walk, tree_walk_law


class OracleDrafter(SpecBlockDrafter):
    """Knows the target's greedy continuation ``sequence``. Block 1 of anchor j (fed ``sequence[j + 1]``) puts its
    top logit at slot k on ``sequence[j + 2 + k]``; a later block started at slot s of anchor j on the right token
    does the same one level deeper. With ``miss_every`` = m, slots predicting index i with i % m == 0 rank the
    right token SECOND (only an alternative keeps it). Every anchor fed with target features is checked against
    the features of its own position (from a plain HF forward) and the token that follows it."""

    def __init__(self, config, *, sequence: list[int], features: torch.Tensor, miss_every: int = 0, **kw):
        super().__init__(config, **kw)
        self.sequence, self.features, self.miss_every = sequence, features, miss_every
        self.anchor_rows: list[int] = []

    def _steer(self, logits: torch.Tensor, rank: torch.Tensor, first_index: int) -> None:
        for k in range(logits.shape[0]):
            index = first_index + k
            if index >= len(self.sequence):
                return
            logits[k] = torch.linspace(0, -10, logits.shape[-1])
            missed = self.miss_every and index % self.miss_every == 0
            logits[k, self.sequence[index]] = -0.05 if missed else 20.0
            rank[k] = torch.tensor([5.0, 0.0, 0.0, 0.0])  # bucket 0

    def extend_and_draft(self, features, tokens, cache):
        rows = list(range(cache.anchors, cache.anchors + tokens.shape[1]))
        torch.testing.assert_close(self.fc(features[0]), self.fc(self.features[rows]), rtol=1e-4, atol=1e-4)
        assert tokens[0].tolist() == [self.sequence[p + 1] for p in rows]
        self.anchor_rows += rows
        out = super().extend_and_draft(features, tokens, cache)
        self._steer(out.logits[0, 0], out.rank_logits[0, 0], rows[-1] + 2)
        return out

    def forward_leaves(self, cond, tokens, cache, *, current_valid, ttt=None, ttt_visible=None):
        out = super().forward_leaves(cond, tokens, cache, current_valid=current_valid, ttt=ttt, ttt_visible=ttt_visible)
        anchor = cache.anchors - 1
        for row, (token, valid) in enumerate(zip(tokens[0].tolist(), current_valid.tolist())):
            depth_index = anchor + 1 + valid  # the leaf sits at slot valid - 1 of block 1
            if ttt is None and depth_index < len(self.sequence) and token == self.sequence[depth_index]:
                self._steer(out.logits[0, row], out.rank_logits[0, row], depth_index + 1)
        return out


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    references = [
        build_algorithm("ar", runner(target)).generate(p, max_new_tokens=N_NEW, sampling=GREEDY).tokens for p in PROMPTS
    ]
    return target, references


def oracle(target, prompt: list[int], reference: list[int], miss_every: int = 0) -> OracleDrafter:
    sequence = prompt + reference
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in AUX], dim=-1)[0]  # output of layer i = hidden_states[i + 1]
    return random_drafter(
        target,
        draft_vocab=target.config.vocab_size,
        cls=OracleDrafter,
        sequence=sequence,
        features=features,
        miss_every=miss_every,
    )


# -- tree rules ------------------------------------------------------------------------------------------------


def test_slot_widths_caps_and_give_up_by_hand():
    tuned, original = TreeShape(), TreeShape(widths=(2, 4, 10, 0), prob_caps=True)
    #           slot 0 (W by p)  slot 1     slot 2      slot 3
    probs = [0.85, 0.5, 0.9, 0.99]
    buckets = [3, 2, 2, 1]
    assert slot_widths(probs, buckets, tuned, first_block=True) == [5, 6, 3, 2]
    assert slot_widths(probs, buckets, TreeShape(prob_caps=False), first_block=True) == [10, 6, 6, 4]
    assert slot_widths([0.1] * 4, [0, 3, 1, 2], original, first_block=True) == [10, 0, 0, 0]  # bucket 3 stops
    assert slot_widths([0.1] * 4, [3, 1, 1, 1], original, first_block=False) == [0, 0, 0, 0]  # slot 0 counts too
    assert slot_widths([0.95, 0.3, 0.3, 0.3], [0, 0, 0, 0], TreeShape(width=2), first_block=True) == [2, 2, 2, 2]
    assert gives_up([0, 0, 3, 1]) and not gives_up([0, 1, 3, 3]) and not gives_up([0, 0, 0, 0])


def test_prune_keeps_best_nodes_with_their_ancestors():
    nodes = Nodes()
    for draft_id, parent, depth, score in [
        (1, -1, 1, -0.1),
        (2, 0, 2, -2.0),
        (3, 1, 3, -2.1),
        (4, -1, 1, -0.5),
        (5, 3, 2, -0.6),
        (6, 4, 3, -3.0),
    ]:
        nodes.add(draft_id, parent, depth, score)
    assert prune(nodes, 3, 99) == [0, 3, 4]
    assert prune(nodes, 4, 99) == [0, 1, 3, 4]
    assert prune(nodes, 4, 1) == [0, 3]  # depth cap
    assert prune(nodes, 99, 99) == list(range(6))


def brute_ancestors(parents: list[int]) -> torch.Tensor:
    size = len(parents) + 1
    mask = torch.zeros(size, size, dtype=torch.bool)
    for row in range(size):
        mask[row, 0] = mask[row, row] = True
        node = row - 1
        while node >= 0:
            mask[row, node + 1] = True
            node = parents[node]
    return mask


def first_block(algorithm, prompt):
    output = algorithm.target.forward(torch.tensor([prompt]), capture_layers=AUX, only_last_logits=True)
    root = int(output.logits[0, -1].argmax())
    cache = algorithm.drafter.new_cache(64)
    block = algorithm.drafter.extend_and_draft(algorithm._features(output), torch.tensor([prompt[1:] + [root]]), cache)
    return block, cache


SHAPES = [
    dict(),
    dict(width=1, widths=[1, 1, 1, 1]),
    dict(blocks=3, budget=40),
    dict(budget=7),
    dict(widths=[2, 4, 10, 0], prob_caps=False),
    dict(blocks=1, width=4),
    dict(blocks=3, budget=1000),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_invariants(setup, shape):
    target, _ = setup
    for seed in range(3):
        drafter = random_drafter(target, draft_vocab=60, seed=seed)
        algorithm = build_algorithm("specblock_tree", runner(target), drafter, **shape)
        block, cache = first_block(algorithm, PROMPTS[seed % 2])
        tree, forwards = algorithm.builder.build(block, cache)
        k, blocks, budget = drafter.config.block_size, algorithm.shape.blocks, algorithm.shape.budget
        assert forwards <= blocks - 1 and 1 <= len(tree) <= budget
        assert all(p < i for i, p in enumerate(tree.parents))  # parents precede children
        assert all(tree.depths[i] == (1 if p < 0 else tree.depths[p] + 1) for i, p in enumerate(tree.parents))
        assert tree.max_depth <= blocks * k
        assert torch.equal(tree.ancestor_mask(), brute_ancestors(tree.parents))
        used = set(torch.nonzero(drafter.t2d).flatten().tolist())
        assert set(tree.tokens) <= used  # draft ids were mapped to target ids
        greedy = drafter.to_target_ids(block.logits[0, 0].argmax(-1)).tolist()
        assert tree.parents[0] == -1 and tree.tokens[0] == greedy[0]  # the greedy chain starts the tree
        if len(tree) < budget:  # pruning did not bite: the whole block-1 greedy chain is there
            assert _has_chain(tree, 0, greedy[1:])
        siblings = {}
        for i, p in enumerate(tree.parents):
            assert tree.tokens[i] not in siblings.setdefault(p, set())  # distinct children
            siblings[p].add(tree.tokens[i])


def test_chain_config_is_two_chained_blocks(setup):
    target, _ = setup
    drafter = random_drafter(target, draft_vocab=97)
    algorithm = build_algorithm("specblock_tree", runner(target), drafter, width=1, widths=[1, 1, 1, 1])
    for prompt in PROMPTS:
        block, cache = first_block(algorithm, prompt)
        tree, forwards = algorithm.builder.build(block, cache)
        give_up = next((c for c in block.rank_logits[0, 0].argmax(-1).tolist() if c), 0) == 3
        size = 4 if give_up else 8
        assert tree.parents == list(range(-1, size - 1)) and forwards == (0 if give_up else 1)


def test_later_blocks_match_each_leaf_alone(setup):
    """One batched later-block forward over all pending leaves == each leaf's block run alone (masks, TTT
    validity and positions of the batch), and each leaf's greedy chain is in the tree below it."""
    target, _ = setup
    drafter = random_drafter(target, draft_vocab=60)
    calls = []
    batched = drafter.forward_leaves

    def recording(cond, tokens, cache, **kw):
        out = batched(cond, tokens, cache, **kw)
        calls.append((cond, tokens, kw["current_valid"], out))
        return out

    drafter.forward_leaves = recording
    algorithm = build_algorithm("specblock_tree", runner(target), drafter, prob_caps=False, budget=1000)
    block, cache = first_block(algorithm, PROMPTS[0])
    tree, forwards = algorithm.builder.build(block, cache)
    assert forwards == len(calls) == 1
    cond, tokens, valid, out = calls[0]
    assert tokens.shape[1] >= 4  # several pending leaves in one forward
    for row in range(tokens.shape[1]):
        alone = batched(cond[:, row : row + 1], tokens[:, row : row + 1], cache, current_valid=valid[row : row + 1])
        torch.testing.assert_close(alone.logits[0, 0], out.logits[0, row], rtol=0, atol=1e-5)
        # the leaf's node: depth = its source slot + 1, token = the leaf token
        slot = int(valid[row]) - 1
        candidates = [i for i, d in enumerate(tree.depths) if d == slot + 1 and tree.tokens[i] == int(tokens[0, row])]
        chain = drafter.to_target_ids(alone.logits[0, 0].argmax(-1)).tolist()
        assert any(_has_chain(tree, node, chain) for node in candidates), row


def _has_chain(tree, node: int, chain: list[int]) -> bool:
    for token in chain:
        children = [i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == token]
        if not children:
            return False
        node = children[0]
    return True


# -- greedy equality and bookkeeping ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES[:5])
@pytest.mark.parametrize("kind", ["random", "oracle_with_misses"])
def test_greedy_equals_ar(setup, kind, shape):
    target, references = setup
    cases = list(zip(PROMPTS, references))
    for prompt, reference in cases[: 1 if kind == "random" else None]:  # a random drafter is slow (~no acceptance)
        drafter = (
            random_drafter(target, draft_vocab=60)
            if kind == "random"
            else oracle(target, prompt, reference, miss_every=3)
        )
        algorithm = build_algorithm("specblock_tree", runner(target), drafter, **shape)
        result = algorithm.generate(prompt, max_new_tokens=N_NEW, sampling=GREEDY)
        assert result.tokens == reference
        stats = result.stats
        assert stats.new_tokens == N_NEW and stats.target_forwards == 1 + stats.rounds
        assert stats.draft_forwards <= stats.rounds * algorithm.shape.blocks
        if kind == "oracle_with_misses" and shape.get("width", 10) > 1:
            assert stats.tau > 3.0  # misses ranked second are accepted through an alternative and its block


def test_oracle_accepts_two_whole_blocks_per_round(setup):
    """τ bookkeeping: with an exact drafter every round accepts 2K drafted tokens plus one, each committed
    position reaches the drafter exactly once as an anchor, with its own features and the token after it."""
    target, references = setup
    prompt, reference = PROMPTS[0], references[0]
    drafter = oracle(target, prompt, reference)
    algorithm = build_algorithm("specblock_tree", runner(target), drafter)
    result = algorithm.generate(prompt, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats, per_round = result.stats, 2 * drafter.config.block_size + 1
    rounds = math.ceil((N_NEW - 1) / per_round)
    assert stats.rounds == rounds and stats.accepted_draft_tokens == N_NEW - 1 - rounds
    assert stats.draft_forwards == 2 * rounds  # block 1 (merged with the cache update) + one later-block forward
    assert drafter.anchor_rows == list(range(len(drafter.anchor_rows)))
    assert len(drafter.anchor_rows) == len(prompt) + (rounds - 1) * per_round  # the last round's anchors: unused


def test_eos_inside_the_tree_and_the_token_budget(setup):
    target, references = setup
    prompt, reference = PROMPTS[0], references[0]
    eos = reference[6]
    expected = reference[: reference.index(eos) + 1]
    for drafter in (oracle(target, prompt, reference), random_drafter(target, draft_vocab=60)):
        algorithm = build_algorithm("specblock_tree", runner(target), drafter, budget=30)
        assert algorithm.generate(prompt, max_new_tokens=N_NEW, sampling=GREEDY, eos_ids=[eos]).tokens == expected
        for n in (1, 2, 7, 11):
            result = algorithm.generate(prompt, max_new_tokens=n, sampling=GREEDY)
            assert result.tokens == reference[:n] and result.stats.new_tokens == n


# -- sampling exactness --------------------------------------------------------------------------------------


def test_frozen_tree_walk_is_exact(setup):
    """Freeze one SpecBlock tree and its target logits: the walk's exact law has the target's marginal for the
    first token (enumeration), and replays of the walk match softmax(logits_root / T) in TV as closely as direct sampling does."""
    target, _ = setup
    drafter = random_drafter(target, draft_vocab=60)
    algorithm = build_algorithm("specblock_tree", runner(target), drafter, budget=20)
    prompt = PROMPTS[0]
    block, cache = first_block(algorithm, prompt)
    tree, _ = algorithm.builder.build(block, cache)
    runner_ = algorithm.target
    runner_.reset(1)
    root = int(runner_.forward(torch.tensor([prompt])).logits[0, -1].argmax())
    logits = runner_.forward(
        torch.tensor([[root, *tree.tokens]]),
        positions=tree.positions(len(prompt))[None],
        attention_mask=tree.ancestor_mask(),
    ).logits[0]
    for temperature in (0.7, 1.5):
        probs = SamplingParams(temperature).warp(logits)
        exact = probs.double() / probs.double().sum(-1, keepdim=True)  # rows summing to 1 in fp64
        law = tree_walk_law(tree.tokens, tree.parents, exact)
        first = torch.zeros(probs.shape[-1], dtype=torch.float64)
        for sequence, p in law.items():
            first[sequence[0]] += p
        torch.testing.assert_close(first, exact[0], rtol=0, atol=1e-12)
        generator, runs = torch.Generator().manual_seed(7), 3000
        walked, direct = torch.zeros(probs.shape[-1]), torch.zeros(probs.shape[-1])
        for _ in range(runs):
            walked[int(tree_walk(tree.tokens, tree.parents, probs, generator).tokens[0])] += 1
        direct += torch.bincount(
            torch.multinomial(probs[0], runs, replacement=True, generator=generator), minlength=probs.shape[-1]
        )
        tv_walk = 0.5 * (walked / runs - probs[0]).abs().sum()
        tv_direct = 0.5 * (direct / runs - probs[0]).abs().sum()
        assert tv_walk < 1.5 * tv_direct + 0.01, (tv_walk, tv_direct)  # within direct sampling's own noise


def test_sampling_follows_the_target_law():
    """Monte Carlo end to end, LAW_ROWS requests side by side: the law of the first 3 tokens of a row in a batch
    equals the target's (chi-square and TV), with a reduced draft vocabulary (Vd=3 < V=4) and K=1, so tokens 2 and
    3 come from block 1 and from a later block (or their alternatives) of the first tree."""
    vocab, n, runs = 4, 3, 1000
    target = tiny_llama(10, vocab=vocab, layers=3, temperature_scale=3.0)
    config = SpecBlockConfig.for_target(target.config, draft_vocab_size=3, aux_layer_ids=AUX, block_size=1)
    torch.manual_seed(5)
    drafter = SpecBlockDrafter(config, embed_weight=target.model.embed_tokens.weight.detach())
    drafter.set_vocab_map(torch.tensor([0, 0, 1]), torch.tensor([True, True, False, True]))  # ids 0, 1, 3
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    algorithm = build_algorithm(
        "specblock_tree", runner(target, 16, rows=2 * LAW_ROWS), drafter, width=2, budget=6, widths=[2, 2, 2, 2]
    )
    counts, accepted = sampled_law(algorithm, prompt, n, runs)
    assert accepted > runs // 2  # tree paths are really exercised, not just the bonus token
    # direct sampling of this 64-outcome law with N=1000 gives TV 0.10 on average (0.12 max over 50 seeds)
    assert_follows_law(counts, law, runs, max_tv=0.15)


# -- errors and the real target ----------------------------------------------------------------------------


def test_bad_drafters_and_options_are_one_line_errors(setup):
    target, _ = setup
    with pytest.raises(ValueError, match="specblock_tree needs a SpecBlock drafter, got Eagle3Drafter"):
        build_algorithm("specblock_tree", runner(target), eagle3_drafter(target, draft_vocab=60))
    with pytest.raises(ValueError, match="SpecBlock drafter vocab_size 50 differs from the target's 97"):
        build_algorithm("specblock_tree", runner(target), random_drafter(tiny_llama(2, vocab=50), draft_vocab=20))
    with pytest.raises(ValueError, match="widths must be 4 candidate counts"):
        build_algorithm("specblock_tree", runner(target), random_drafter(target, draft_vocab=60), widths=[2, 4])
    with pytest.raises(ValueError, match="width >= 1, budget >= 1 and blocks >= 1"):
        build_algorithm("specblock_tree", runner(target), random_drafter(target, draft_vocab=60), blocks=0)


def test_evaluate_names_the_missing_specblock_export(capsys, tmp_path):
    from inference import evaluate as evaluate_cli

    assert evaluate_cli.main(["algorithms=specblock_tree", "n_prompts=1", f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'specblock_tree' needs a SpecBlock export" in err and "add drafter.specblock=PATH" in err, err
    assert "\n" not in err


@pytest.mark.real_model
def test_real_smollm2_greedy_equals_ar_through_evaluate(smollm2, tmp_path):
    """On real MT-Bench prompts, in ONE evaluate run with an EAGLE-3 and a SpecBlock drafter (both untrained):
    specblock_tree keeps the output token-for-token equal to AR."""
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from inference import evaluate as evaluate_cli
    from inference.drafters import LoadedModel
    from inference.runner import ModelRunner

    model, tokenizer = smollm2
    target = LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=512), tokenizer, model)
    embed = target.runner.embed_tokens.weight
    torch.manual_seed(0)
    eagle3 = Eagle3Drafter(
        Eagle3Config.for_target(model.config, draft_vocab_size=8000, aux_layer_ids=[1, 14, 26]), embed_weight=embed
    ).eval()
    specblock = SpecBlockDrafter(
        SpecBlockConfig.for_target(model.config, draft_vocab_size=8000, aux_layer_ids=[1, 14, 26]), embed_weight=embed
    ).eval()
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=[eagle3_tree,specblock_tree]",
            "bench=mt_bench",
            "n_prompts=2",
            "max_new_tokens=12",
            "tree_depth=3",
            "tree_topk=3",
            "tree_total=10",
            "specblock_budget=12",
            f"out={tmp_path}",
            "warmup=false",
        ]
    )
    results = evaluate_cli.evaluate(cfg, target=target, drafters={"eagle3": eagle3, "specblock": specblock})
    ar, _, block = results["runs"]
    assert block["algorithm"] == "specblock_tree" and block["greedy_equal_to_ar"] is True
    assert block["new_tokens"] == ar["new_tokens"] and block["drafted_tokens"] > 0
    assert block["draft_forwards"] <= 2 * (block["target_forwards"] - 2)  # <= 2 drafter calls per iteration


def test_evaluate_loads_specblock_drafter_from_its_export(tmp_path):
    """``drafter.specblock=PATH`` through the CLI: loaded with its target check, greedy output equal to AR."""
    from tiny_targets import save_tiny_target
    from transformers import AutoConfig

    from core.assets import target_record
    from core.drafters.specblock import save_native
    from inference import evaluate as evaluate_cli

    target_dir = save_tiny_target(tmp_path / "target", layers=4, hidden=32)
    model_config = SpecBlockConfig.for_target(
        AutoConfig.from_pretrained(target_dir), draft_vocab_size=500, aux_layer_ids=AUX
    )
    torch.manual_seed(0)
    drafter = SpecBlockDrafter(model_config)
    used = torch.arange(500) * 7  # every 7th token id
    t2d = torch.zeros(model_config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    drafter.set_vocab_map(used - torch.arange(500), t2d)
    export = save_native(drafter, tmp_path / "sb", target=target_record(str(target_dir)))
    assert (
        evaluate_cli.main(
            [
                f"target={target_dir}",
                f"drafter.specblock={export}",
                "algorithms=specblock_tree",
                "n_prompts=1",
                "max_new_tokens=12",
                "specblock_budget=12",
                "warmup=false",
                "max_seq_len=256",
                "device=cpu",
                f"out={tmp_path / 'eval'}",
            ]
        )
        == 0
    )
    import json

    runs = json.loads((tmp_path / "eval" / "results.json").read_text())["runs"]
    assert [r["algorithm"] for r in runs] == ["ar", "specblock_tree"] and runs[1]["greedy_equal_to_ar"] is True
