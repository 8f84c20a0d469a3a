"""Self-Draft (docs/algorithms/self_draft.md §11): greedy equality with AR, the §4 mask/positions, packed-forward logits, the caches,
corpus building, accounting, and the sampling law."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from tiny_targets import runner, tiny_llama

from data_prep.ngram_corpus import count_ngrams
from inference.algorithms import build_algorithm
from inference.algorithms.self_draft import BranchGrid, Column, GridVocab, SelfDraft, attention_inputs, layout_step
from inference.ngram_cache import ContextCache, CorpusCache
from inference.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[3, 14, 15, 92, 65], [7, 1, 8, 2, 8], [5, 5, 6], [40]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, layers=2, temperature_scale=8.0)


@pytest.fixture(scope="module")
def references(model):
    ar = build_algorithm("ar", runner(model))
    return [ar.generate(p, max_new_tokens=40, sampling=GREEDY).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def corpus(model):
    """Corpus cache from the model's own greedy text on other prompts (min_count 1: a tiny corpus)."""
    ar = build_algorithm("ar", runner(model))
    docs = [ar.generate([t, t + 1], max_new_tokens=60, sampling=GREEDY).tokens for t in range(10, 90, 8)]
    return CorpusCache(count_ngrams(docs, min_count=1))


def self_draft(model, **options) -> SelfDraft:
    return build_algorithm("self_draft", runner(model), **options)


# ------------------------------------------------------------------------------------------------ greedy


def assert_greedy_equal(algorithm: SelfDraft, references, n: int = 40) -> int:
    """Run every prompt (the context cache carries over); returns the accepted draft tokens."""
    accepted = 0
    for prompt, expected in zip(PROMPTS, references):
        result = algorithm.generate(prompt, max_new_tokens=n, sampling=GREEDY)
        assert result.tokens == expected[:n]
        assert result.stats.new_tokens == n
        accepted += result.stats.accepted_draft_tokens
    return accepted


@pytest.mark.parametrize("branch_len", [4, 5, 6, 7])
@pytest.mark.parametrize("branch_num", [2, 3, 6])
def test_greedy_equals_ar_with_both_caches(model, references, corpus, branch_len, branch_num):
    algorithm = self_draft(model, branch_len=branch_len, branch_num=branch_num, corpus=corpus)
    assert assert_greedy_equal(algorithm, references) > 0


@pytest.mark.parametrize("branch_len,branch_num", [(4, 2), (6, 6), (7, 3)])
@pytest.mark.parametrize("caches", ["context", "corpus", "none", "compat", "no_branch_verify", "grid_vocab"])
def test_greedy_equals_ar_per_cache_and_mode(model, references, corpus, branch_len, branch_num, caches):
    options = {
        "context": {"context_cache": True},
        "corpus": {"context_cache": False, "corpus": corpus},
        "none": {"context_cache": False},
        "compat": {"corpus": corpus, "compat_original_cap": True},
        "no_branch_verify": {"corpus": corpus, "verify_branches": False},
        "grid_vocab": {"corpus": corpus, "grid_vocab": 40},  # the grid's argmax sees ids < 40 + the text's
    }[caches]
    algorithm = self_draft(model, branch_len=branch_len, branch_num=branch_num, **options)
    accepted = assert_greedy_equal(algorithm, references)
    if caches != "none":
        assert accepted > 0  # the candidates really were used


def test_eos_inside_an_accepted_candidate(model, references):
    """Pick as EOS a token that the algorithm emits in the middle of a multi-token step; output must stop there."""
    prompt, expected = PROMPTS[0], references[0]
    chunks: list[list[int]] = []
    algorithm = self_draft(model, branch_len=5, branch_num=3)
    algorithm.generate(PROMPTS[1], max_new_tokens=40, sampling=GREEDY)  # warm the context cache
    algorithm.generate(prompt, max_new_tokens=40, sampling=GREEDY, on_tokens=chunks.append)
    emitted_before = 0
    for chunk in chunks:
        middle = [i for i in range(len(chunk) - 1) if chunk[i] not in expected[: emitted_before + i]]
        if middle:
            eos = chunk[middle[0]]
            break
        emitted_before += len(chunk)
    else:
        pytest.fail("no multi-token step with a fresh token to use as EOS")
    truncated = expected[: expected.index(eos) + 1]
    algorithm = self_draft(model, branch_len=5, branch_num=3)
    algorithm.generate(PROMPTS[1], max_new_tokens=40, sampling=GREEDY)
    result = algorithm.generate(prompt, max_new_tokens=40, sampling=GREEDY, eos_ids=[eos])
    assert result.tokens == truncated and len(truncated) < 40


def test_forward_accounting_and_compat_cap(model, references, corpus):
    """DE counts every forward (prefill and warm-up included); the compat mode emits one token per warm-up
    forward and never more than G per step, the default emits the bonus token after a full match."""
    branch_len, gram_len = 6, 4
    algorithm = self_draft(model, branch_len=branch_len, branch_num=3, corpus=corpus, compat_original_cap=True)
    calls = []
    forward = algorithm.target.forward
    algorithm.target.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    algorithm.generate(PROMPTS[1], max_new_tokens=40, sampling=GREEDY)
    chunks: list[list[int]] = []
    calls.clear()
    result = algorithm.generate(PROMPTS[0], max_new_tokens=40, sampling=GREEDY, on_tokens=chunks.append)
    assert result.tokens == references[0]
    assert result.stats.target_forwards == len(calls) == len(chunks)
    assert result.stats.tau == pytest.approx(40 / len(calls))
    assert [len(c) for c in chunks[: branch_len - 2]] == [1] * (branch_len - 2)  # prefill + warm-up
    assert max(len(c) for c in chunks) == gram_len  # full matches happen, and stop at G tokens

    fixed = self_draft(model, branch_len=branch_len, branch_num=3, corpus=corpus, verify_branches=False)
    fixed.generate(PROMPTS[1], max_new_tokens=40, sampling=GREEDY)
    chunks.clear()
    assert (
        fixed.generate(PROMPTS[0], max_new_tokens=40, sampling=GREEDY, on_tokens=chunks.append).tokens == references[0]
    )
    assert max(len(c) for c in chunks) == gram_len + 1  # the bonus token after a full match


# ------------------------------------------------------------------------------------------- mask, positions


SPEC_EXAMPLE_MASK = """
        x  A  B  C a0 a1 a2 b0 b1 b2 g1 g2
   x    1  .  .  .  .  .  .  .  .  .  .  .
   A    1  1  .  .  .  .  .  .  .  .  .  .
   B    1  1  1  .  .  .  .  .  .  .  .  .
   C    1  .  .  1  .  .  .  .  .  .  .  .
  a0    1  .  .  .  1  .  .  .  .  .  .  .
  a1    1  1  1  .  .  1  .  .  .  .  .  .
  a2    1  .  .  1  .  .  1  .  .  .  .  .
  b0    1  .  .  .  1  .  .  1  .  .  .  .
  b1    1  1  1  .  .  1  .  .  1  .  .  .
  b2    1  .  .  1  .  .  1  .  .  1  .  .
  g1    1  .  .  .  .  .  .  .  .  .  1  .
  g2    1  .  .  .  .  .  .  .  .  .  1  1
"""


def test_spec_example_mask_and_positions():
    """§4: N=3, L=4; col 1 pads A,B; col 2 pads C; levels a*, b*; one candidate (g1, g2)."""
    names = SPEC_EXAMPLE_MASK.split("\n")[1].split()
    ids = {name: i + 1 for i, name in enumerate(names)}
    columns = [
        Column([ids["a0"], ids["b0"]], 0),
        Column([ids[t] for t in ("A", "B", "a1", "b1")], 2),
        Column([ids[t] for t in ("C", "a2", "b2")], 1),
    ]
    layout = layout_step(columns, [(ids["g1"], ids["g2"])])
    assert [ids["x"]] + layout.tokens == [ids[n] for n in names]  # the original's token order
    p = 37
    positions, mask = attention_inputs(layout, head_len=1, start=p)
    expected = [[c == "1" for c in line.split()[1:]] for line in SPEC_EXAMPLE_MASK.strip().split("\n")[1:]]
    assert mask.tolist() == expected
    assert (positions - p).tolist() == [0, 1, 2, 1, 1, 3, 2, 2, 4, 3, 1, 2]


def reference_paths(columns, candidates) -> list[tuple]:
    """Brute force from the description: every token is a path from the root (a column's chain prefix, or a
    candidate prefix, each distinct candidate prefix once); it sees the head and the tokens whose path is a
    prefix of its own, within its own section."""
    paths = [("col", j, tuple(c.tokens[: k + 1])) for j, c in enumerate(columns) for k in range(len(c.tokens))]
    return paths + sorted({("cand", 0, tuple(g[: i + 1])) for g in candidates for i in range(len(g))})


def test_layout_matches_brute_force_reference():
    rng = random.Random(3)
    for _ in range(30):
        head_len, start = rng.randint(1, 4), rng.randint(0, 20)
        levels = rng.randint(0, 4)
        columns = [
            Column([rng.randint(0, 5) for _ in range(s + levels)], s)
            for s in [0] + [rng.randint(1, 2) for _ in range(rng.randint(0, 4))]
        ]
        candidates = [tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 6))]
        layout = layout_step(columns, candidates)
        positions, mask = attention_inputs(layout, head_len, start)
        paths = reference_paths(columns, candidates)
        # Map each layout node to its reference path by walking parents.
        node_path = []
        for node in range(len(layout)):
            chain, n = [], node
            while n >= 0:
                chain.append(layout.tokens[n])
                n = layout.parents[n]
            section = (
                ("col", next(j for j, nodes in enumerate(layout.column_nodes) if node in nodes))
                if node < layout.num_grid
                else ("cand", 0)
            )
            node_path.append((*section, tuple(reversed(chain))))
        assert sorted(node_path) == sorted(paths)  # every token once; candidates share prefixes
        total = head_len + len(layout)
        ref = np.zeros((total, total), dtype=bool)
        ref[:head_len, :head_len] = np.tri(head_len, dtype=bool)
        ref[head_len:, :head_len] = True
        for i, (sec_i, col_i, path_i) in enumerate(node_path):
            for j, (sec_j, col_j, path_j) in enumerate(node_path):
                ref[head_len + i, head_len + j] = (sec_i, col_i) == (sec_j, col_j) and path_i[: len(path_j)] == path_j
        assert mask.numpy().tolist() == ref.tolist()
        root = start + head_len - 1
        assert positions.tolist() == list(range(start, start + head_len)) + [root + len(p[2]) for p in node_path]


@pytest.mark.parametrize("head_len", [1, 4])
def test_packed_forward_logits_equal_separate_forwards(model, head_len):
    """Every grid and candidate token's logits in the packed forward equal those of a plain causal forward on
    context + root + that token's chain."""
    context = [9, 31, 4, 77, 12, 60]
    columns = [Column([5, 6, 7], 0), Column([11, 12, 13, 14], 1), Column([21, 22, 23, 24, 25], 2)]
    layout = layout_step(columns, [(5, 6, 40, 41), (5, 6, 42), (50,), (51, 52, 53, 54)])
    packed = runner(model, 64)
    cached = context[:-head_len]
    if cached:
        packed.forward(torch.tensor([cached]))
    head = context[-head_len:]
    positions, mask = attention_inputs(layout, head_len, packed.length())
    logits = packed.forward(
        torch.tensor([head + layout.tokens]), positions=positions[None], attention_mask=mask
    ).logits[0]
    plain = runner(model, 64)
    for node in range(len(layout)):
        chain, n = [], node
        while n >= 0:
            chain.append(layout.tokens[n])
            n = layout.parents[n]
        plain.reset()
        expected = plain.forward(torch.tensor([context + chain[::-1]])).logits[0, -1]
        torch.testing.assert_close(logits[head_len + node], expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- the grid


def test_grid_warm_up_then_steady_state():
    branch_len, branch_num = 6, 3
    prompt = list(range(100, 120))
    grid = BranchGrid.initial(prompt, branch_len, branch_num, 2, random.Random(10))
    assert len(grid.columns) == branch_num + branch_len - 3
    assert [c.pad_len for c in grid.columns[: branch_len - 2]] == [1] * (branch_len - 2)
    assert all(t in prompt for c in grid.columns for t in c.tokens)
    forwards = 1  # the prefill
    while not grid.full:
        grid.advance([1000 + forwards] * len(grid.columns))
        forwards += 1
    assert forwards - 1 == branch_len - 2  # one transition after the prefill and after each warm-up forward
    assert len(grid.columns) == branch_num and grid.columns[0].pad_len == 0
    assert all(1 <= c.pad_len <= 2 and c.levels == branch_len - 2 for c in grid.columns[1:])
    lengths = [len(c.tokens) for c in grid.columns]
    before = [list(c.tokens) for c in grid.columns]
    grid.advance([7, 8, 9])  # steady: drop the oldest, append the new argmax
    assert [c.tokens for c in grid.columns] == [b[1:] + [p] for b, p in zip(before, [7, 8, 9])]
    assert [len(c.tokens) for c in grid.columns] == lengths


# ----------------------------------------------------------------------------------------------- caches


def test_context_cache_lru():
    cache = ContextCache(per_key=10)
    for i in range(10):
        cache.insert(1, (i, i))
    cache.insert(1, (0, 0))  # reinsertion moves to the most recent end
    assert cache.retrieve(1)[0] == (1, 1) and cache.retrieve(1)[-1] == (0, 0)
    cache.insert(1, [99, 99])  # full: evict the least recent, (1, 1)
    grams = cache.retrieve(1)
    assert len(grams) == 10 and (1, 1) not in grams and grams[-1] == (99, 99) and grams[0] == (2, 2)
    cache.insert(2, (5,))
    cache.trim(2)
    assert cache.retrieve(1) == [(0, 0), (99, 99)] and cache.retrieve(2) == [(5,)] and cache.retrieve(3) == []
    assert len(cache) == 3


def test_retrieval_priority_and_dedup(model):
    tables = {
        1: {(4,): [((1, 2, 3, 4), 50), ((9, 9, 9, 9), 40), ((8, 8, 8, 8), 30)]},
        2: {(3, 4): [((7, 7, 7, 7), 10), ((1, 2, 3, 4), 9)]},
        4: {(1, 2, 3, 4): [((6, 6, 6, 6), 8)]},
    }
    corpus = CorpusCache(tables)
    assert corpus.lookup([1, 2, 3, 4], limit=3) == [(6, 6, 6, 6), (7, 7, 7, 7), (1, 2, 3, 4)]  # longest key first
    assert corpus.lookup([5, 3, 4], limit=3, exclude=[(7, 7, 7, 7)]) == [(1, 2, 3, 4), (9, 9, 9, 9), (8, 8, 8, 8)]
    assert corpus.lookup([4], limit=5) == [(1, 2, 3, 4), (9, 9, 9, 9), (8, 8, 8, 8)]

    algorithm = self_draft(model, corpus=corpus)
    text = [0, 1, 2, 3, 4]
    algorithm.context.insert(4, (1, 2, 3, 4))
    algorithm.context.insert(4, (5, 5, 5, 5))
    # 2 context grams (LRU first), then min(3, 10 - 2) = 3 corpus grams not already chosen
    assert algorithm._candidates(text) == [(1, 2, 3, 4), (5, 5, 5, 5), (6, 6, 6, 6), (7, 7, 7, 7), (9, 9, 9, 9)]
    for i in range(10):
        algorithm.context.insert(4, (i, 0, 0, 0))
    assert algorithm._candidates(text)[10:] == [(6, 6, 6, 6), (7, 7, 7, 7)]  # context full: 2 corpus slots


def test_context_cache_update_rule(model):
    """§7 on a hand-made step: padded columns give G-1 chain tokens + the argmax after them; the root-attached
    column also gives the gram after the root; the text is indexed, padded with column 0, plus the fresh gram."""
    algorithm = self_draft(model, branch_len=5, branch_num=2, gram_len=3, context_cache=True)
    columns = [Column([50, 51, 52], 0), Column([60, 61, 62, 63], 1)]
    grid = BranchGrid(columns, 5)
    layout = layout_step(columns, [])
    node_tokens = layout.tokens
    preds = [70] + [t + 100 for t in node_tokens]  # root argmax 70, argmax after token t = t + 100
    text = [1, 2, 3, 4, 5]
    indexed = algorithm._update_context(text, 2, grid, layout, preds)
    assert indexed == 5
    get = algorithm.context.retrieve
    assert get(60) == [(61, 62, 162)] and get(61) == [(62, 63, 163)] and get(62) == []
    assert get(5) == [(50, 51, 151), (50, 51, 52)]  # column 0 after the root; then the root's text gram
    assert get(50) == [(51, 52, 152)]
    assert get(3) == [(4, 5, 50), (4, 5, 70)]  # text position 2 padded with column 0; then the fresh gram
    assert get(4) == [(5, 50, 51)]
    assert get(1) == [] and get(2) == []  # before the marker


def test_context_cache_persists_and_flushes(model):
    algorithm = self_draft(model, branch_len=4, branch_num=2, flush_interval=2, keep_num=2)
    algorithm.generate(PROMPTS[0], max_new_tokens=30, sampling=GREEDY)
    assert max(len(algorithm.context.retrieve(k)) for k in range(97)) > 2  # kept after the first prompt
    size = len(algorithm.context)
    algorithm.generate(PROMPTS[1], max_new_tokens=30, sampling=GREEDY)
    assert max(len(algorithm.context.retrieve(k)) for k in range(97)) == 2 and len(algorithm.context) < size


# ----------------------------------------------------------------------------------------------- corpus


def test_count_ngrams_thresholds_top_k_and_documents():
    doc = [1, 2, 3, 4, 5, 6] * 7  # every window occurs 6 or 7 times
    tables = count_ngrams([doc, [1, 2, 3]], min_count=7)
    assert tables[1][(1,)] == [((2, 3, 4, 5), 7)]
    assert (5,) not in tables[1]  # 5 is followed by (6,1,2,3) only 6 times: dropped
    assert tables[4] == {}  # with a 4-token key the window is 8 long: only 6 occurrences fit
    many = [[0, i, i, i, i] for i in range(1, 30) for _ in range(3)]
    top = count_ngrams(many, key_lens=(1,), min_count=3, max_per_key=20)[1][(0,)]
    assert len(top) == 20 and top[0] == ((1, 1, 1, 1), 3)  # capped at 20; ties by gram
    # no window crosses a document boundary
    assert count_ngrams([[7, 8], [9, 10, 11]], key_lens=(1,), gram_len=3, min_count=1)[1] == {}


def test_corpus_file_round_trip_and_refusals(tmp_path):
    corpus = CorpusCache({1: {(3,): [((4, 5, 6, 7), 9)]}}, {"tokenizer_fingerprint": "abc", "vocab_size": 97})
    path = tmp_path / "corpus.json"
    corpus.save(path)
    loaded = CorpusCache.load(path, tokenizer_fingerprint="abc")
    assert loaded.tables == corpus.tables and loaded.meta["vocab_size"] == 97
    with pytest.raises(ValueError, match=r"^n-gram corpus '.*' was built for another tokenizer \(fingerprint abc"):
        CorpusCache.load(path, tokenizer_fingerprint="xyz")
    payload = json.loads(path.read_text())
    path.write_text(json.dumps(payload | {"version": 99}))
    with pytest.raises(ValueError, match="has version 99"):
        CorpusCache.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        CorpusCache.load(tmp_path / "missing.json")


def test_bad_options_are_one_line_errors(model):
    with pytest.raises(ValueError, match=r"^branch_len \(L\) must be >= 3, got 2$"):
        self_draft(model, branch_len=2)
    with pytest.raises(ValueError, match=r"^gram_len \(G\) must be >= 2"):
        self_draft(model, gram_len=1)
    with pytest.raises(ValueError, match=r"^grid_vocab must be >= 0 \(0 = the full vocabulary\), got -1$"):
        self_draft(model, grid_vocab=-1)
    assert self_draft(model, grid_vocab=97).grid_vocab is None  # not smaller than the vocabulary: full
    big = CorpusCache({1: {(3,): [((4, 5, 6, 500), 9)]}})
    with pytest.raises(ValueError, match="token id 500 >= the target's vocab_size 97"):
        self_draft(model, corpus=big)


def test_options_from_the_evaluate_cli(model):
    from omegaconf import OmegaConf

    from inference.algorithms.options import SelfDraftOptions
    from inference.evaluate import parse_args

    cfg = parse_args(
        [
            "algorithms=[ar,self_draft]",
            "self_draft.branch_len=4",
            "self_draft.branch_num=2",
            "self_draft.ctx_candidates=3",
            "self_draft.compat_original_cap=true",
        ]
    )
    options = OmegaConf.to_object(cfg.self_draft)
    assert options == SelfDraftOptions(branch_len=4, branch_num=2, ctx_candidates=3, compat_original_cap=True)
    algorithm = SelfDraft(runner(model), options)
    assert algorithm.gram_len == 3 and not algorithm.verify_branches  # G capped at L - 1; compat: candidates only


def test_grid_vocab_argmax_is_the_argmax_over_its_tokens():
    """Ids below K plus the text's tokens, whichever side wins; the same answer as masking the full logits."""
    torch.manual_seed(0)
    weight, hidden = torch.randn(97, 16), torch.randn(5, 16)
    vocab = GridVocab(20)
    vocab.reset([3, 50, 50, 70])
    vocab.add([90, 5])
    allowed = torch.zeros(97, dtype=torch.bool)
    allowed[:20] = True
    allowed[[50, 70, 90]] = True
    full = hidden @ weight.T
    expected = full.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    assert vocab.argmax(hidden, weight) == expected
    assert any(token >= 20 for token in expected)  # the extra tokens really compete
    vocab.reset([1])
    assert vocab.argmax(hidden, weight) == full[:, :20].argmax(-1).tolist()


# ----------------------------------------------------------------------------------------------- sampling


def test_sampling_follows_the_target_law():
    """Monte Carlo on a 4-token vocabulary: the law of the first 3 tokens of a request among 64 side by side equals
    the target's (chi-square and TV, fixed seed). The context cache carries over from one batch to the next, so
    candidates and branches get accepted."""
    vocab, n, runs = 4, 3, 2000
    target = tiny_llama(10, vocab=vocab, layers=2, temperature_scale=3.0)
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    algorithm = build_algorithm("self_draft", runner(target, 96, rows=2 * LAW_ROWS), branch_len=4, branch_num=2)
    counts, accepted = sampled_law(algorithm, prompt, n, runs)
    assert accepted > runs // 2  # drafts were really accepted, not just AR in disguise
    # TV of 2,000 draws of this law over its 64 outcomes exceeds 0.094 once in 10^4 (its median is 0.067)
    assert_follows_law(counts, law, runs, max_tv=0.094)


# ----------------------------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_real_smollm2_greedy_equals_ar(smollm2):
    from core.prompts import load_prompts, prompt_turns, render_prompt
    from inference.runner import ModelRunner

    hf_model, tokenizer = smollm2
    target = ModelRunner.from_hf_model(hf_model, max_seq_len=512)
    ar = build_algorithm("ar", target)
    algorithm = build_algorithm("self_draft", target, branch_len=5, branch_num=3)
    prompt = render_prompt(tokenizer, prompt_turns(load_prompts("humaneval", n=1)[0]))
    expected = ar.generate(prompt, max_new_tokens=32, sampling=GREEDY).tokens
    result = algorithm.generate(prompt, max_new_tokens=32, sampling=GREEDY)
    assert result.tokens == expected
    assert result.stats.accepted_draft_tokens > 0 and result.stats.tau > 1
