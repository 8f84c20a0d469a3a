"""eagle3_tree: greedy equality with AR over tree shapes, τ bookkeeping with an oracle drafter, exact sampling law."""

from __future__ import annotations

import math

import pytest
import torch
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from tiny_targets import GREEDY, runner, tiny_llama
from eagle3_tree_builders import AUX, N_NEW, PROMPT, random_drafter

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from inference.algorithms import build_algorithm
from inference.algorithms.base import GenerationStats
from inference.evaluate import run_record
from inference.tree import DraftTree, keep_best, subtree


class OracleDrafter(Eagle3Drafter):
    """Knows the target's greedy continuation ``sequence``: a row at position p fed token sequence[p + 1] gets
    its top logit on sequence[p + 2]. With ``miss_every`` = m, rows at positions p % m == 0 rank it second
    instead (so only a tree with top-k >= 2 keeps it). It also checks that every row fed with target features
    carries the features of its own position (captured from a plain HF forward) and the right token."""

    def __init__(self, config, *, sequence: list[int], features: torch.Tensor, miss_every: int = 0, **kw):
        super().__init__(config, **kw)
        self.sequence, self.features, self.miss_every = sequence, features, miss_every
        self.feature_rows: list[int] = []
        self._projected: tuple[torch.Tensor, torch.Tensor] | None = None

    def project(self, aux_hidden):
        hidden = super().project(aux_hidden)
        self._projected = (aux_hidden, hidden)
        return hidden

    def step(self, tokens, hidden, positions, cache, attention_mask=None):
        if self._projected is not None and hidden is self._projected[1]:
            rows = positions[0].tolist()
            torch.testing.assert_close(self._projected[0][0], self.features[rows], rtol=1e-4, atol=1e-4)
            assert tokens[0].tolist() == [self.sequence[p + 1] for p in rows]
            self.feature_rows += rows
        out = super().step(tokens, hidden, positions, cache, attention_mask)
        for row, (position, token) in enumerate(zip(positions[0].tolist(), tokens[0].tolist())):
            if position + 2 < len(self.sequence) and token == self.sequence[position + 1]:
                right = int(torch.nonzero(self.t2d).flatten().tolist().index(self.sequence[position + 2]))
                out.logits[0, row] = torch.linspace(0, -10, out.logits.shape[-1])  # a fixed, distinct ranking
                missed = self.miss_every and position % self.miss_every == 0
                out.logits[0, row, right] = -0.05 if missed else 20.0
        return out


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    reference = build_algorithm("ar", runner(target)).generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY).tokens
    sequence = PROMPT + reference
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in AUX], dim=-1)[0]  # output of layer i = hidden_states[i + 1]
    return target, reference, sequence, features


def oracle(setup, miss_every: int = 0) -> OracleDrafter:
    target, _, sequence, features = setup
    # full draft vocabulary, so every greedy token can be proposed
    return random_drafter(
        target,
        draft_vocab=target.config.vocab_size,
        cls=OracleDrafter,
        sequence=sequence,
        features=features,
        miss_every=miss_every,
    )


SHAPES = [(1, 1, 2), (1, 4, 5), (2, 2, 4), (3, 3, 16), (5, 4, 64), (5, 1, 6), (4, 3, 3)]


@pytest.mark.parametrize("depth, topk, total", SHAPES)
@pytest.mark.parametrize("kind", ["random", "oracle_with_misses"])
def test_greedy_equals_ar(setup, kind, depth, topk, total):
    target, reference, _, _ = setup
    drafter = random_drafter(target, draft_vocab=60) if kind == "random" else oracle(setup, miss_every=3)
    algorithm = build_algorithm(
        "eagle3_tree", runner(target), drafter, tree_depth=depth, tree_topk=topk, tree_total=total
    )
    result = algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats = result.stats
    assert stats.new_tokens == N_NEW and stats.target_forwards == 1 + stats.rounds
    assert stats.new_tokens <= 1 + stats.accepted_draft_tokens + stats.rounds
    assert stats.drafted_tokens <= stats.rounds * (total - 1)
    assert 0 < stats.draft_s < stats.wall_s  # the drafter's time per round is timed inside the generation
    record = run_record("eagle3_tree", "test", 1, stats)
    assert record["draft_ms_per_round"] == pytest.approx(1000 * stats.draft_s / stats.rounds, abs=1e-3)
    if kind == "oracle_with_misses" and topk >= 2 and depth >= 2:
        assert stats.tau > 2.0  # misses ranked second are still accepted through a sibling


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_oracle_drafter_accepts_whole_paths(setup, depth):
    """τ bookkeeping: every round accepts `depth` drafted tokens plus one, and each committed position reaches
    the drafter exactly once, with its own features."""
    target, reference, _, _ = setup
    drafter = oracle(setup)
    algorithm = build_algorithm(
        "eagle3_tree", runner(target), drafter, tree_depth=depth, tree_topk=2, tree_total=2 * depth + 1
    )
    result = algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats = result.stats
    rounds = math.ceil((N_NEW - 1) / (depth + 1))
    assert stats.rounds == rounds and stats.target_forwards == rounds + 1
    assert stats.accepted_draft_tokens == N_NEW - 1 - rounds
    assert stats.acceptance_by_position == [1.0] * depth
    assert stats.tau == pytest.approx(N_NEW / (rounds + 1))
    fed = drafter.feature_rows
    assert sorted(fed) == list(range(len(fed))) and len(fed) >= len(PROMPT) + N_NEW - depth - 2


def test_eos_inside_the_tree_and_the_token_budget(setup):
    target, reference, _, _ = setup
    eos = reference[8]  # with depth 4 the oracle accepts tokens 6..9 in one round: EOS sits inside that path
    expected = reference[: reference.index(eos) + 1]
    for drafter in (oracle(setup), random_drafter(target, draft_vocab=60)):
        algorithm = build_algorithm("eagle3_tree", runner(target), drafter, tree_depth=4, tree_topk=3, tree_total=12)
        assert algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY, eos_ids=[eos]).tokens == expected
        for n in (1, 2, 7, 11):
            result = algorithm.generate(PROMPT, max_new_tokens=n, sampling=GREEDY)
            assert result.tokens == reference[:n] and result.stats.new_tokens == n


def test_sampling_follows_the_target_law():
    """Monte Carlo: the law of the first 3 tokens equals the target's (chi-square and TV, fixed seed), with a
    reduced draft vocabulary and a tree of two levels with two children each."""
    vocab, n, runs = 4, 3, 3000
    target = tiny_llama(10, vocab=vocab, layers=3, temperature_scale=3.0)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=3, aux_layer_ids=AUX)
    torch.manual_seed(5)
    drafter = Eagle3Drafter(config, embed_weight=target.model.embed_tokens.weight.detach())
    drafter.set_vocab_map(torch.tensor([0, 0, 1]), torch.tensor([True, True, False, True]))  # ids 0, 1, 3
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    algorithm = build_algorithm(
        "eagle3_tree", runner(target, 16, rows=2 * LAW_ROWS), drafter, tree_depth=2, tree_topk=2, tree_total=4
    )
    counts, accepted = sampled_law(algorithm, prompt, n, runs)
    assert accepted > runs // 2  # the tree paths are really exercised, not just the bonus token
    assert_follows_law(counts, law, runs, max_tv=0.07)


def test_tree_children_follow_each_nodes_own_chain(setup):
    """Tree growth runs a whole level in one masked drafter forward; every expanded node's children must be the
    top-k of the drafter run along that node's own chain alone (checks masks, positions and hidden plumbing)."""
    target, _, _, _ = setup
    drafter = random_drafter(target, draft_vocab=60)
    depth, topk = 4, 3
    algorithm = build_algorithm(
        "eagle3_tree", runner(target), drafter, tree_depth=depth, tree_topk=topk, tree_total=1000
    )
    output = algorithm.target.forward(torch.tensor([PROMPT]), capture_layers=AUX, only_last_logits=True)
    root, committed = int(output.logits[0, -1].argmax()), len(PROMPT)
    features = algorithm._features(output)

    def extend(cache):
        return drafter.step(
            torch.tensor([PROMPT[1:] + [root]]), drafter.project(features), torch.arange(committed)[None], cache
        )

    first = extend(cache := drafter.new_cache(128))
    tree = algorithm._grow_tree(first.logits[0, -1], first.hidden[0, -1], committed, cache, depth, GenerationStats())
    assert len(tree) == topk + (depth - 1) * topk * topk and tree.max_depth == depth
    expanded = sorted(set(p for p in tree.parents if p >= 0))
    assert len(expanded) == (depth - 1) * topk
    for node in expanded:
        chain, ancestor = [], node
        while ancestor >= 0:
            chain.insert(0, ancestor)
            ancestor = tree.parents[ancestor]
        step = extend(alone := drafter.new_cache(128))
        for level, member in enumerate(chain, start=1):
            step = drafter.step(
                torch.tensor([[tree.tokens[member]]]),
                step.hidden[:, -1:],
                torch.tensor([[committed - 1 + level]]),
                alone,
            )
        expected = drafter.to_target_ids(step.logits[0, -1].topk(topk).indices).tolist()
        assert [tree.tokens[c] for c, p in enumerate(tree.parents) if p == node] == expected, node


def test_tree_mask_positions_and_pruning():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    tree = DraftTree(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 1], depths=[1, 1, 2, 2, 2])
    mask = tree.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False, False]  # root, node 0, itself
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert mask[0].tolist() == [True] + [False] * 5
    assert tree.positions(9).tolist() == [9, 10, 10, 11, 11, 11]
    scores = [-0.1, -0.5, -0.2, -0.5, -0.6]
    assert keep_best(scores, tree.parents, 3) == [0, 1, 2]  # tie -0.5: node 1 (earlier) before node 3
    assert subtree(tree.tokens, tree.parents, tree.depths, [0, 2, 3]) == DraftTree([10, 12, 13], [-1, 0, 0], [1, 2, 2])
    with pytest.raises(ValueError, match="scores above its parent"):
        keep_best([-1.0, -0.5], [-1, 0], 1)


def test_bad_drafters_and_options_are_one_line_errors(setup):
    target, _, _, _ = setup
    with pytest.raises(
        ValueError, match="needs an EAGLE-3 export of python -m spectrain.export for this target: pass drafter=PATH"
    ):
        build_algorithm("eagle3_tree", runner(target))
    with pytest.raises(ValueError, match="drafter vocab_size 50 differs from the target's 97"):
        build_algorithm("eagle3_tree", runner(target), random_drafter(tiny_llama(2, vocab=50), draft_vocab=20))
    wide = Eagle3Drafter(Eagle3Config(32, 64, 4, 2, 97, 97, target_hidden_size=48, aux_layer_ids=AUX))
    with pytest.raises(ValueError, match="reads features of width 48 but the target's hidden_size is 32"):
        build_algorithm("eagle3_tree", runner(target), wide)
    deep = Eagle3Drafter(Eagle3Config(32, 64, 4, 2, 97, 97, target_hidden_size=32, aux_layer_ids=[1, 2, 9]))
    with pytest.raises(ValueError, match=r"aux layers \[1, 2, 9\] do not exist in a 4-layer target"):
        build_algorithm("eagle3_tree", runner(target), deep)
    with pytest.raises(ValueError, match="need tree_depth >= 1, tree_topk >= 1 and tree_total >= 2"):
        build_algorithm("eagle3_tree", runner(target), random_drafter(target, draft_vocab=60), tree_total=1)
    algorithm = build_algorithm("eagle3_tree", runner(target), random_drafter(target, draft_vocab=60), tree_total=40)
    with pytest.raises(ValueError, match=r"\(\+40 lookahead\) needs 236 cache slots but max_seq_len=192"):
        algorithm.generate(list(range(1, 101)), max_new_tokens=96, sampling=GREEDY)


@pytest.mark.real_model
def test_real_smollm2_greedy_equals_ar_through_evaluate(smollm2, tmp_path):
    """On real MT-Bench prompts, via inference.evaluate: an (untrained) EAGLE-3 drafter for SmolLM2 keeps the
    output token-for-token equal to AR (the exactness does not depend on the drafter's quality)."""
    from inference import evaluate as evaluate_cli
    from inference.drafters import LoadedModel
    from inference.runner import ModelRunner

    model, tokenizer = smollm2
    target = LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=512), tokenizer, model)
    config = Eagle3Config.for_target(model.config, draft_vocab_size=8000, aux_layer_ids=[1, 14, 26])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, embed_weight=target.runner.embed_tokens.weight).eval()
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=eagle3_tree",
            "bench=mt_bench",
            "n_prompts=2",
            "max_new_tokens=16",
            "tree_depth=3",
            "tree_topk=3",
            "tree_total=10",
            f"out={tmp_path}",
            "warmup=false",
        ]
    )
    results = evaluate_cli.evaluate(cfg, target=target, drafters={"eagle3": drafter})
    ar, tree = results["runs"]
    assert (ar["algorithm"], tree["algorithm"]) == ("ar", "eagle3_tree")
    assert tree["greedy_equal_to_ar"] is True and tree["new_tokens"] == ar["new_tokens"]
    assert tree["drafted_tokens"] > 0 and tree["draft_forwards"] > tree["target_forwards"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["algorithms=eagle3_tree", "n_prompts=1"], "'eagle3_tree' needs an EAGLE-3 export"),
        (
            ["algorithms=[sps,eagle3_tree]", "drafter=/some/draft_lm", "n_prompts=1"],
            "add drafter.eagle3=PATH or drafters=DIR",
        ),
    ],
)
def test_evaluate_names_the_missing_eagle3_export(args, needle, capsys, tmp_path):
    from inference import evaluate as evaluate_cli

    assert evaluate_cli.main([*args, f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_generate_names_the_missing_eagle3_export(capsys):
    from inference import generate as generate_cli

    assert generate_cli.main(["algorithm=eagle3_tree", "prompt=hi"]) == 2
    assert (
        "algorithm 'eagle3_tree' needs an EAGLE-3 export of python -m spectrain.export for this target: add "
        "drafter=PATH" in capsys.readouterr().err
    )
