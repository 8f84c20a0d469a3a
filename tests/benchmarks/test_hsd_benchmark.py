"""benchmarks/hsd_block_efficiency.py: paired tokenwise vs HSD rounds at T = 1, the bootstrap CI, T = 0 refused, and
the block / uncapped judges (block = capped on every draft; uncapped's lossy excess)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pearl_helpers import noisy_copy
from tiny_targets import runner, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
try:
    import hsd_block_efficiency as bench
finally:
    sys.path.pop(0)

PROMPTS = [[7, 1, 8, 2, 8], [3, 14, 15, 92, 65], [2, 7, 1, 8]]


@pytest.fixture(scope="module")
def comparison():
    target = tiny_llama(0, layers=2, temperature_scale=4.0)
    draft = noisy_copy(target, 0.02)
    return bench.run_paired(
        runner(target), runner(draft), PROMPTS, gamma=4, temperature=1.0, seed=3, min_rounds=60, max_new_tokens=24
    )


def test_both_verifiers_reach_min_rounds_on_paired_generations(comparison):
    gens = comparison.generations
    assert comparison.temperature == 1.0 and comparison.gamma == 4
    assert [g.prompt for g in gens] == [i % len(PROMPTS) for i in range(len(gens))]
    assert [g.seed for g in gens] == list(range(3, 3 + len(gens)))
    for name in bench.VERIFIERS:
        total = comparison.total(name)
        assert total.rounds >= 60 and total.rounds == sum(g.runs[name].stats.rounds for g in gens)
        # stopped as soon as both had enough: one generation fewer would leave one of them short
        assert total.rounds - gens[-1].runs[name].stats.rounds < 60 or len(gens) == len(PROMPTS)
        assert all(g.runs[name].temperature == 1.0 and g.runs[name].stats.new_tokens == 24 for g in gens)
    for g in gens:
        tw, hsd = g.runs["tokenwise"], g.runs["hsd"]
        assert tw.tokens[0] == hsd.tokens[0]  # same seed: the prefill's sampled token is common to both
        for run in (tw, hsd):  # expected tokens per round lie in [1, γ + 1]
            rounds = run.stats.rounds
            assert all(rounds <= run.expected[n] <= 5 * rounds + 1e-9 for n in bench.JUDGES)
            assert run.expected["block"] == pytest.approx(run.expected["hsd"], abs=1e-9 * max(rounds, 1))
            # the uncapped final step accepts the whole draft at least as often as the capped one
            assert run.expected["uncapped"] >= run.expected["hsd"] - 1e-9
    # sampled, not greedy: the two verifiers' outputs differ somewhere
    assert any(g.runs["tokenwise"].tokens != g.runs["hsd"].tokens for g in gens)


def test_summary_ratio_ci_and_tables(comparison):
    summary = bench.summarize(comparison, resamples=2000, seed=0)
    for name in bench.VERIFIERS:
        v = summary["verifiers"][name]
        total = comparison.total(name)
        assert v["rounds"] == total.rounds >= 60 and v["temperature"] == 1.0
        assert v["block_efficiency"] == pytest.approx((total.accepted_draft_tokens + total.rounds) / total.rounds)
        assert 1.0 <= v["block_efficiency"] <= 5.0 and sum(v["accepted_hist"]) == total.rounds
    for key in ("measured", "same_draft_exact"):
        stat = summary[key]
        low, high = stat["ci95"]
        assert low <= stat["ratio"] <= high and stat["se"] > 0
    be = summary["verifiers"]
    assert summary["measured"]["ratio"] == pytest.approx(
        be["hsd"]["block_efficiency"] / be["tokenwise"]["block_efficiency"]
    )
    # Block Verification keeps at least as much as tokenwise in expectation, on the very same drafts
    assert summary["same_draft_exact"]["ratio"] >= 1.0 - 1e-12
    judged = summary["same_draft_exact_by_judge"]
    assert judged["block"]["ratio"] == pytest.approx(judged["hsd"]["ratio"], abs=1e-12)
    assert judged["hsd"] == summary["same_draft_exact"]
    pooled = summary["pooled_block_efficiency_exact_e"]
    excess, share = summary["lossy_excess"], summary["lossy_share_of_uncapped_gain"]
    assert excess["ratio"] == pytest.approx((pooled["uncapped"] - pooled["hsd"]) / pooled["tokenwise"])
    assert share["ratio"] == pytest.approx(
        (pooled["uncapped"] - pooled["hsd"]) / (pooled["uncapped"] - pooled["tokenwise"])
    )
    assert excess["ratio"] > 0 and 0 < share["ratio"] <= 1  # sampled drafts: uncapped accepts more, lossily
    assert judged["uncapped"]["ratio"] == pytest.approx(judged["hsd"]["ratio"] + excess["ratio"])
    text = bench.report(summary, "header")
    assert "| hsd (capped) |" in text and "two-stage cluster bootstrap" in text
    assert "pos 4" in text and "n=4" in text and f"goal >= {bench.GOAL:g}" in text
    assert "| same-draft exact expectation, block (BlockVerifier) |" in text and "lossy: not a lossless" in text
    assert "share of uncapped's gain over tokenwise" in text
    again = bench.summarize(comparison, resamples=2000, seed=0)
    assert again["measured"] == summary["measured"]  # seeded bootstrap


def test_uncapped_excess_is_exactly_the_final_step_difference():
    """One hand-checkable draft: γ = 1, V = 2, p(x) = 0.9 < q(x) = 1 at the drafted token. Capped accepts the draft
    with r*_1 = 0.9 and uncapped with min(1, r_1) = 0.9 too; with p(x) > q(x) both accept surely. The judges differ
    only when a ratio above 1 is followed by one below 1, which γ = 2 shows: r_1 = 2, r_2 = 2·0.5 = 1 → uncapped
    accepts both tokens surely, capped with r*_2 = min(1, 0.5) = 0.5."""
    judges = bench.make_judges()
    tokens = torch.tensor([0, 0])
    q = torch.tensor([[0.4, 0.6], [0.8, 0.2]], dtype=torch.float64)
    p = torch.tensor([[0.8, 0.2], [0.4, 0.6], [0.5, 0.5]], dtype=torch.float64)
    e = {name: bench._expected_tokens(judge, tokens, q, p) for name, judge in judges.items()}
    assert e["block"] == e["hsd"]
    law_capped = judges["hsd"].plan(tokens, q, p).tau_law()
    law_uncapped = judges["uncapped"].plan(tokens, q, p).tau_law()
    assert float(law_uncapped[2]) == pytest.approx(1.0) and float(law_capped[2]) == pytest.approx(0.5)
    assert e["uncapped"] - e["hsd"] == pytest.approx(float((law_uncapped - law_capped) @ torch.arange(3.0).double()))
    assert e["uncapped"] > e["hsd"] >= e["tokenwise"]


def test_a_block_judge_that_differs_from_capped_is_an_error():
    judges = bench.make_judges()
    judges["block"] = judges["uncapped"]  # a "block" rule that is not Block Verification
    recorder = bench.RecordingVerifier(judges["hsd"], judges)
    q = torch.tensor([[0.4, 0.6], [0.8, 0.2]], dtype=torch.float64)
    p = torch.tensor([[0.8, 0.2], [0.4, 0.6], [0.5, 0.5]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must be identical"):
        recorder(torch.tensor([0, 0]), q, p, torch.Generator().manual_seed(0))


def test_bootstrap_weights_resample_prompts_then_generations():
    prompt_of = np.array([0, 1, 2, 0, 1, 2, 0])
    weights = bench.bootstrap_weights(prompt_of, 500, np.random.default_rng(0))
    assert weights.shape == (500, 7)
    counts = {p: (prompt_of == p).sum() for p in range(3)}
    for row in weights:  # every drawn prompt brings as many generation draws as it has generations
        per_prompt = [row[prompt_of == p].sum() for p in range(3)]
        assert all(c % counts[p] == 0 for p, c in enumerate(per_prompt))
        assert sum(c // counts[p] for p, c in enumerate(per_prompt)) == 3


def test_greedy_is_refused(comparison):
    target = tiny_llama(0, layers=1)
    with pytest.raises(ValueError, match="temperature=0.*identical"):
        bench.run_paired(runner(target), runner(target), PROMPTS, temperature=0.0, min_rounds=5)
    assert bench.main(["drafter=/nonexistent", "temperature=0"]) == 2


def test_cli_end_to_end_on_tiny_exports(tmp_path, capsys):
    from tiny_targets import save_tiny_target, write_jsonl

    target = save_tiny_target(tmp_path / "target", layers=2)
    draft = save_tiny_target(tmp_path / "draft", layers=2, noise=0.002)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "hsd.json"
    code = bench.main(
        [
            f"target={target}",
            f"drafter={draft}",
            f"bench=[jsonl:{prompts}]",
            "n_prompts=2",
            "max_new_tokens=12",
            "min_rounds=12",
            "draft_vocab=1000",
            "resamples=500",
            f"out={out}",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "| tokenwise |" in printed and "| measured (primary) |" in printed and "T=1" in printed
    assert '"rounds"' in out.read_text()
