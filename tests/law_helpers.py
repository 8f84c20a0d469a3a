"""Monte Carlo law tests with shown power: the exact target law, a pooled chi-square test, its power against a
given wrong law, and the two bugs the tests must catch (resampling from p after a rejection, a wrong temperature).

A law test runs an algorithm ``runs`` times end to end and compares the counts of its first ``n`` tokens with the
target's law, enumerated exactly with the same warps (temperature, top-k, top-p). The test rejects at ``ALPHA``;
:func:`power` says how often it would reject when the tokens follow another law, from multinomial draws at the
same number of runs, so every law test can assert that it is able to fail.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

import inference.algorithms.self_draft as self_draft_module
import inference.match as match_module
import inference.verify as verify_module
from inference.sampling import SamplingParams, sample
from inference.verify import CandidateMatch

LAW_ROWS = 64  # requests side by side in a Monte Carlo law test of an algorithm on the engine loop
ALPHA = 1e-3  # small, so a correct algorithm fails about once in 500-1000 seeds (the pooled test's real size)
MIN_EXPECTED = 5.0  # outcomes expected fewer times are pooled into one cell (the chi-square approximation holds)

Law = dict[tuple[int, ...], float]


@torch.no_grad()
def enumerated_law(model, prompt: Sequence[int], n: int, sampling: SamplingParams) -> Law:
    """P(first ``n`` new tokens = s) under the HF ``model`` with ``sampling``'s warps, over every s in V^n, from one
    batched forward over all V^(n-1) continuations of the prompt."""
    vocab = model.config.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=n - 1))
    ids = torch.tensor([list(prompt) + list(prefix) for prefix in prefixes])
    probs = sampling.warp(model(ids).logits.double())[:, len(prompt) - 1 :]  # [V^(n-1), n, V]
    law: Law = {}
    for row, prefix in enumerate(prefixes):
        weight = 1.0
        for i, token in enumerate(prefix):
            weight *= float(probs[row, i, token])
        for token in range(vocab):
            p = weight * float(probs[row, n - 1, token])
            if p > 0:
                law[prefix + (token,)] = p
    return law


def sampled_counts(
    algorithm, prompt: Sequence[int], n: int, runs: int, sampling: SamplingParams, seed: int = 1234
) -> tuple[dict[tuple[int, ...], int], int]:
    """Counts of the first ``n`` tokens over ``runs`` seeded generations, and the drafted tokens accepted. An
    algorithm on the engine loop whose target runner holds ``2 * LAW_ROWS`` rows answers ``LAW_ROWS`` requests side
    by side (``generate_batch``): then the law checked is that of a row in a batch."""
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    rows = LAW_ROWS if algorithm.batchable and algorithm.target.max_batch_size >= 2 * LAW_ROWS else 1
    for start in range(0, runs, rows):
        kw = {"max_new_tokens": n, "sampling": sampling, "generator": generator}
        results = (
            algorithm.generate_batch([list(prompt)] * min(rows, runs - start), **kw)
            if rows > 1
            else [algorithm.generate(list(prompt), **kw)]
        )
        for result in results:
            key = tuple(result.tokens)
            counts[key] = counts.get(key, 0) + 1
            accepted += result.stats.accepted_draft_tokens
    return counts, accepted


def batched_counts(
    algorithm,
    prompt: Sequence[int],
    n: int,
    runs: int,
    sampling: SamplingParams,
    seed: int = 1234,
    rows: int | None = None,
) -> tuple[dict[tuple[int, ...], int], int]:
    """``sampled_counts`` for an algorithm with ``generate_batch`` (SSD, the engine loop's): the ``runs``
    generations side by side, ``rows`` at a time (None: all in one batch)."""
    generator = torch.Generator().manual_seed(seed)
    rows = rows or runs
    results = [
        result
        for start in range(0, runs, rows)
        for result in algorithm.generate_batch(
            [list(prompt)] * min(rows, runs - start), max_new_tokens=n, sampling=sampling, generator=generator
        )
    ]
    counts: dict[tuple[int, ...], int] = {}
    for result in results:
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
    return counts, sum(result.stats.accepted_draft_tokens for result in results)


class PooledChiSquare:
    """Pearson's chi-square against ``law`` for ``runs`` outcomes: cells expected fewer than MIN_EXPECTED times
    are pooled into one; an outcome the law gives probability 0 rejects outright."""

    def __init__(self, law: Law, runs: int):
        outcomes = sorted(law, key=law.get, reverse=True)
        self.runs = runs
        self.common = [s for s in outcomes if law[s] * runs >= MIN_EXPECTED]
        self.rare = [s for s in outcomes if law[s] * runs < MIN_EXPECTED]
        expected = [law[s] for s in self.common] + ([sum(law[s] for s in self.rare)] if self.rare else [])
        self.probs = np.array(expected)
        self.index = {s: i for i, s in enumerate(self.common)} | {s: len(self.common) for s in self.rare}
        self.dof = len(self.probs) - 1
        self.critical = chi2_quantile(1 - ALPHA, self.dof)

    def cells(self, counts: dict[tuple[int, ...], int]) -> np.ndarray | None:
        """Counts per cell, or None when an impossible outcome occurred."""
        cells = np.zeros(len(self.probs))
        for outcome, count in counts.items():
            if outcome not in self.index:
                return None
            cells[self.index[outcome]] += count
        return cells

    def statistic(self, cells: np.ndarray) -> np.ndarray:
        expected = self.runs * self.probs
        return (((cells - expected) ** 2) / expected).sum(axis=-1)

    def rejects(self, counts: dict[tuple[int, ...], int]) -> bool:
        cells = self.cells(counts)
        return cells is None or float(self.statistic(cells)) > self.critical

    def describe(self, counts: dict[tuple[int, ...], int]) -> str:
        cells = self.cells(counts)
        if cells is None:
            return "an outcome of probability 0 occurred"
        return f"chi2 {float(self.statistic(cells)):.1f} vs critical {self.critical:.1f} ({self.dof} dof)"

    def _cell_probs(self, other: Law) -> np.ndarray:
        """``other`` on this test's cells, plus a last cell for the outcomes ``law`` calls impossible."""
        probs = np.zeros(len(self.probs) + 1)
        for outcome, p in other.items():
            probs[self.index.get(outcome, len(self.probs))] += p
        return probs / probs.sum()

    def _power(self, probs: np.ndarray, draws: int, seed: int) -> float:
        cells = np.random.default_rng(seed).multinomial(self.runs, probs, size=draws)
        rejected = (cells[:, -1] > 0) | (self.statistic(cells[:, :-1]) > self.critical)
        return float(rejected.mean())

    def power(self, other: Law, draws: int = 4000, seed: int = 0) -> float:
        """P(this test rejects) when the ``runs`` outcomes follow ``other`` instead, from ``draws`` multinomial
        draws."""
        return self._power(self._cell_probs(other), draws, seed)

    def estimated_power(self, counts: dict[tuple[int, ...], int], draws: int = 4000, seed: int = 0) -> float:
        """The power against the law ``counts`` (``runs`` draws of it) were drawn from, estimated without counting
        their sampling noise as an effect: the observed cell frequencies are shrunk towards ``law`` until their
        chi-square distance is the unbiased estimate (raw frequencies lie farther away by about dof / runs)."""
        observed = np.zeros(len(self.probs) + 1)
        for outcome, count in counts.items():
            observed[self.index.get(outcome, len(self.probs))] += count
        freq, law = observed / self.runs, np.append(self.probs, 0.0)
        if freq[-1] > 0:  # an impossible outcome: its cell alone rejects, keep the frequencies as they are
            return self._power(freq, draws, seed)
        raw = float((((freq - law) ** 2)[:-1] / self.probs).sum())
        noise = float((freq * (1 - freq))[:-1].dot(1 / self.probs)) / self.runs
        scale = np.sqrt(max(raw - noise, 0.0) / raw) if raw > 0 else 0.0
        return self._power(law + scale * (freq - law), draws, seed)


def chi2_quantile(q: float, dof: int) -> float:
    """The q-quantile of chi-square(dof), by bisection on torch's regularised incomplete gamma function."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        below = float(
            torch.special.gammainc(
                torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(mid / 2, dtype=torch.float64)
            )
        )
        lo, hi = (mid, hi) if below < q else (lo, mid)
    return (lo + hi) / 2


def temperature_changed(sampling: SamplingParams, temperature: float) -> SamplingParams:
    return SamplingParams(temperature, sampling.top_k, sampling.top_p)


# -- the resample-from-p bug, injected into every verifier -------------------------------------------------------


def _multi_candidate_resampling_from_p(candidates, target_probs, generator=None) -> CandidateMatch:
    """The deterministic-candidate rule with the bug: when z ~ p matches no candidate, emit a fresh draw from p
    (which may be a rejected candidate) instead of z (a draw from p with the candidates removed)."""
    token = int(sample(target_probs, generator).item())
    candidate_tokens = [int(c) for c in candidates]
    if token in candidate_tokens:
        return CandidateMatch(candidate_tokens.index(token), token)
    return CandidateMatch(None, int(sample(target_probs, generator).item()))


def law_resampling_from_p(law: Law, candidates: dict[int, Sequence[int]]) -> Law:
    """The law of a two-token window under the resample-from-p bug, where the first token is drawn from the target
    and the second by the deterministic-candidate rule among ``candidates[first]`` (a tree's root children): a
    candidate c keeps p(c) and gains (1 - p(C)) p(c) from the fresh draw after a miss; any other token t gets
    (1 - p(C)) p(t). ``law``: the target's law of the window (:func:`enumerated_law` with ``n`` = 2)."""
    first = {}
    for (t1, _), p in law.items():
        first[t1] = first.get(t1, 0.0) + p
    missed = {t1: 1.0 - sum(law.get((t1, c), 0.0) for c in candidates[t1]) / first[t1] for t1 in first}
    return {(t1, t2): p * ((t2 in candidates[t1]) + missed[t1]) for (t1, t2), p in law.items()}


def inject_resample_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a rejection every verifier samples from the target's p instead of the residual: the chain rules
    (tokenwise, block/HSD, SSD's batched tokenwise) through their residual, and the deterministic-candidate rule
    wherever an algorithm calls it (tree walks, SpecBranch's Match, Self-Draft's walk)."""
    monkeypatch.setattr(verify_module, "_normalise_or", lambda mass, fallback: fallback)
    for module in (verify_module, match_module, self_draft_module):
        monkeypatch.setattr(module, "multi_candidate", _multi_candidate_resampling_from_p)


BugInjector = Callable[[pytest.MonkeyPatch], None]


def exact_target_law(model, prompt: list[int], n: int, vocab: int) -> dict[tuple[int, ...], float]:
    """P(first n new tokens = s) under the target at T=1, by enumeration over V^n."""
    law = {}
    for seq in itertools.product(range(vocab), repeat=n):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            probs = model(ids).logits[0].double().softmax(-1)
        p = 1.0
        for i, token in enumerate(seq):
            p *= float(probs[len(prompt) - 1 + i, token])
        law[seq] = p
    return law


def sampled_law(algorithm, prompt: list[int], n: int, runs: int, seed: int = 1234) -> tuple[dict, int]:
    """Empirical law of the first ``n`` tokens over ``runs`` T=1 generations, and the draft tokens accepted. An
    algorithm on the engine loop whose runners hold ``2 * LAW_ROWS`` rows answers ``LAW_ROWS`` requests side by side
    (``generate_batch``): then the law checked is that of a row in a batch."""
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    rows = LAW_ROWS if algorithm.batchable and algorithm.target.max_batch_size >= 2 * LAW_ROWS else 1
    for start in range(0, runs, rows):
        kw = {"max_new_tokens": n, "sampling": SamplingParams(1.0), "generator": generator}
        results = (
            algorithm.generate_batch([prompt] * min(rows, runs - start), **kw)
            if rows > 1
            else [algorithm.generate(prompt, **kw)]
        )
        for result in results:
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
            accepted += result.stats.accepted_draft_tokens
    return counts, accepted


def assert_follows_law(counts: dict, law: dict, runs: int, max_tv: float) -> None:
    """Chi-square within 6 sd of its mean (beyond p = 1e-6 for an exact rule; a biased one lands far above) and
    total variation below ``max_tv``."""
    chi2 = sum((counts.get(s, 0) - runs * p) ** 2 / (runs * p) for s, p in law.items() if runs * p > 0)
    dof = len(law) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2
    tv = 0.5 * sum(abs(counts.get(s, 0) / runs - p) for s, p in law.items())
    assert tv < max_tv, tv
