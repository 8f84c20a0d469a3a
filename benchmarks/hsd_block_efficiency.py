"""HSD (capped) vs tokenwise verification: block efficiency at T > 0 on one target + draft LM, paired, with a CI.

    python benchmarks/hsd_block_efficiency.py target=smollm2 drafter=PATH bench=[gsm_symbolic] n_prompts=8
        max_new_tokens=128 gamma=4 temperature=1.0 seed=0 min_rounds=1000 draft_vocab=0 threads=1
        [resamples=10000] [max_seq_len=2048] [goal=1.014] [out=FILE.json]

Goal checked: HSD (capped final ratio = Block Verification, lossless) block efficiency / tokenwise block
efficiency >= the HSD paper's lossless Blockwise gain over tokenwise (GSM8K, γ = 10: +1.4 % to +2.3 % over the
three targets; ``goal`` = the low end, 1.014), at T = 1, over >= ``min_rounds`` verification rounds per verifier,
with a 95 % CI. Run it at the paper's γ class (``gamma=8``) for that comparison.

Four judges, no extra forwards. Every round is also judged (exact expected tokens, below) by Block Verification
(``BlockVerifier``: must equal capped HSD on every draft; checked each round) and by the HSD authors' uncapped
final-step rule (lossy: it accepts the whole draft with min(1, r_γ) instead of the capped r*_γ). Uncapped's excess
over capped, on the same drafts, is the part of the authors' reported HSD gain that is not lossless: reported as
a ratio excess over tokenwise and as a share of uncapped's gain over tokenwise, each with its CI.

What is measured. Both verifiers run inside the engine's own chain speculative sampling (``sps``, the same
algorithm ``inference.evaluate`` builds for ``sps`` and ``sps@verifier=hsd``) with the same draft LM and γ.
Block efficiency (BE) of a verifier = tokens one verification round emits (accepted draft tokens + the one
correction/bonus token), averaged over rounds = (accepted_draft_tokens + rounds) / rounds, read from the
engine's ``GenerationStats`` (``record_round``). This is NOT ``GenerationStats.tau``: tau = new_tokens /
target_forwards counts the prefill forward and its token and loses tokens the budget or an EOS cut off the
last round; it is printed too, for reference. The budget also trims γ in the last rounds of a generation
(γ' = min(γ, tokens left)); those rounds count as they are (the same for both verifiers; their number is
printed) — keep max_new_tokens >> γ to make them rare.

Pairing. A "generation" (the bootstrap's inner unit) is one (prompt, seed) pair: generation i uses prompt
i mod n_prompts and seed ``seed + i``, and BOTH verifiers generate it with a generator seeded alike, so the
prefill token, the first draft and the uniforms of the first round are common random numbers; after the first
round the contexts diverge (the verifiers keep different numbers of tokens). The two runs of a generation are
interleaved (tokenwise first on even i, HSD first on odd i) so machine load hits both alike. Generation goes on,
cycling the prompts, until every prompt was used once and each verifier has >= ``min_rounds`` rounds.

Same contexts where possible. A recording wrapper around the acting verifier (it delegates the decision, so the
draws and outputs are the verifier's own) also asks BOTH verifiers' plans (``inference.verify``,
``VerifyPlan.tau_law``) for the exact expected tokens of the round on that very context and draft. This gives
a secondary, much lower-variance paired estimate: Σ E_hsd / Σ E_tokenwise over every round of both runs
(identical context, draft, p and q in numerator and denominator). Its caveat: it averages over the round-start
contexts both runs visited, not over each verifier's own; the primary (measured) ratio has no such caveat.
The same expectations over a verifier's own rounds give its Rao-Blackwellised BE (column "BE exact-E").

Statistic. Ratio of pooled means R = BE_hsd / BE_tokenwise. 95 % CI: percentile interval of a two-stage
(hierarchical) cluster bootstrap, numpy only (seeded with ``seed``): resample prompts with replacement, then
within every drawn prompt resample its generations with replacement; a generation carries both verifiers'
runs (paired), and all rounds of a run move together (a block bootstrap of rounds by prompt and generation).
Rounds within a generation share a context and generations of one prompt share a prompt, so resampling single
rounds would understate the variance; the second stage keeps the interval meaningful with few prompts, and is
slightly conservative with many. With fewer than 10 prompts the between-prompt part is poorly estimated: use
more prompts for a claim.

Greedy (T = 0) is refused: both verifiers then emit the target's argmax path and the ratio is 1 by construction.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, DraftLM, Output, Seeded, SeqLen, Target, Workload, parse_bench
from core.errors import UserError
from core.overrides import OverrideError, run_cli
from inference.algorithms import build_algorithm
from inference.algorithms.base import GenerationStats
from inference.algorithms.options import apply_threads
from inference.drafter_index import export_kind
from inference.drafters import eos_token_ids, load_drafter, load_lm
from inference.evaluate import load_bench_prompts
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams
from inference.verify import (
    BlockVerifier,
    ChainVerifier,
    HSDVerifier,
    LossyVerifierWarning,
    TokenwiseVerifier,
    VerifyResult,
)

USAGE = (
    "python benchmarks/hsd_block_efficiency.py target=smollm2 drafter=PATH bench=[gsm_symbolic] n_prompts=8 "
    "max_new_tokens=128 gamma=4 temperature=1.0 seed=0 min_rounds=1000 draft_vocab=0 threads=1"
)
VERIFIERS = ("tokenwise", "hsd")  # the verifiers that act (generate)
JUDGES = ("tokenwise", "hsd", "block", "uncapped")  # the rules whose exact expectation every round records
JUDGE_LABELS = {
    "tokenwise": "tokenwise",
    "hsd": "hsd (capped)",
    "block": "block (BlockVerifier)",
    "uncapped": "hsd uncapped (lossy)",
}
# The HSD paper's lossless Blockwise ÷ Tokenwise block efficiency on GSM8K (γ = 10, T = 1, Qwen2.5-0.5B drafting
# for 72B / 32B / 14B): 6.53 / 6.44, 6.26 / 6.14, 6.13 / 5.99.
PAPER_BLOCKWISE_GAIN = (1.014, 1.023)
GOAL = PAPER_BLOCKWISE_GAIN[0]
BLOCK_TOLERANCE = 1e-9  # |E_block - E_capped| allowed per round (the same rule: equal up to float rounding)


@dataclass
class HSDConfig(BenchConfig, Output, Target, SeqLen, DraftLM, Workload, Seeded):
    """``drafter``: a draft-LM export (or HF directory sharing the target's tokenizer); ``n_prompts``: per bench;
    ``seed``: generation i uses seed + i, and it seeds the bootstrap; ``out``: an optional JSON with the summary and
    per-generation counts."""

    bench: list[str] = field(default_factory=lambda: ["gsm_symbolic"])  # several: one pooled comparison
    gamma: int = 4
    temperature: float = 1.0
    min_rounds: int = 1000  # per verifier
    resamples: int = 10000  # bootstrap resamples
    goal: float = GOAL  # the ratio the lossless HSD must reach (default: the paper's lowest lossless Blockwise gain)


# --------------------------------------------------------------------------------------------------------
# Paired generation
# --------------------------------------------------------------------------------------------------------


def _expected_tokens(verifier: ChainVerifier, draft_tokens, draft_probs, target_probs) -> float:
    """Exact E[accepted + 1] of ``verifier`` on this draft (its own plan's law of τ)."""
    law = verifier.plan(draft_tokens, draft_probs, target_probs).tau_law()
    return float((law * torch.arange(law.shape[-1], dtype=law.dtype)).sum()) + 1.0


def make_judges() -> dict[str, ChainVerifier]:
    """Every rule in ``JUDGES``; the uncapped one only judges (never acts), so its lossy warning is expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyVerifierWarning)
        uncapped = HSDVerifier("uncapped")
    return {
        "tokenwise": TokenwiseVerifier(),
        "hsd": HSDVerifier("capped"),
        "block": BlockVerifier(),
        "uncapped": uncapped,
    }


class RecordingVerifier(ChainVerifier):
    """Acts exactly as ``acting`` (its own plan and draws) and records, per round, γ', the accepted count and the
    exact expected tokens of every verifier in ``judges`` on the same draft. Planning draws no randomness, so the
    generator stream, hence the output, is the one the bare verifier would give. With both "block" and "hsd"
    among the judges, a round where they differ (beyond float rounding) is an error."""

    def __init__(self, acting: ChainVerifier, judges: dict[str, ChainVerifier]):
        self.acting, self.judges = acting, judges
        self.name, self.lossless = acting.name, acting.lossless
        self.rounds: list[tuple[int, int, dict[str, float]]] = []

    def plan(self, draft_tokens, draft_probs, target_probs):
        return self.acting.plan(draft_tokens, draft_probs, target_probs)

    def __call__(self, draft_tokens, draft_probs, target_probs, generator=None) -> VerifyResult:
        expected = {
            name: _expected_tokens(judge, draft_tokens, draft_probs, target_probs)
            for name, judge in self.judges.items()
        }
        if "block" in expected and "hsd" in expected and abs(expected["block"] - expected["hsd"]) > BLOCK_TOLERANCE:
            raise RuntimeError(
                f"BlockVerifier expects {expected['block']!r} tokens but capped HSD "
                f"{expected['hsd']!r} on the same draft: the two rules must be identical"
            )
        result = self.acting(draft_tokens, draft_probs, target_probs, generator)
        self.rounds.append((int(draft_tokens.shape[-1]), result.num_accepted, expected))
        return result

    def take(self) -> list[tuple[int, int, dict[str, float]]]:
        rounds, self.rounds = self.rounds, []
        return rounds


@dataclass
class Run:
    """One verifier on one generation."""

    stats: GenerationStats
    tokens: list[int]
    temperature: float
    expected: dict[str, float]  # Σ over this run's rounds of each verifier's exact E[tokens per round]
    trimmed_rounds: int  # rounds whose γ' < γ (token budget)

    @property
    def emitted(self) -> int:
        """Tokens the verification rounds emitted: accepted draft tokens + one per round."""
        return self.stats.accepted_draft_tokens + self.stats.rounds


@dataclass
class Generation:
    prompt: int
    seed: int
    runs: dict[str, Run]


@dataclass
class Comparison:
    generations: list[Generation]
    gamma: int
    temperature: float

    def total(self, name: str) -> GenerationStats:
        stats = GenerationStats()
        for generation in self.generations:
            stats.merge(generation.runs[name].stats)
        return stats


def check_sampled(temperature: float) -> None:
    if not temperature > 0:
        raise UserError(
            f"temperature={temperature}: greedy decoding makes tokenwise and HSD identical (both emit "
            "the target's argmax path, ratio 1 by construction); measure at temperature > 0, e.g. 1.0"
        )


def run_paired(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    gamma: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    min_rounds: int = 1000,
    max_new_tokens: int = 128,
    eos_ids: Sequence[int] = (),
    progress=None,
) -> Comparison:
    """Generate with sps + tokenwise and sps + HSD (capped) on the same (prompt, seed) generations, interleaved,
    until every prompt was used and each verifier has >= ``min_rounds`` rounds. ``target`` / ``draft`` are
    runners."""

    check_sampled(temperature)
    if not prompts:
        raise UserError("no prompts")
    if max_new_tokens < 2:
        raise UserError(
            f"max_new_tokens={max_new_tokens}: the prefill emits the first token, so no verification "
            "round happens below 2"
        )
    sampling = SamplingParams(temperature)
    judges = make_judges()
    recorders = {name: RecordingVerifier(judges[name], judges) for name in VERIFIERS}
    algorithms = {
        name: build_algorithm("sps", target, draft, gamma=gamma, verifier=recorders[name]) for name in VERIFIERS
    }
    rounds = dict.fromkeys(VERIFIERS, 0)
    generations: list[Generation] = []
    idle = 0  # consecutive generations without a round (each ended at the prefill's EOS)
    while len(generations) < len(prompts) or min(rounds.values()) < min_rounds:
        i = len(generations)
        prompt = i % len(prompts)
        order = VERIFIERS if i % 2 == 0 else VERIFIERS[::-1]
        runs = {}
        for name in order:
            generator = torch.Generator().manual_seed(seed + i)
            result = algorithms[name].generate(
                list(prompts[prompt]),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                generator=generator,
                eos_ids=eos_ids,
            )
            records = recorders[name].take()
            _check_records(name, result.stats, records)
            runs[name] = Run(
                result.stats,
                result.tokens,
                sampling.temperature,
                {j: sum(e[j] for _, _, e in records) for j in JUDGES},
                sum(g < gamma for g, _, _ in records),
            )
            rounds[name] += result.stats.rounds
        generations.append(Generation(prompt, seed + i, {name: runs[name] for name in VERIFIERS}))
        idle = idle + 1 if all(run.stats.rounds == 0 for run in runs.values()) else 0
        if idle >= len(prompts):
            raise ValueError(f"{idle} generations in a row ended before any verification round (EOS first)")
        if progress is not None:
            progress(len(generations), rounds)
    return Comparison(generations, gamma, temperature)


def _check_records(name: str, stats: GenerationStats, records) -> None:
    """The wrapper saw exactly the rounds the engine counted (same number, same accepted-count histogram)."""
    hist = [0] * (max((acc for _, acc, _ in records), default=-1) + 1)
    for _, acc, _ in records:
        hist[acc] += 1
    if len(records) != stats.rounds or hist != stats.accepted_hist:
        raise RuntimeError(
            f"{name}: recorded rounds {hist} disagree with the engine's accepted_hist {stats.accepted_hist}"
        )


# --------------------------------------------------------------------------------------------------------
# Statistics (numpy only)
# --------------------------------------------------------------------------------------------------------


def bootstrap_weights(prompt_of: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """[resamples, generations] multiplicities of a two-stage bootstrap: prompts with replacement, then each drawn
    prompt's generations with replacement."""
    prompts = np.unique(prompt_of)
    weights = np.zeros((resamples, prompt_of.size))
    drawn = rng.integers(0, prompts.size, size=(resamples, prompts.size))
    for j, prompt in enumerate(prompts):
        members = np.flatnonzero(prompt_of == prompt)
        copies = (drawn == j).sum(axis=1) * members.size  # generation draws for this prompt, per resample
        rows = np.repeat(np.arange(resamples), copies)
        np.add.at(weights, (rows, members[rng.integers(0, members.size, size=rows.size)]), 1.0)
    return weights


def _ratio(weights: np.ndarray, num: np.ndarray, den: np.ndarray, num_ref: np.ndarray, den_ref: np.ndarray):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (weights @ num / (weights @ den)) / (weights @ num_ref / (weights @ den_ref))


def _interval(point: float, samples: np.ndarray) -> dict:
    samples = samples[np.isfinite(samples)]
    low, high = np.percentile(samples, [2.5, 97.5])
    return {
        "ratio": point,
        "ci95": [float(low), float(high)],
        "se": float(samples.std(ddof=1)),
        "resamples": int(samples.size),
    }


def _excess(weights: np.ndarray, pooled: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Uncapped's excess over capped on the same drafts: (E_unc − E_cap) / E_tokenwise (a ratio difference) and
    (E_unc − E_cap) / (E_unc − E_tokenwise) (the share of uncapped's gain over tokenwise that is lossy)."""
    unc, cap, tok = (weights @ pooled[j] for j in ("uncapped", "hsd", "tokenwise"))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (unc - cap) / tok, (unc - cap) / (unc - tok)


def summarize(comparison: Comparison, *, resamples: int = 10000, seed: int = 0) -> dict:
    """Per-verifier block efficiency, acceptance and histogram, the measured HSD/tokenwise ratio and the same-draft
    exact-expectation ratio, each with a 95 % two-stage bootstrap CI."""
    gens = comparison.generations
    prompt_of = np.array([g.prompt for g in gens])
    rounds = {n: np.array([g.runs[n].stats.rounds for g in gens], dtype=float) for n in VERIFIERS}
    emitted = {n: np.array([g.runs[n].emitted for g in gens], dtype=float) for n in VERIFIERS}
    # same-draft expectations: every round of both runs, judged by every rule
    pooled = {j: np.array([sum(g.runs[n].expected[j] for n in VERIFIERS) for g in gens]) for j in JUDGES}
    pooled_rounds = rounds["tokenwise"] + rounds["hsd"]

    weights = bootstrap_weights(prompt_of, resamples, np.random.default_rng(seed))
    ones = np.ones((1, len(gens)))
    measured = _ratio(ones, emitted["hsd"], rounds["hsd"], emitted["tokenwise"], rounds["tokenwise"])[0]
    boot = _ratio(weights, emitted["hsd"], rounds["hsd"], emitted["tokenwise"], rounds["tokenwise"])
    by_judge = {
        j: _interval(
            float(_ratio(ones, pooled[j], pooled_rounds, pooled["tokenwise"], pooled_rounds)[0]),
            _ratio(weights, pooled[j], pooled_rounds, pooled["tokenwise"], pooled_rounds),
        )
        for j in JUDGES
        if j != "tokenwise"
    }
    (excess,), (share,) = _excess(ones, pooled)
    excess_boot, share_boot = _excess(weights, pooled)

    verifiers = {}
    for name in VERIFIERS:
        total = comparison.total(name)
        own_expected = sum(g.runs[name].expected[name] for g in gens)
        verifiers[name] = {
            "generations": len(gens),
            "rounds": total.rounds,
            "trimmed_rounds": sum(g.runs[name].trimmed_rounds for g in gens),
            "block_efficiency": (total.accepted_draft_tokens + total.rounds) / max(total.rounds, 1),
            "block_efficiency_exact_e": own_expected / max(total.rounds, 1),
            "tau_engine": total.tau,
            "new_tokens": total.new_tokens,
            "acceptance_by_position": total.acceptance_by_position,
            "accepted_hist": list(total.accepted_hist),
            "temperature": comparison.temperature,
        }
    return {
        "gamma": comparison.gamma,
        "temperature": comparison.temperature,
        "prompts": int(np.unique(prompt_of).size),
        "generations": len(gens),
        "verifiers": verifiers,
        "measured": _interval(float(measured), boot),
        "same_draft_exact": by_judge["hsd"],
        "same_draft_exact_by_judge": by_judge,
        "pooled_rounds": int(pooled_rounds.sum()),
        "pooled_block_efficiency_exact_e": {j: float(pooled[j].sum() / max(pooled_rounds.sum(), 1)) for j in JUDGES},
        "lossy_excess": _interval(float(excess), excess_boot),
        "lossy_share_of_uncapped_gain": _interval(float(share), share_boot),
        "method": (
            f"percentile 95 % CI of a two-stage cluster bootstrap ({resamples} resamples, numpy seed {seed}): "
            "prompts with replacement, then each drawn prompt's generations with replacement; a generation "
            "carries both verifiers' runs (paired) and all its rounds"
        ),
    }


def verdict(interval: dict, goal: float = GOAL) -> str:
    """Where the 95 % CI lies against ``goal``."""
    low, high = interval["ci95"]
    if low >= goal:
        return f"met (95 % CI above {goal})"
    if high < goal:
        return f"not met (95 % CI below {goal})"
    return f"undecided (95 % CI contains {goal}; more rounds/prompts narrow it)"


def report(summary: dict, header: str, goal: float = GOAL) -> str:
    lines = [
        header,
        "",
        "| verifier | generations | rounds | BE (tokens/round) | BE exact-E | τ engine (incl. prefill) "
        "| γ-trimmed rounds | T |",
        "|---|---|---|---|---|---|---|---|",
    ]
    label = JUDGE_LABELS
    for name, v in summary["verifiers"].items():
        lines.append(
            f"| {label[name]} | {v['generations']} | {v['rounds']} | {v['block_efficiency']:.4f} "
            f"| {v['block_efficiency_exact_e']:.4f} | {v['tau_engine']:.4f} | {v['trimmed_rounds']} "
            f"| {v['temperature']:g} |"
        )
    m = summary["measured"]
    low, high = PAPER_BLOCKWISE_GAIN
    lines += [
        "",
        f"| HSD / tokenwise block efficiency | ratio | 95 % CI | bootstrap SE | goal >= {goal:g} |",
        "|---|---|---|---|---|",
        f"| measured (primary) | {m['ratio']:.4f} | [{m['ci95'][0]:.4f}, {m['ci95'][1]:.4f}] | {m['se']:.4f} "
        f"| {verdict(m, goal)} |",
    ]
    for judge, e in summary["same_draft_exact_by_judge"].items():
        note = verdict(e, goal) if judge != "uncapped" else "lossy: not a lossless figure"
        lines.append(
            f"| same-draft exact expectation, {JUDGE_LABELS[judge]} | {e['ratio']:.4f} | "
            f"[{e['ci95'][0]:.4f}, {e['ci95'][1]:.4f}] | {e['se']:.4f} | {note} |"
        )
    x, share = summary["lossy_excess"], summary["lossy_share_of_uncapped_gain"]
    lines += [
        "",
        f"Paper (HSD, GSM8K, γ = 10): lossless Blockwise ÷ tokenwise {low:.3f}–{high:.3f}.",
        f"Lossy part of the uncapped rule on the same drafts ({summary['pooled_rounds']} rounds judged): "
        f"(E_uncapped − E_capped) / E_tokenwise = {x['ratio']:+.4f} [{x['ci95'][0]:+.4f}, {x['ci95'][1]:+.4f}]; "
        f"share of uncapped's gain over tokenwise = {share['ratio']:.3f} [{share['ci95'][0]:.3f}, "
        f"{share['ci95'][1]:.3f}]. Block = capped on every round (checked).",
        "Exact expected tokens per round over the same rounds: "
        + ", ".join(f"{JUDGE_LABELS[j]} {be:.4f}" for j, be in summary["pooled_block_efficiency_exact_e"].items())
        + ".",
        "",
        f"CI method: {summary['method']}.",
    ]
    if summary["prompts"] < 10:
        lines.append(f"Note: only {summary['prompts']} prompt(s): the between-prompt variance is poorly estimated.")
    gamma = summary["gamma"]
    lines += [
        "",
        "Acceptance by draft position (accepted / judged):",
        "",
        "| verifier | " + " | ".join(f"pos {k + 1}" for k in range(gamma)) + " |",
        "|---|" + "---|" * gamma,
    ]
    for name, v in summary["verifiers"].items():
        acc = (v["acceptance_by_position"] + [0.0] * gamma)[:gamma]
        lines.append(f"| {label[name]} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    lines += [
        "",
        "Accepted-count histogram (rounds keeping n drafted tokens; share in brackets):",
        "",
        "| verifier | " + " | ".join(f"n={n}" for n in range(gamma + 1)) + " |",
        "|---|" + "---|" * (gamma + 1),
    ]
    for name, v in summary["verifiers"].items():
        hist = (v["accepted_hist"] + [0] * (gamma + 1))[: gamma + 1]
        total = max(sum(hist), 1)
        lines.append(f"| {label[name]} | " + " | ".join(f"{h} ({h / total:.3f})" for h in hist) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, HSDConfig, USAGE)


def run(argv: Sequence[str]) -> str:
    cfg = parse_args(argv)
    check_sampled(cfg.temperature)
    if not cfg.drafter:
        raise OverrideError("drafter=PATH is required (a draft-LM export directory)")
    if cfg.min_rounds < 1 or cfg.n_prompts < 1 or cfg.resamples < 100:
        raise OverrideError("min_rounds and n_prompts must be >= 1, resamples >= 100")

    kind = export_kind(Path(cfg.drafter))
    if kind not in (None, "draft_lm"):
        raise UserError(f"drafter '{cfg.drafter}' is a '{kind}' export; this benchmark needs a draft_lm")
    apply_threads(cfg)
    target = load_lm(cfg.target, device="cpu", max_seq_len=cfg.max_seq_len)
    draft = load_drafter("draft_lm", cfg.drafter, target, device="cpu", max_seq_len=cfg.max_seq_len)
    if cfg.draft_vocab:
        draft = with_logit_vocab(draft, cfg.draft_vocab)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    prompts = [ids for bench in cfg.bench for ids in load_bench_prompts(bench, target.tokenizer, cfg.n_prompts).ids]

    def progress(done: int, rounds: dict) -> None:
        if done % len(prompts) == 0:
            print(f"[hsd_block_efficiency] {done} generations, rounds {rounds}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    comparison = run_paired(
        target.runner,
        draft,
        prompts,
        gamma=cfg.gamma,
        temperature=cfg.temperature,
        seed=cfg.seed,
        min_rounds=cfg.min_rounds,
        max_new_tokens=cfg.max_new_tokens,
        eos_ids=eos,
        progress=progress,
    )
    summary = summarize(comparison, resamples=cfg.resamples, seed=cfg.seed)
    header = (
        f"{','.join(cfg.bench)}: {len(prompts)} prompts cycled over {summary['generations']} generations "
        f"(seeds {cfg.seed}..{cfg.seed + summary['generations'] - 1}), max_new_tokens={cfg.max_new_tokens}, "
        f"γ={cfg.gamma}, T={cfg.temperature:g}, target {cfg.target}, drafter {cfg.drafter}, "
        f"draft_vocab={cfg.draft_vocab or 'all'}, CPU {torch.get_num_threads()} thread(s), "
        f"{time.perf_counter() - start:.0f} s"
    )
    if cfg.out:
        record = {
            "config": OmegaConf.to_container(cfg),
            "summary": summary,
            "generations": [
                {
                    "prompt": g.prompt,
                    "seed": g.seed,
                    **{
                        n: {
                            "rounds": r.stats.rounds,
                            "emitted": r.emitted,
                            "new_tokens": r.stats.new_tokens,
                            "expected": r.expected,
                        }
                        for n, r in g.runs.items()
                    },
                }
                for g in comparison.generations
            ],
        }
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(record, indent=2, default=list) + "\n")
    return report(summary, header, cfg.goal)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, run, doc=__doc__, schema=HSDConfig, report=print)


if __name__ == "__main__":
    sys.exit(main())
