"""AR and chain speculative decoding: greedy equality, exact sampling law, bookkeeping, one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from near_ties import near_tie_llama
from tiny_targets import GREEDY, hf_greedy, runner, tiny_llama

from inference.algorithms import build_algorithm
from inference.runner import ModelRunner
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, layers=2, temperature_scale=8.0)
    draft = tiny_llama(1, layers=1, temperature_scale=8.0)
    return target, draft


def test_ar_greedy_equals_transformers_generate(pair):
    target, _ = pair
    prompt = [3, 14, 15, 92, 65]
    result = build_algorithm("ar", runner(target)).generate(prompt, max_new_tokens=40, sampling=GREEDY)
    assert result.tokens == hf_greedy(target, prompt, 40)
    assert result.stats.target_forwards == 40 and result.stats.tau == 1.0


@pytest.mark.parametrize("verifier", ["tokenwise", "block", "hsd"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_sps_greedy_equals_ar_on_near_ties(verifier, gamma):
    """On a target whose every greedy step is a near-tie (tests/near_ties.py: a rounding difference would flip it),
    drafting with the target itself on the approximate path, which proposes the other twin wherever its rounding
    differs: drafts are kept and rejected, and the output is AR's."""
    target = near_tie_llama(torch.float32)
    prompt = [7, 1, 8, 2, 8]
    reference = build_algorithm("ar", runner(target)).generate(prompt, max_new_tokens=37, sampling=GREEDY).tokens
    sps = build_algorithm("sps", runner(target), runner(target, exact=False), gamma=gamma, verifier=verifier)
    result = sps.generate(prompt, max_new_tokens=37, sampling=GREEDY)
    assert result.tokens == reference
    stats = result.stats
    assert stats.new_tokens == 37 and stats.target_forwards == 1 + stats.rounds
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens and stats.tau > 1
    # every round emits its accepted tokens plus one (the budget may cut the last round)
    assert stats.new_tokens <= 1 + stats.accepted_draft_tokens + stats.rounds


def test_sps_with_the_target_as_draft_accepts_everything(pair):
    target, _ = pair
    gamma, n = 4, 41
    sps = build_algorithm("sps", runner(target), runner(target), gamma=gamma)
    result = sps.generate([5, 6, 7], max_new_tokens=n, sampling=GREEDY)
    # 1 token from the prefill, then gamma + 1 per round: tau -> gamma + 1
    assert result.stats.rounds == math.ceil((n - 1) / (gamma + 1))
    assert result.stats.rollback_rate == 0.0 and result.stats.acceptance_by_position == [1.0] * gamma
    sampled = sps.generate(
        [5, 6, 7], max_new_tokens=n, sampling=SamplingParams(1.0), generator=torch.Generator().manual_seed(0)
    )
    assert sampled.stats.rollback_rate == 0.0  # p == q: every sampled draft token is accepted


def test_eos_stops_inside_an_accepted_draft(pair):
    target, draft = pair
    prompt = [7, 1, 8, 2, 8]
    reference = build_algorithm("ar", runner(target)).generate(prompt, max_new_tokens=30, sampling=GREEDY).tokens
    eos = reference[12]
    expected = reference[: reference.index(eos) + 1]
    for algo in (
        build_algorithm("ar", runner(target)),
        build_algorithm("sps", runner(target), runner(target), gamma=4),
    ):
        result = algo.generate(prompt, max_new_tokens=30, sampling=GREEDY, eos_ids=[eos])
        assert result.tokens == expected


def test_streaming_callback_sees_every_token_once(pair):
    target, draft = pair
    seen: list[int] = []
    result = build_algorithm("sps", runner(target), runner(draft), gamma=3).generate(
        [1, 2, 3], max_new_tokens=20, sampling=GREEDY, on_tokens=seen.extend
    )
    assert seen == result.tokens and len(seen) == 20


def test_bad_inputs_are_one_line_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; available: ar, sps"):
        build_algorithm("nope", runner(target))
    with pytest.raises(ValueError, match="needs a draft LM"):
        build_algorithm("sps", runner(target))
    with pytest.raises(ValueError, match="drafter vocab_size 50 differs from the target's 97"):
        build_algorithm("sps", runner(target), runner(tiny_llama(2, vocab=50)))
    with pytest.raises(ValueError, match=r"needs 205 cache slots but max_seq_len=192"):
        build_algorithm("ar", runner(target)).generate(list(range(1, 101)), max_new_tokens=104, sampling=GREEDY)
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        build_algorithm("sps", runner(target), runner(draft), gamma=0)
    with pytest.raises(ValueError, match="empty prompt"):
        build_algorithm("ar", runner(target)).generate([], max_new_tokens=4, sampling=GREEDY)


@pytest.mark.real_model
def test_real_smollm2_ar_and_sps_equal_transformers_greedy(smollm2):
    """Greedy equality on real MT-Bench prompts. The draft is SmolLM2 cut to its first 6 layers: a poor drafter
    (most drafts are rejected: over 20 rejecting rounds a run), which exercises the rejection path on real logits;
    each verifier on its own prompt."""
    from transformers import AutoModelForCausalLM

    from core.prompts import load_prompts, prompt_turns, render_prompt

    model, tokenizer = smollm2
    config = model.config.to_dict() | {"num_hidden_layers": 6}
    draft = AutoModelForCausalLM.from_config(type(model.config)(**config)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    target_runner, draft_runner = (
        ModelRunner.from_hf_model(model, max_seq_len=512),
        ModelRunner.from_hf_model(draft, max_seq_len=512),
    )
    for conversation, verifier in zip(load_prompts("mt_bench", n=2), ("tokenwise", "hsd"), strict=True):
        prompt = render_prompt(tokenizer, prompt_turns(conversation))
        expected = hf_greedy(model, prompt, 24)
        assert (
            build_algorithm("ar", target_runner).generate(prompt, max_new_tokens=24, sampling=GREEDY).tokens == expected
        )
        sps = build_algorithm("sps", target_runner, draft_runner, gamma=4, verifier=verifier)
        result = sps.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        assert result.tokens == expected
        assert result.stats.rounds > 0 and result.stats.drafted_tokens > 0


@pytest.mark.parametrize("name", ["sps", "pearl", "specbranch", "ssd"])
def test_a_vocabulary_limited_draft_stays_greedy_equal(pair, name):
    """draft_vocab: the draft proposes only ids < 40 of 97; every draft-LM algorithm still emits the target's tokens."""
    target, draft = pair
    prompt = [7, 1, 8, 2, 8]
    reference = build_algorithm("ar", runner(target)).generate(prompt, max_new_tokens=30, sampling=GREEDY).tokens
    limited = with_logit_vocab(runner(draft), 40)
    result = build_algorithm(name, runner(target), limited).generate(prompt, max_new_tokens=30, sampling=GREEDY)
    assert result.tokens == reference
    assert any(t >= 40 for t in reference)  # the target does emit ids the draft can never propose


def test_sps_with_a_vocabulary_limited_draft_follows_the_target_law():
    """Monte Carlo: a draft that can only propose ids {0, 1} of 4 still yields exactly the target's law, for a
    request among 64 side by side."""
    vocab, n, runs = 4, 2, 4000
    target = tiny_llama(10, vocab=vocab, layers=2, temperature_scale=3.0)
    draft = tiny_llama(11, vocab=vocab, layers=1, temperature_scale=3.0)
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    sps = build_algorithm(
        "sps", runner(target, 16, rows=2 * LAW_ROWS), with_logit_vocab(runner(draft, 16, rows=2 * LAW_ROWS), 2), gamma=2
    )
    counts, accepted = sampled_law(sps, prompt, n, runs)
    assert accepted > 0
    assert_follows_law(counts, law, runs, max_tv=0.06)


@pytest.mark.parametrize("name", ["sps", "pearl", "specbranch", "ssd"])
def test_draft_vocab_given_to_the_algorithm_limits_its_draft(pair, name):
    """``draft_vocab=40`` passed to the algorithm itself (not through the engine, which limits the runner it passes)
    drafts from the limited runner: the same rounds as with a runner limited beforehand, not those of the full one.
    The draft is the target itself, so every rejection comes from the limit."""
    target, draft = pair[0], pair[0]
    prompt = [7, 1, 8, 2, 8]

    def rounds(draft_runner, **options):
        result = build_algorithm(name, runner(target), draft_runner, **options).generate(
            prompt, max_new_tokens=30, sampling=GREEDY
        )
        return result.tokens, result.stats.rounds, result.stats.drafted_tokens, result.stats.accepted_hist

    given = rounds(runner(draft), draft_vocab=40)
    assert given == rounds(with_logit_vocab(runner(draft), 40))
    assert given[1:] != rounds(runner(draft))[1:]
