"""The peagle algorithm: greedy equality with AR over depths, τ and row bookkeeping with an oracle drafter, EOS and the
token budget, the exact sampling law, one-line errors, and a native export served through evaluate."""

from __future__ import annotations

import pytest
import torch
from law_helpers import LAW_ROWS, assert_follows_law, exact_target_law, sampled_law
from tiny_targets import GREEDY, runner, tiny_llama
from peagle_builders import AUX3, N_NEW, PROMPT, make_peagle

from core.drafters.peagle import PEagleConfig, PEagleDrafter
from inference.algorithms import build_algorithm


class OracleDrafter(PEagleDrafter):
    """Knows the target's greedy continuation ``sequence``: depth k of the chain after committed row n - 1 gets its top
    logit on sequence[n + 1 + k] (with ``miss_every`` = m, not where n + 1 + k is a multiple of m). It also checks that
    rows arrive position by position with the features of their position and the token after it."""

    def __init__(self, config, *, sequence: list[int], features: torch.Tensor, miss_every: int = 0, **kw):
        super().__init__(config, **kw)
        self.sequence, self.features, self.miss_every = sequence, features, miss_every
        self.rows: list[int] = []

    def draft(self, cache, features, next_tokens, depths=None):
        rows = list(range(cache.length, cache.length + features.shape[1]))
        torch.testing.assert_close(features[0], self.features[rows], rtol=1e-4, atol=1e-4)
        assert list(next_tokens) == [self.sequence[r + 1] for r in rows]
        self.rows += rows
        logits = super().draft(cache, features, next_tokens, depths)
        n = cache.length
        for k in range(logits.shape[1]):
            if n + 1 + k < len(self.sequence):
                logits[0, k] = torch.linspace(0, -10, logits.shape[-1])
                missed = self.miss_every and (n + 1 + k) % self.miss_every == 0
                logits[0, k, self.sequence[n + 1 + k]] = -5.0 if missed else 20.0
        return logits


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, layers=4, temperature_scale=8.0)  # aux layers 0..2: never the final (normed) one
    reference = build_algorithm("ar", runner(target)).generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY).tokens
    sequence = PROMPT + reference
    with torch.no_grad():
        states = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in AUX3], dim=-1)[0]  # output of layer i = hidden_states[i + 1]
    return target, reference, sequence, features


def oracle(setup, depths: int, miss_every: int = 0) -> OracleDrafter:
    target, _, sequence, features = setup
    return make_peagle(
        target,
        depths=depths,
        draft_vocab=target.config.vocab_size,
        cls=OracleDrafter,
        sequence=sequence,
        features=features,
        miss_every=miss_every,
    )


@pytest.mark.parametrize("depths, draft_tokens", [(1, 0), (4, 0), (4, 2), (8, 0)])
@pytest.mark.parametrize("kind", ["random", "oracle_with_misses"])
def test_greedy_equals_ar(setup, kind, depths, draft_tokens):
    target, reference, _, _ = setup
    drafter = make_peagle(target, depths=depths) if kind == "random" else oracle(setup, depths, miss_every=5)
    result = build_algorithm("peagle", runner(target), drafter, draft_tokens=draft_tokens).generate(
        PROMPT, max_new_tokens=N_NEW, sampling=GREEDY
    )
    assert result.tokens == reference
    stats, gamma = result.stats, draft_tokens or depths
    assert stats.new_tokens == N_NEW and stats.target_forwards == 1 + stats.rounds
    assert stats.draft_forwards == stats.rounds  # ONE drafter forward per round
    assert stats.drafted_tokens <= stats.rounds * gamma
    if kind == "oracle_with_misses" and gamma >= 2:
        assert stats.tau > 1.8


@pytest.mark.parametrize("depths", [2, 5])
def test_an_oracle_chain_is_accepted_whole_and_every_row_reaches_the_drafter_once(setup, depths):
    target, reference, _, _ = setup
    drafter = oracle(setup, depths)
    result = build_algorithm("peagle", runner(target), drafter).generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference
    stats = result.stats
    assert stats.acceptance_by_position[: depths - 1] == [1.0] * (depths - 1)
    assert stats.tau > depths  # K drafts + the bonus token per target forward, the prefill aside
    assert drafter.rows == list(range(len(drafter.rows)))  # in order, each once
    assert len(drafter.rows) >= len(PROMPT) + N_NEW - depths - 2


def test_eos_inside_the_chain_and_the_token_budget(setup):
    target, reference, _, _ = setup
    eos = reference[6]
    expected = reference[: reference.index(eos) + 1]
    for drafter in (oracle(setup, 4), make_peagle(target, depths=4)):
        algorithm = build_algorithm("peagle", runner(target), drafter)
        assert algorithm.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY, eos_ids=[eos]).tokens == expected
        for n in (1, 2, 6, 11):
            result = algorithm.generate(PROMPT, max_new_tokens=n, sampling=GREEDY)
            assert result.tokens == reference[:n] and result.stats.new_tokens == n


def test_sampling_follows_the_target_law():
    """Monte Carlo: the law of the first 4 tokens equals the target's (chi-square and TV, fixed seed), with a reduced
    draft vocabulary and 2 depths: the second round drafts 2 tokens, the second from the mask row, independent of the
    first draw."""
    vocab, n, runs = 3, 4, 1500
    target = tiny_llama(10, vocab=vocab, layers=3, temperature_scale=3.0)
    torch.manual_seed(5)
    config = PEagleConfig.for_target(
        target.config, draft_vocab_size=2, aux_layer_ids=AUX3, mask_token_id=2, num_depths=2
    )
    drafter = PEagleDrafter(config, embed_weight=target.model.embed_tokens.weight.detach())
    drafter.set_vocab_map(torch.tensor([0, 1]), torch.tensor([True, False, True]))  # ids 0 and 2
    prompt = [1, 2]
    law = exact_target_law(target, prompt, n, vocab)
    algorithm = build_algorithm("peagle", runner(target, 16, rows=2 * LAW_ROWS), drafter.eval())
    counts, accepted = sampled_law(algorithm, prompt, n, runs)
    assert accepted > runs // 2  # drafted tokens are really accepted, not just the bonus token
    assert_follows_law(counts, law, runs, max_tv=0.1)


def test_bad_drafters_and_options_are_one_line_errors(setup):
    target, _, _, _ = setup
    with pytest.raises(
        ValueError, match="needs a P-EAGLE export of python -m spectrain.export for this target: pass drafter=PATH"
    ):
        build_algorithm("peagle", runner(target))
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    eagle = Eagle3Drafter(Eagle3Config(32, 64, 4, 2, 97, 97, target_hidden_size=32, aux_layer_ids=[0, 1, 2]))
    with pytest.raises(ValueError, match="peagle needs a P-EAGLE drafter, got Eagle3Drafter"):
        build_algorithm("peagle", runner(target), eagle)
    with pytest.raises(ValueError, match="dflash needs a DFlash drafter, got PEagleDrafter"):
        build_algorithm("dflash", runner(target), make_peagle(target))
    with pytest.raises(ValueError, match="drafter vocab_size 50 differs from the target's 97"):
        build_algorithm("peagle", runner(target), make_peagle(tiny_llama(2, vocab=50, layers=3), draft_vocab=20))
    with pytest.raises(
        ValueError,
        match=r"peagle\.draft_tokens=5 but this drafter drafts 4 tokens per forward; give "
        "1..4",
    ):
        build_algorithm("peagle", runner(target), make_peagle(target), draft_tokens=5)


def test_a_native_export_is_served_by_evaluate_among_all_algorithms(tmp_path):
    """drafters=DIR holding a peagle export: algorithms=all runs peagle, greedy equal to AR, one drafter forward per
    target forward after the prefill."""
    from tiny_targets import save_tiny_target
    from transformers import AutoModelForCausalLM

    from core.assets import target_record
    from core.drafters.peagle.layouts import load_native, save_layout
    from inference import evaluate as evaluate_cli

    target_dir = save_tiny_target(tmp_path / "target", layers=4)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    config = PEagleConfig.for_target(
        model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=[0, 1, 2], mask_token_id=3, num_depths=3
    )
    drafter = PEagleDrafter(config)
    exported = save_layout(drafter, tmp_path / "exports" / "peagle", target=target_record(str(target_dir)))
    reloaded = load_native(exported, model.get_input_embeddings().weight)
    for name, tensor in drafter.state_dict().items():
        if name != "embed_tokens.weight":
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
    assert "peagle" in runs and runs["peagle"]["greedy_equal_to_ar"] is True
    assert runs["peagle"]["draft_forwards"] == runs["peagle"]["target_forwards"] - 1
