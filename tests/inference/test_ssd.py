"""SSD / SAGUARO (docs/algorithms/ssd.md §11): sampler, verifier proposal, fan-out, cache, fork, tree mask, protocol, greedy
equivalence (batch 1 and 3), exact sampling law with both fallbacks, the reference's lossy fast check failing,
identical tokens from every executor, and forks from the full vocabulary of a vocabulary-limited drafter."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random

import pytest
import torch
from law_helpers import assert_follows_law
from tiny_targets import hf_greedy, runner, tiny_llama
from ssd_helpers import tiny_draft_runner

from benchmarks import ssd_recall

from inference.algorithms import build_algorithm
from inference.runner import ModelRunner
from inference.runner_contract import RunnerOutput
from inference.runner_loading import with_logit_vocab
from inference.saguaro import NEURAL, POINT, UNIFORM, proposal_probs, saguaro_probs, saguaro_sample
from inference.sampling import SamplingParams
from inference.ssd_cache import NO_KEY, SpecCache, fanout_weights, geometric_fanout, largest_remainder_round
from inference.ssd_draft import (
    HIT,
    JIT,
    ServeRequest,
    SpeculateRequest,
    Speculation,
    SSDDraftSide,
    full_head_logits,
    tree_step_mask,
)
from inference.verify import tokenwise_plan

GREEDY = SamplingParams(temperature=0)
T1 = SamplingParams(temperature=1.0)


# -- 1-3: SAGUARO sampling and the proposal the verifier uses ---------------------------------------------------


def test_saguaro_scales_the_top_set_and_sampling_follows_it():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    q = logits.softmax(-1)
    qp = saguaro_probs(q.double(), logits, 2, 0.3)
    expected = q.double().clone()
    expected[:2] *= 0.3
    assert torch.allclose(qp, expected / expected.sum(), atol=1e-12)
    draws = saguaro_sample(logits.expand(20000, 5), 2, 0.3, T1, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / 20000
    assert 0.5 * (freq - qp).abs().sum() < 0.015
    assert int(saguaro_sample(logits, 2, 0.3, GREEDY, None)) == 0  # greedy: argmax, no scaling effect


def _random_case(gen: torch.Generator, vocab: int = 6):
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    logits = torch.randn(vocab, generator=gen) * 2
    top = int(torch.randint(0, vocab, (1,), generator=gen))
    c = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
    return p / p.sum(), logits, top, c


def test_verify_uses_q_prime_and_one_step_is_exact():
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for _ in range(300):
        p, logits, top, c = _random_case(gen)
        x = int(torch.randint(0, 6, (1,), generator=gen))
        qp = proposal_probs(torch.tensor([x]), logits[None], torch.tensor([NEURAL]), torch.tensor([top]), c, T1)[0]
        plan = tokenwise_plan(torch.tensor([x]), qp[None], torch.stack([p, p]))
        assert abs(1 - float(plan.stop_probs[0]) - min(1.0, float(p[x] / qp[x]))) < 1e-12
        residual = (p - qp).clamp_min(0)
        if residual.sum() > 0:
            assert torch.allclose(plan.residuals[0], residual / residual.sum(), atol=1e-12)
        # P(emit t) = Σ_x q'(x) [P(reject x, residual t) + P(accept x) 1{t = x}]: must equal p
        emitted = torch.zeros_like(p)
        for token in range(6):
            law = tokenwise_plan(torch.tensor([token]), qp[None], torch.stack([p, p])).outcome_law()
            emitted += qp[token] * law[0]
            emitted[token] += qp[token] * law[1].sum()
        worst = max(worst, float((emitted - p).abs().max()))
    assert worst < 1e-12


def test_fast_fallback_proposals_are_point_masses_and_uniform():
    tokens = torch.tensor([[3, 1]])
    q = proposal_probs(tokens, torch.zeros(1, 2, 5), torch.tensor([[POINT, UNIFORM]]), torch.zeros(1, 2), 0.5, T1)
    assert q[0, 0].tolist() == [0, 0, 0, 1, 0] and torch.allclose(q[0, 1], torch.full((5,), 0.2, dtype=q.dtype))


# -- 6: fan-out ------------------------------------------------------------------------------------------------


def test_geometric_fanout_closed_form_rounding_and_optimality():
    a, k, r, budget = 0.7, 4, 1.0, 20
    w = fanout_weights(k, a, r)
    x = [budget * v / sum(w) for v in w]
    assert [round(v, 2) for v in x] == [4.98, 4.17, 3.49, 2.92, 4.45]  # spec Part 3
    assert all(x[i] >= x[i + 1] for i in range(k - 1))
    assert math.isclose(x[k] / x[k - 1], (a / (1 - a)) ** (1 / (1 + r)))
    fan = geometric_fanout(budget, k, a, r)
    assert sum(fan) == budget and fan == largest_remainder_round(x, budget)
    capped = geometric_fanout(budget, k, a, r, f_max=4)
    assert sum(capped) == budget and max(capped) <= 4
    assert geometric_fanout(6, 3, 0.01, r)[0] >= 1 and sum(geometric_fanout(6, 3, 0.01, r)) == 6

    def objective(f):  # P(hit) with c = 1
        pi = [a**i * (1 - a) for i in range(k)] + [a**k]
        return sum(p * (1 - fi**-r) for p, fi in zip(pi, f))

    rng = random.Random(0)
    for _ in range(2000):
        d = [rng.gauss(0, 0.3) for _ in x]
        mean = sum(d) / len(d)
        y = [xi + di - mean for xi, di in zip(x, d)]
        if min(y) > 0:
            assert objective(y) <= objective(x) + 1e-12
    with pytest.raises(ValueError, match="cannot be split"):
        geometric_fanout(20, 4, 0.7, f_max=3)


# -- 5: cache keying -------------------------------------------------------------------------------------------


def test_cache_hits_exactly_on_matching_keys():
    cache = SpecCache()
    first = cache.lookup(torch.tensor([[NO_KEY, 5], [0, 5]]))[0]
    assert not first.any()  # empty cache: the first round always misses
    keys = torch.tensor([[[0, 4], [0, 7], [1, 2]], [[0, 9], [2, 3], [NO_KEY, 0]]])
    cache.populate(keys, torch.arange(2 * 3 * 2).view(2, 3, 2), torch.zeros(2, 3, 2, 4), torch.ones(2, 3, 2))
    hit, index = cache.lookup(torch.tensor([[0, 7], [NO_KEY, 0]]))
    assert hit.tolist() == [True, False] and int(index[0]) == 1
    hit, index = cache.lookup(torch.tensor([[1, 7], [2, 3]]))  # wrong k / right key of another row
    assert hit.tolist() == [False, True] and int(index[1]) == 1
    assert cache.fetch(index)[0].shape == (2, 2)
    cache.clear()
    assert not cache.lookup(torch.tensor([[0, 7], [2, 3]]))[0].any()


# -- 11: tree-decode mask --------------------------------------------------------------------------------------


def test_tree_step_mask_matches_brute_force_ancestors():
    k_max, base = 3, torch.tensor([5, 2])
    fork_len = torch.tensor([[0, 0, 1, 3], [2, 3, 3, NO_KEY]])
    width = fork_len.shape[1]
    for step in range(1, k_max + 1):
        lengths = base + k_max + 1 + (step - 1) * width
        cached = int(lengths.max())
        mask = tree_step_mask(base, cached, fork_len, k_max, step)
        for row in range(2):
            for u in range(width):
                j = int(fork_len[row, u])
                allowed = set(range(int(base[row]) + j + 1))  # prefix + glue 0..j
                allowed |= {int(base[row]) + k_max + 1 + (s - 1) * width + u for s in range(1, step)}
                allowed |= {cached + u}
                got = {
                    c for c in range(cached + width) if mask[row, u, c] and (c < int(lengths[row]) or c >= cached)
                }  # columns past a row's length are padding
                assert got == allowed, (step, row, u)


# -- 10: protocol ----------------------------------------------------------------------------------------------


def test_payloads_round_trip_bit_exactly():
    req = ServeRequest(
        torch.tensor([[2, 17], [NO_KEY, 3]]),
        torch.tensor([40, 12]),
        torch.tensor([True, False]),
        torch.tensor([[3, 2, 2], [1, 1, 1]]),
        0.7,
        5,
        0.95,
        0.4,
        1,
        0,
    )
    back = ServeRequest.unpack(req.pack())
    assert back.temperature == 0.7 and back.top_p == 0.95 and back.c == 0.4 and back.top_k == 5
    assert torch.equal(back.keys, req.keys) and torch.equal(back.lengths, req.lengths)
    assert torch.equal(back.active, req.active) and torch.equal(back.jit_tops, req.jit_tops)
    sreq = SpeculateRequest(torch.tensor([[2, 1, 1, 0]]), torch.tensor([[3, 2, 2]]), 1e-3, 0, 1.0, 1.0)
    sback = SpeculateRequest.unpack(sreq.pack())
    assert torch.equal(sback.fanout, sreq.fanout) and sback.temperature == 1e-3
    spec = Speculation(
        torch.tensor([HIT, JIT]),
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor([[0, 0], [1, 2]]),
        torch.tensor([[3, 3], [0, 0]]),
        7,
        torch.randn(2, 2, 9),
    )
    sp = Speculation.unpack(*spec.pack())
    assert sp.draft_forwards == 7 and torch.equal(sp.kinds, spec.kinds) and torch.equal(sp.tops, spec.tops)


# -- 4: fork sets ------------------------------------------------------------------------------------------------


def test_fork_excludes_the_drafted_token_and_follows_each_rows_fanout():
    side = SSDDraftSide(functools.partial(tiny_draft_runner, 1, 16, 2), lookahead=2, budget=4)
    side.spec = torch.tensor([[0, 1], [5, 6]])
    glue = torch.arange(16.0).flip(0).expand(2, 3, 16).clone()  # token 0 best, then 1, 2, ...
    fanout = torch.tensor([[2, 1, 1], [0, 0, 4]])  # a hit row's vector and a fast-miss row's vector
    fork_len, fork_tok = side._fork(glue, fanout)
    assert fork_len[0].tolist() == [0, 0, 1, 2] and fork_tok[0].tolist() == [1, 2, 0, 0]  # s_1=0, s_2=1 excluded
    assert fork_len[1].tolist() == [2, 2, 2, 2] and fork_tok[1].tolist() == [0, 1, 2, 3]  # j = K: nothing excluded


def test_speculate_forks_with_the_miss_vector_after_a_miss():
    target = tiny_llama(0, vocab=128, layers=2, temperature_scale=8.0)
    ssd = build_algorithm(
        "ssd",
        ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3),
        tiny_draft_runner(1),
        gamma=3,
        budget=6,
        fanout="3:1:1:1",
        fanout_miss="6:0:0:0",
        fallback="fast",
        fast="random",
    )
    ssd.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=2, sampling=GREEDY)  # one round: every row missed
    keys = ssd.executor().draft_side.cache.keys
    assert (keys[:, :, 0] == 0).all()  # all 6 branches at k = 0 (the miss vector)


# -- 7: greedy equivalence -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_reference():
    target = tiny_llama(0, vocab=128, layers=2, temperature_scale=8.0)
    prompts = [[7, 1, 8, 2, 8], [3, 4], [9, 9, 9, 1, 2, 3, 4, 5]]
    ar = build_algorithm("ar", runner(target, 256))
    return target, prompts, [ar.generate(p, max_new_tokens=25, sampling=GREEDY).tokens for p in prompts]


@pytest.mark.parametrize("fallback,fast", [("jit", "ngram"), ("fast", "ngram"), ("fast", "random"), ("auto", "ngram")])
def test_greedy_output_equals_the_target_batch_1_and_3(greedy_reference, fallback, fast):
    target, prompts, expected = greedy_reference
    # The drafter is the target itself for half of it: forks then really hit; a 1-layer drafter misses often.
    for draft in (tiny_draft_runner(1), ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3)):
        ssd = build_algorithm(
            "ssd",
            ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3),
            draft,
            gamma=3,
            budget=6,
            fallback=fallback,
            fast=fast,
            saguaro_c=0.5,
        )
        assert [r.tokens for r in ssd.generate_batch(prompts, max_new_tokens=25, sampling=GREEDY)] == expected
        assert ssd.generate(prompts[1], max_new_tokens=25, sampling=GREEDY).tokens == expected[1]
        metrics = ssd.extra_metrics()
        assert metrics["first_round_misses"] == 4 and sum(metrics["fallback_counts"].values()) >= 4
    assert metrics["cache_hit_rate"] > 0.9  # the target as drafter: every bonus is the cached top guess


# -- 8, 9: exact sampling law (bigram tables), and the reference's lossy fast check failing ------------------------


class BigramRunner:
    """A table-driven LM with the runner interface: the logits after a token depend on that token only."""

    def __init__(self, table: torch.Tensor, max_batch_size: int, max_seq_len: int = 64):
        self.table = table.log()
        self.config = type("Config", (), {"vocab_size": table.shape[0]})()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.device = torch.device("cpu")
        self.cache_lens = torch.zeros(1, dtype=torch.long)

    def reset(self, batch_size: int) -> None:
        self.cache_lens = torch.zeros(batch_size, dtype=torch.long)

    def truncate(self, n) -> None:
        self.cache_lens = torch.as_tensor(n, dtype=torch.long).expand(self.cache_lens.shape[0]).clone()

    def forward(self, input_ids, *, positions=None, attention_mask=None, only_last_logits=False, **_) -> RunnerOutput:
        self.cache_lens = self.cache_lens + input_ids.shape[1]
        logits = self.table[input_ids]
        return RunnerOutput(logits=logits[:, -1:] if only_last_logits else logits)


def bigram_tables(vocab: int = 5, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p(.|prev) and a draft q = 0.6 p + 0.4 noise (the spec's ssd_sim.py construction)."""
    torch.manual_seed(seed)
    target = torch.distributions.Dirichlet(torch.full((vocab,), 0.6)).sample((vocab,))
    noise = torch.distributions.Dirichlet(torch.ones(vocab)).sample((vocab,))
    return target.double(), (0.6 * target + 0.4 * noise).double()


def bigram_law(table: torch.Tensor, last: int, n: int) -> dict[tuple[int, ...], float]:
    law = {}
    for seq in itertools.product(range(table.shape[0]), repeat=n):
        p, prev = 1.0, last
        for t in seq:
            p, prev = p * float(table[prev, t]), t
        law[seq] = p
    return law


BIGRAM_PROMPT = [1, 2, 0, 3, 4, 0]  # every token but 4 is followed by a 2-gram: the n-gram fallback finds one


def bigram_samples(fallback: str, fast: str, runs: int, n: int, fast_verify: str = "exact", batch: int = 500):
    p_table, q_table = bigram_tables()
    target, draft = BigramRunner(p_table, batch), BigramRunner(q_table, batch)
    ssd = build_algorithm(
        "ssd",
        target,
        draft,
        gamma=2,
        budget=6,
        fanout="2:2:2",
        fanout_miss="2:2:2",
        fallback=fallback,
        fast=fast,
        saguaro_c=0.4,
        fast_verify=fast_verify,
        seed=3,
    )
    generator = torch.Generator().manual_seed(11)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs // batch):
        for result in ssd.generate_batch([BIGRAM_PROMPT] * batch, max_new_tokens=n, sampling=T1, generator=generator):
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
    return counts, bigram_law(p_table, BIGRAM_PROMPT[-1], n), ssd.extra_metrics()


@pytest.mark.parametrize("fallback,fast", [("jit", "ngram"), ("fast", "random"), ("fast", "ngram")])
def test_sampling_follows_the_target_law_with_each_fallback(fallback, fast):
    runs = 6000
    counts, law, metrics = bigram_samples(fallback, fast, runs, n=3)
    assert_follows_law(counts, law, runs, max_tv=0.06)
    assert metrics["cache_hit_rate"] > 0.3  # the cache really served speculations


def test_reference_greedy_check_of_fast_tokens_is_biased():
    """The first round always misses, so the fast tokens decide the first two tokens: their law must be off."""
    runs = 6000
    with pytest.warns(UserWarning, match="lossy"):
        counts, law, _ = bigram_samples("fast", "random", runs, n=2, fast_verify="reference_greedy")
    with pytest.raises(AssertionError):
        assert_follows_law(counts, law, runs, max_tv=0.06)


# -- fork vocabulary: a vocabulary-limited drafter forks on its whole head ----------------------------------------


class LimitedBigramRunner(BigramRunner):
    """A BigramRunner limited like ``with_logit_vocab``: its logits score only ids < ``logit_vocab`` (the rest
    -inf). Its final hidden state is the one-hot last token and its lm_head the whole log table, so
    ``full_head_logits`` gives the unlimited row."""

    def __init__(self, table: torch.Tensor, max_batch_size: int, logit_vocab: int):
        super().__init__(table, max_batch_size)
        self.logit_vocab = logit_vocab
        self.lm_head = lambda hidden: hidden.to(self.table.dtype) @ self.table

    def forward(self, input_ids, *, return_last_hidden=False, only_last_logits=False, **kw) -> RunnerOutput:
        logits = super().forward(input_ids, only_last_logits=only_last_logits, **kw).logits.clone()
        logits[..., self.logit_vocab :] = float("-inf")
        hidden = torch.nn.functional.one_hot(input_ids, self.table.shape[0]).double() if return_last_hidden else None
        return RunnerOutput(logits=logits, last_hidden=hidden)


def test_full_head_logits_score_every_id_of_a_limited_runner():
    base = tiny_draft_runner(1, 128, 1)
    limited = with_logit_vocab(base, 64)
    ids = torch.tensor([[5, 9, 77, 3]])
    limited.reset(1)
    out = limited.forward(ids, return_last_hidden=True)
    assert torch.isinf(out.logits[..., 64:]).all()
    base.reset(1)
    full = base.forward(ids).logits
    assert torch.allclose(full_head_logits(limited, out.last_hidden), full, atol=1e-5)


@pytest.fixture(scope="module")
def limited_greedy():
    """A tiny target whose greedy answers use ids >= 64 often, its AR tokens, and a drafter = the target limited
    to ids < 64: every bonus the drafter cannot propose is its full head's top guess."""
    target = tiny_llama(0, vocab=128, layers=2, temperature_scale=8.0)
    prompts = [[7, 1, 8, 2, 8], [3, 4], [9, 9, 9, 1, 2, 3, 4, 5]]
    ar = build_algorithm("ar", runner(target, 256))
    return target, prompts, [ar.generate(p, max_new_tokens=25, sampling=GREEDY).tokens for p in prompts]


@pytest.mark.parametrize("fanout", ["2:2:1:1", "uniform"])
def test_a_bonus_outside_the_draft_vocab_hits_only_with_full_vocab_forks(limited_greedy, fanout):
    target, prompts, expected = limited_greedy
    assert sum(t >= 64 for out in expected for t in out) >= 10  # the case under test really occurs
    metrics = {}
    for fork_vocab in ("full", "draft"):
        draft = with_logit_vocab(ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3), 64)
        ssd = build_algorithm(
            "ssd",
            ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3),
            draft,
            gamma=3,
            budget=6,
            fanout=fanout,
            fork_vocab=fork_vocab,
        )
        assert [r.tokens for r in ssd.generate_batch(prompts, max_new_tokens=25, sampling=GREEDY)] == expected
        metrics[fork_vocab] = ssd.extra_metrics()
        assert metrics[fork_vocab]["fork_vocab"] == fork_vocab and metrics[fork_vocab]["draft_vocab"] == 64
    full, capped = metrics["full"], metrics["draft"]
    assert full["cache_lookups_outside_draft_vocab"] > 0 and capped["cache_lookups_outside_draft_vocab"] > 0
    # capped forks: such a bonus can never be a key; full-head forks: it is the drafter's (= target's) top guess
    assert capped["cache_hits_outside_draft_vocab"] == 0
    assert full["cache_hits_outside_draft_vocab"] == full["cache_lookups_outside_draft_vocab"]
    assert full["cache_hit_rate"] == 1.0 > capped["cache_hit_rate"]
    if fanout == "uniform":
        assert full["fanout_hit"] == [2, 2, 1, 1]  # 6 over K+1 = 4 lengths, the remainder to the shortest
    # every lookup is counted under the fan-out its cache was built with
    for k, (lookups, fans) in enumerate(zip(full["cache_lookups_by_k"], full["cache_lookup_fanout_by_k"])):
        assert sum(fans.values()) == lookups and (not fans or set(fans) == {[2, 2, 1, 1][k]})


@pytest.mark.parametrize("fork_vocab", ["full", "draft"])
def test_sampling_law_is_exact_with_a_limited_drafter_and_either_fork_vocab(fork_vocab):
    """A drafter limited to ids < 3 of 5 (q = 0 on ids 3, 4): the output still follows the target's law, and with
    full-vocabulary forks a bonus 3 or 4 is served from the cache."""
    runs, batch = 6000, 500
    p_table, q_table = bigram_tables()
    target, draft = BigramRunner(p_table, batch), LimitedBigramRunner(q_table, batch, logit_vocab=3)
    ssd = build_algorithm(
        "ssd",
        target,
        draft,
        gamma=2,
        budget=6,
        fanout="2:2:2",
        fallback="jit",
        saguaro_c=0.4,
        seed=3,
        fork_vocab=fork_vocab,
    )
    generator = torch.Generator().manual_seed(11)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs // batch):
        for result in ssd.generate_batch([BIGRAM_PROMPT] * batch, max_new_tokens=3, sampling=T1, generator=generator):
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
    assert_follows_law(counts, bigram_law(p_table, BIGRAM_PROMPT[-1], 3), runs, max_tv=0.06)
    metrics = ssd.extra_metrics()
    assert metrics["cache_lookups_outside_draft_vocab"] > 0
    if fork_vocab == "full":
        assert metrics["cache_hits_outside_draft_vocab"] > 0
    else:
        assert metrics["cache_hits_outside_draft_vocab"] == 0


# -- benchmarks/ssd_recall.py: the engine's hit rate against the teacher-forced recall ----------------------------


def test_replayed_rounds_follow_greedy_acceptance():
    replay = ssd_recall.replay_lookups
    # position 0: the prefill's token; rounds accept the leading matches (at most K = 2), then look up the next
    match = [True, True, False, True, True, True, False, False, True]
    # b=0: accepts 1, bonus 2 → (1, 2); b=2: accepts 3, 4 (K) → bonus 5 → (2, 5); b=5: 6 misses → (0, 6);
    # b=6: 7 misses → (0, 7); b=7: 8 matches, the answer is complete (no lookup)
    assert replay(match, 2) == [(1, 2), (2, 5), (0, 6), (0, 7)]
    assert replay([True], 3) == [] and replay([True, False], 3) == []


def test_rank_excludes_the_drafted_token_and_limits_the_vocab():
    recall = ssd_recall
    scores = torch.tensor([[5.0, 4.0, 3.0, 9.0, 1.0]])  # full order 3, 0, 1, 2, 4; capped to ids < 3: 0, 1, 2
    ranks = recall.position_ranks(scores, [1], draft_vocab=3)
    assert int(ranks["a"][0]) == 0  # the capped argmax
    assert int(ranks["excl_full"][0]) == 1 and int(ranks["excl_draft"][0]) == 0  # id 3 ahead only in the full head
    assert int(ranks["incl_full"][0]) == 2 and int(ranks["incl_draft"][0]) == 1
    outside = recall.position_ranks(scores, [3], draft_vocab=3)
    assert bool(outside["outside"][0]) and int(outside["excl_draft"][0]) == recall.NEVER
    assert int(outside["excl_full"][0]) == 0


@pytest.mark.parametrize("fork_vocab", ["full", "draft"])
def test_teacher_forced_replay_predicts_the_engines_hit_rate_by_k(greedy_reference, fork_vocab):
    """With a fixed fan-out, replaying SSD's greedy rounds on the answer and reading the drafter's teacher-forced
    ranks gives the engine's lookups and hit rate at every k (fp32 tiny models: no near-tie flips)."""
    recall = ssd_recall
    target, prompts, expected = greedy_reference
    draft = with_logit_vocab(tiny_draft_runner(1), 64)
    ssd = build_algorithm(
        "ssd",
        ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3),
        draft,
        gamma=3,
        budget=6,
        fanout="2:2:1:1",
        fork_vocab=fork_vocab,
    )
    assert [ssd.generate(p, max_new_tokens=25, sampling=GREEDY).tokens for p in prompts] == expected
    record = {"algorithm": f"ssd@ssd_fork_vocab={fork_vocab}", "tau": 1.0, **ssd.extra_metrics()}
    full = tiny_draft_runner(1)
    ranks = {
        64: [recall.position_ranks(recall.teacher_forced_scores(full, p, a), a, 64) for p, a in zip(prompts, expected)]
    }
    result = recall.compare(record, ranks)
    assert result["replayed_lookups_by_k"] == record["cache_lookups_by_k"]
    assert result["replayed_lookups_outside_draft_vocab"] == record["cache_lookups_outside_draft_vocab"] > 0
    for engine, replayed in zip(record["cache_hit_rate_by_k"], result["replayed_by_k"]):
        assert (engine is None and replayed != replayed) or engine == pytest.approx(replayed, abs=1e-12)
    assert result["replayed_hit_rate"] == pytest.approx(record["cache_hit_rate"], abs=1e-12)
    assert result["mean_abs_gap_per_lookup"] < 1e-12
    assert 0 <= result["all_misses_by_k"][0] <= 1
    text = recall.report(
        {
            "bench": "b",
            "n_prompts": 3,
            "answer_tokens": 75,
            "target": "t",
            "dtype": "fp32",
            "drafter": "d",
            "seconds": 0,
            "by_draft_vocab": {
                "64": {**recall.vocab_shares(ranks[64]), "recall_given_miss": recall.recall_curve(ranks[64], 2)}
            },
            "runs": [result],
        }
    )
    assert "| 3 (= K) |" in text and "rank-1 misses" in text
    shares = recall.vocab_shares(ranks[64], 4)
    outside = sum(int(r["outside"][1:].sum()) for r in ranks[64])
    assert shares["outside_positions"] == outside > 0 and len(shares["outside_full_recall_given_miss"]) == 4
    assert shares["outside_share_all"] == pytest.approx(outside / shares["positions"])
    lookups, outside_lookups = sum(record["cache_lookups_by_k"]), record["cache_lookups_outside_draft_vocab"]
    hits = round(record["cache_hit_rate"] * lookups)
    assert result["engine_hit_rate_inside_draft_vocab"] == pytest.approx(
        (hits - record["cache_hits_outside_draft_vocab"]) / (lookups - outside_lookups)
    )


def test_ssd_recall_cli_reads_an_evaluate_run(tmp_path, capsys):
    """evaluate two greedy ssd variants on tiny exports, then the recall CLI on its results.json: the replay
    matches the engine's lookups and hit rate at every k (fp32, fixed fan-out)."""
    from tiny_targets import save_tiny_target, write_jsonl

    from inference import evaluate as evaluate_cli

    target = save_tiny_target(tmp_path / "target", layers=2, logit_scale=4.0)
    draft = save_tiny_target(tmp_path / "draft", layers=2, noise=0.02, logit_scale=4.0)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", 3)
    variant = "ssd@draft_vocab=2000@gamma=3@ssd_budget=8@ssd_fanout=uniform"  # 2 guesses at every k
    cfg = evaluate_cli.parse_args(
        [
            f"target={target}",
            f"drafter={draft}",
            f"bench=[jsonl:{prompts}]",
            f"algorithms=[{variant},{variant}@ssd_fork_vocab=draft]",
            "n_prompts=2",
            "max_new_tokens=16",
            "temperature=0",
            "warmup=false",
            f"out={tmp_path / 'eval'}",
        ]
    )
    evaluate_cli.evaluate(cfg)
    out = tmp_path / "recall.json"
    code = ssd_recall.main([f"eval={tmp_path / 'eval' / 'results.json'}", f"drafter={draft}", f"out={out}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [r["fork_vocab"] for r in result["runs"]] == ["full", "draft"] and result["answer_tokens"] == 32
    for run in result["runs"]:
        assert run["greedy_equal_to_ar"] is True and run["draft_vocab"] == 2000
        assert run["replayed_lookups_by_k"] == run["engine_lookups_by_k"] and sum(run["engine_lookups_by_k"]) > 0
        assert run["mean_abs_gap_per_lookup"] < 1e-9
    assert "teacher-forced, SSD's lookups" in printed and "draft_vocab=2000" in printed


# -- executors: identical tokens ---------------------------------------------------------------------------------


def test_every_executor_gives_the_same_tokens(greedy_reference):
    """Greedy and T=1 with a fixed seed: sequential, cuda_streams and multiprocess (gloo, 1 thread) agree."""
    target, prompts, _ = greedy_reference
    outputs = {}
    for name in ("sequential", "cuda_streams", "multiprocess"):
        ssd = build_algorithm(
            "ssd",
            ModelRunner.from_hf_model(target, max_seq_len=256, max_batch_size=3),
            tiny_draft_runner(1),
            gamma=3,
            budget=6,
            fallback="jit",
            saguaro_c=0.5,
            executor=name,
            draft_source=functools.partial(tiny_draft_runner, 1),
            seed=4,
            executor_kwargs={"threads": 1} if name == "multiprocess" else {},
        )
        try:
            outputs[name] = [
                [
                    r.tokens
                    for r in ssd.generate_batch(
                        prompts, max_new_tokens=10, sampling=sampling, generator=torch.Generator().manual_seed(9)
                    )
                ]
                for sampling in (GREEDY, T1)
            ]
            metrics = ssd.extra_metrics()
            assert metrics["simulated_overlap_s"] > 0 and metrics["drafter_idle_s"] >= 0
        finally:
            ssd.close()
    assert outputs["cuda_streams"] == outputs["sequential"] == outputs["multiprocess"]


def test_bad_options_are_one_line_errors():
    target = runner(tiny_llama(0, vocab=128), 256)
    draft = tiny_draft_runner(1)
    with pytest.raises(ValueError, match="fallback must be jit, fast or auto"):
        build_algorithm("ssd", target, draft, fallback="slow")
    with pytest.raises(ValueError, match="sums to 5 but budget=8"):
        build_algorithm("ssd", target, draft, gamma=2, budget=8, fanout="2:2:1")
    with pytest.raises(ValueError, match="needs K\\+1=3"):
        build_algorithm("ssd", target, draft, gamma=2, fanout="4:4")
    with pytest.raises(ValueError, match="fork_vocab must be one of full, draft"):
        build_algorithm("ssd", target, draft, fork_vocab="capped")
    assert build_algorithm("ssd", target, draft, gamma=7, budget=24, fanout="uniform").fan_hit == [3] * 8
    with pytest.raises(ValueError, match="C must be in"):
        build_algorithm("ssd", target, draft, saguaro_c=0.0)
    with pytest.raises(ValueError, match="executor=multiprocess builds the drafter in another process"):
        build_algorithm("ssd", target, draft, executor="multiprocess")
    with pytest.raises(ValueError, match="batch of 2 prompts but the target runner holds 1"):
        build_algorithm("ssd", target, draft).generate_batch([[1], [2]], max_new_tokens=3, sampling=GREEDY)


@pytest.mark.real_model
def test_real_smollm2_ssd_batch_equals_transformers_greedy(smollm2):
    """Real logits, ragged batch of 2 MT-Bench prompts: SSD (JIT and fast) equals the target's greedy tokens. The
    drafter is SmolLM2 cut to its first 6 layers (a poor drafter: many misses and rejections)."""
    from transformers import AutoModelForCausalLM

    from core.prompts import load_prompts, prompt_turns, render_prompt

    model, tokenizer = smollm2
    config = model.config.to_dict() | {"num_hidden_layers": 6}
    draft = AutoModelForCausalLM.from_config(type(model.config)(**config)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    prompts = [render_prompt(tokenizer, prompt_turns(c)) for c in load_prompts("mt_bench", n=2)]
    expected = [hf_greedy(model, p, 8) for p in prompts]
    for fallback in ("jit", "fast"):
        ssd = build_algorithm(
            "ssd",
            ModelRunner.from_hf_model(model, max_seq_len=512, max_batch_size=2),
            ModelRunner.from_hf_model(draft, max_seq_len=512, max_batch_size=2),
            gamma=3,
            budget=6,
            fallback=fallback,
        )
        assert [r.tokens for r in ssd.generate_batch(prompts, max_new_tokens=8, sampling=GREEDY)] == expected


@pytest.mark.real_model
def test_evaluate_writes_ssd_metrics_per_run_in_batches(smollm2, tmp_path):
    """evaluate batch_size=2: ssd runs through generate_batch and its extra metrics land in its run record."""
    from inference import evaluate as evaluate_cli
    from inference.drafters import LoadedModel

    model, tokenizer = smollm2

    def loaded() -> LoadedModel:  # the target drafting for itself: every fork guess is right at T=0
        return LoadedModel(
            "smollm2", ModelRunner.from_hf_model(model, max_seq_len=512, max_batch_size=2), tokenizer, model
        )

    cfg = evaluate_cli.parse_args(
        [
            "algorithms=[ssd]",
            "drafter=smollm2",
            "n_prompts=2",
            "max_new_tokens=10",
            "gamma=2",
            "ssd_budget=4",
            "batch_size=2",
            f"out={tmp_path}",
            "warmup=false",
        ]
    )
    results = evaluate_cli.evaluate(cfg, target=loaded(), draft=loaded())
    ar, ssd = results["runs"]
    assert ssd["algorithm"] == "ssd" and ssd["greedy_equal_to_ar"] is True and ssd["new_tokens"] == 20
    assert ssd["cache_hit_rate"] > 0.5 and ssd["first_round_misses"] == 2
    assert {
        "cache_hit_rate_by_k",
        "bonus_hit_rate",
        "fallback_counts",
        "drafter_idle_s",
        "simulated_tokens_per_s",
    } <= set(ssd)
