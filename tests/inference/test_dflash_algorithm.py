"""The dflash algorithm: greedy equality with AR over block sizes, τ and context bookkeeping with an oracle drafter,
EOS and the token budget, the exact sampling law, one-line errors, and a native export served through evaluate."""

from __future__ import annotations

import pytest
import torch
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from tiny_targets import GREEDY, runner, tiny_llama
from dflash_builders import AUX, make_drafter

from core.drafters.dflash import DFlashConfig, DFlashDrafter
from inference.algorithms import build_algorithm

PROMPT, N_NEW = [7, 1, 8, 2, 8], 37


class OracleDrafter(DFlashDrafter):
    """Knows the target's greedy continuation ``sequence``: slot k of the block anchored at position p gets its top
    logit on sequence[p + k] (with ``miss_every`` = m, not where p + k is a multiple of m). It also checks that the
    context arrives position by position with the features of its own position, and the anchor is token p."""

    def __init__(self, config, *, sequence: list[int], features: torch.Tensor, miss_every: int = 0, **kw):
        super().__init__(config, **kw)
        self.sequence, self.features, self.miss_every = sequence, features, miss_every
        self.context_rows: list[int] = []

    def draft(self, cache, features, anchor_token):
        start = cache.length
        rows = list(range(start, start + features.shape[1]))
        torch.testing.assert_close(features[0], self.features[rows], rtol=1e-4, atol=1e-4)
        self.context_rows += rows
        logits = super().draft(cache, features, anchor_token)
        anchor = cache.length
        assert int(anchor_token) == self.sequence[anchor]
        for k in range(1, self.config.block_size):
            if anchor + k < len(self.sequence):
                logits[0, k - 1] = torch.linspace(0, -10, logits.shape[-1])
                missed = self.miss_every and (anchor + k) % self.miss_every == 0
                logits[0, k - 1, self.sequence[anchor + k]] = -5.0 if missed else 20.0
        return logits


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, layers=3, temperature_scale=8.0)
    reference = build_algorithm("ar", runner(target)).generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY).tokens
    sequence = PROMPT + reference
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in AUX], dim=-1)[0]  # output of layer i = hidden_states[i + 1]
    return target, reference, sequence, features


def oracle(setup, block_size: int, miss_every: int = 0) -> OracleDrafter:
    target, _, sequence, features = setup
    # the full vocabulary, so every greedy token can be drafted
    return make_drafter(
        target,
        draft_vocab=target.config.vocab_size,
        block_size=block_size,
        cls=OracleDrafter,
        sequence=sequence,
        features=features,
        miss_every=miss_every,
    ).eval()


@pytest.mark.parametrize("block_size, draft_tokens", [(2, 0), (4, 0), (4, 2), (8, 0), (16, 5)])
@pytest.mark.parametrize("kind", ["random", "oracle_with_misses"])
def test_greedy_equals_ar(setup, kind, block_size, draft_tokens):
    target, reference, _, _ = setup
    drafter = (
        make_drafter(target, block_size=block_size).eval()
        if kind == "random"
        else oracle(setup, block_size, miss_every=5)
    )
    algorithm = build_algorithm("dflash", runner(target), drafter, draft_tokens=draft_tokens)
    result = algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats = result.stats
    gamma = draft_tokens or block_size - 1
    assert stats.new_tokens == N_NEW and stats.target_forwards == 1 + stats.rounds
    assert stats.draft_forwards == stats.rounds  # ONE drafter forward per round
    assert stats.new_tokens <= 1 + stats.accepted_draft_tokens + stats.rounds  # the budget may cut the last
    assert stats.drafted_tokens <= stats.rounds * gamma
    if kind == "oracle_with_misses" and gamma >= 2:
        assert stats.tau > 1.8


@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_an_oracle_block_is_accepted_whole_and_every_position_reaches_the_context_once(setup, block_size):
    target, reference, _, _ = setup
    drafter = oracle(setup, block_size)
    result = build_algorithm("dflash", runner(target), drafter).generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats, gamma = result.stats, block_size - 1
    rounds, left = divmod(N_NEW - 1, block_size)  # whole blocks + bonus tokens, then what the budget leaves
    bonuses = rounds + (left >= 2)  # a last round drafts max(1, left - 1): with left = 1 its bonus is cut
    rounds += left > 0
    assert stats.rounds == rounds and stats.target_forwards == rounds + 1
    assert stats.accepted_draft_tokens == N_NEW - 1 - bonuses
    assert stats.acceptance_by_position[: gamma - 1] == [1.0] * (gamma - 1)
    assert drafter.context_rows == list(range(len(drafter.context_rows)))  # in order, each once
    assert len(drafter.context_rows) >= len(PROMPT) + N_NEW - block_size - 1


def test_eos_inside_the_block_and_the_token_budget(setup):
    target, reference, _, _ = setup
    eos = reference[6]  # with blocks of 5 the oracle accepts tokens 6..10 in one round: EOS sits inside it
    expected = reference[: reference.index(eos) + 1]
    for drafter in (oracle(setup, 5), make_drafter(target, block_size=5).eval()):
        algorithm = build_algorithm("dflash", runner(target), drafter)
        assert algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY, eos_ids=[eos]).tokens == expected
        for n in (1, 2, 6, 11):
            result = algorithm.generate(PROMPT, max_new_tokens=n, sampling=GREEDY)
            assert result.tokens == reference[:n] and result.stats.new_tokens == n


def test_sampling_follows_the_target_law():
    """Monte Carlo: the law of the first 3 tokens equals the target's (chi-square and TV, fixed seed), with a
    reduced draft vocabulary and blocks of 3 (two drafted tokens sampled from independent slot distributions)."""
    vocab, n, runs = 4, 3, 3000
    target = tiny_llama(10, vocab=vocab, layers=3, temperature_scale=3.0)
    config = DFlashConfig.for_target(
        target.config, draft_vocab_size=3, aux_layer_ids=AUX, block_size=3, num_layers=1, mask_token_id=2
    )
    torch.manual_seed(5)
    drafter = DFlashDrafter(
        config, embed_weight=target.model.embed_tokens.weight.detach(), head_weight=target.lm_head.weight.detach()
    )
    drafter.set_vocab_map(torch.tensor([0, 0, 1]), torch.tensor([True, True, False, True]))  # ids 0, 1, 3
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    algorithm = build_algorithm("dflash", runner(target, 16, rows=2 * LAW_ROWS), drafter.eval())
    counts, accepted = sampled_law(algorithm, prompt, n, runs)
    assert accepted > runs // 2  # drafted tokens are really accepted, not just the bonus token
    assert_follows_law(counts, law, runs, max_tv=0.07)


def test_bad_drafters_and_options_are_one_line_errors(setup):
    target, _, _, _ = setup
    with pytest.raises(
        ValueError, match="needs a DFlash export of python -m spectrain.export for this target: pass drafter=PATH"
    ):
        build_algorithm("dflash", runner(target))
    with pytest.raises(ValueError, match="drafter vocab_size 50 differs from the target's 97"):
        build_algorithm(
            "dflash", runner(target), make_drafter(tiny_llama(2, vocab=50), draft_vocab=20, mask_token_id=3)
        )
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    eagle = Eagle3Drafter(Eagle3Config(32, 64, 4, 2, 97, 97, target_hidden_size=32, aux_layer_ids=[0, 1, 2]))
    with pytest.raises(ValueError, match="dflash needs a DFlash drafter, got Eagle3Drafter"):
        build_algorithm("dflash", runner(target), eagle)
    deep = DFlashDrafter(
        DFlashConfig.for_target(
            target.config, draft_vocab_size=97, aux_layer_ids=[1, 9], block_size=4, num_layers=1, mask_token_id=3
        )
    )
    with pytest.raises(ValueError, match=r"aux layers \[1, 9\] do not exist in a 3-layer target"):
        build_algorithm("dflash", runner(target), deep)
    with pytest.raises(ValueError, match=r"dflash\.draft_tokens=4 but this drafter's block drafts 3 tokens; give 1..3"):
        build_algorithm("dflash", runner(target), make_drafter(target), draft_tokens=4)
    algorithm = build_algorithm("dflash", runner(target), make_drafter(target))
    with pytest.raises(ValueError, match=r"\(\+4 lookahead\) needs 200 cache slots but max_seq_len=192"):
        algorithm.generate(list(range(1, 101)), max_new_tokens=96, sampling=GREEDY)


def test_a_native_export_is_served_by_evaluate_among_all_algorithms(tmp_path):
    """drafters=DIR holding a dflash export: algorithms=all runs dflash, greedy equal to AR; its record shows
    one drafter forward per target forward after the prefill."""
    from tiny_targets import save_tiny_target

    from core.assets import target_record
    from core.drafters.dflash.layouts import load_native, save_native
    from inference import evaluate as evaluate_cli

    from transformers import AutoModelForCausalLM

    target_dir = save_tiny_target(tmp_path / "target", layers=4)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    config = DFlashConfig.for_target(
        model.config,
        draft_vocab_size=model.config.vocab_size,
        aux_layer_ids=[0, 2],
        block_size=4,
        num_layers=1,
        mask_token_id=3,
    )
    drafter = DFlashDrafter(config)
    exported = save_native(drafter, tmp_path / "exports" / "dflash", target=target_record(str(target_dir)))
    reloaded = load_native(exported, model.get_input_embeddings().weight, model.lm_head.weight)
    for name, tensor in drafter.state_dict().items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(reloaded.state_dict()[name], tensor), name
    cfg = evaluate_cli.parse_args(
        [
            f"target={target_dir}",
            f"drafters={tmp_path / 'exports'}",
            "algorithms=all",
            "bench=mt_bench",
            "n_prompts=1",
            "max_new_tokens=12",
            f"out={tmp_path / 'eval'}",
            "warmup=false",
            "max_seq_len=512",
        ]
    )
    runs = {run["algorithm"]: run for run in evaluate_cli.evaluate(cfg)["runs"]}
    assert "dflash" in runs and runs["dflash"]["greedy_equal_to_ar"] is True
    assert runs["dflash"]["draft_forwards"] == runs["dflash"]["target_forwards"] - 1
