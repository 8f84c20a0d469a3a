"""``python -m benchmarks.ssd_recall eval=DIR/results.json drafter=DIR [target=smollm2] [dtype=bf16] [threads=1]
[out=FILE.json]``

Is SSD's cache hit rate at T = 0 what the drafter's recall allows? For every greedy SSD run of an
``inference.evaluate`` results file, this compares the engine's ``cache_hit_rate_by_k`` with the rate predicted
from teacher forcing on the same prompts (the evaluate run's bench, n_prompts and max_new_tokens):

1. The target answers each prompt greedily (AR; SSD's greedy output is the same tokens, evaluate checks it).
2. The drafter reads prompt + answer in one teacher-forced forward. At every answer position i it gives the
   scores of the next token; ``a_i`` is its argmax over the ids it may propose (``< draft_vocab``): the token SSD
   drafts there at T = 0, given the target's prefix.
3. A lookup at acceptance length k < K hits iff the target's token y is among the top F_k fork guesses, which
   exclude the drafted token: "y in the draft's ranks 2..F_k+1 given a rank-1 miss". At k = K (every draft token
   accepted) nothing is excluded: y in ranks 1..F_K. The ranking is over the whole vocabulary for
   ``fork_vocab=full`` and over ids < draft_vocab for ``fork_vocab=draft`` (a y beyond it never hits).
4. F_k is read from the engine: ``cache_lookup_fanout_by_k`` counts, per k, the fan-out each looked-up cache was
   built with (the geometric vector follows an acceptance EMA); the predicted rate weighs those F values.

Two predictions per k: "all misses" averages over every answer position where the drafter's top-1 is wrong (k < K)
or every position (k = K) — the plain teacher-forced recall; "SSD's lookups" replays SSD's rounds on the answer
(at T = 0 they are determined: a round starting after position b accepts the leading k <= K positions whose
a_i = y_i, then looks up (k, y_{b+k+1})) and averages over exactly the positions the engine looked up. The
replay's lookup counts per k should match the engine's; a gap between the engine and the replayed prediction then
comes only from numerics (the engine drafts incrementally and in tree batches, bf16 near-ties can flip). Also
reported: the share of target tokens with id >= draft_vocab (a bonus the capped head can never propose, so never
a hit under ``fork_vocab=draft``), over all positions, rank-1 misses and the replayed lookups, beside the engine's
own count of such lookups.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.config import BenchConfig, Drafter, Output, SeqLen, parse_bench
from core.atomic import atomic_write_text
from core.errors import UserError
from core.overrides import OverrideError, run_cli
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_drafter, load_lm, model_dtype
from inference.evaluate import load_bench_prompts
from inference.sampling import SamplingParams

USAGE = "python -m benchmarks.ssd_recall eval=DIR/results.json drafter=DIR dtype=bf16 threads=1 out=FILE.json"
NEVER = 1 << 30  # rank of a token the fork ranking cannot contain


@dataclass
class RecallConfig(BenchConfig, Output, SeqLen, Drafter):
    """``drafter``: the draft LM those runs served (unlimited: draft_vocab is read from each run); ``out``: FILE.json
    (optional)."""

    eval: str | None = None  # an inference.evaluate results.json with greedy ssd runs
    # the evaluate run's own unless given (so not the shared target= and dtype=, whose defaults are fixed)
    target: str | None = None
    dtype: str | None = None
    runs: list[str] = field(default_factory=list)  # ssd run labels to compare; empty = every greedy ssd run


# --------------------------------------------------------------------------------------------------------
# Teacher-forced ranks (pure functions of the drafter's scores)
# --------------------------------------------------------------------------------------------------------


def _rank(scores: torch.Tensor, truth: torch.Tensor, excluded: torch.Tensor | None) -> torch.Tensor:
    """0-based rank of ``truth`` [n] in each row of ``scores`` [n, V] (ties broken toward the lower id), with the
    id ``excluded`` [n] (if given) removed from the ranking; NEVER where the truth is the excluded id or scores -inf."""
    ids = torch.arange(scores.shape[-1])
    s_true = scores.gather(-1, truth[:, None])
    ahead = (scores > s_true) | ((scores == s_true) & (ids[None] < truth[:, None]))
    if excluded is not None:
        ahead &= ids[None] != excluded[:, None]
    rank = ahead.sum(-1)
    never = torch.isinf(s_true[:, 0]) & (s_true[:, 0] < 0)
    if excluded is not None:
        never |= truth == excluded
    return torch.where(never, torch.full_like(rank, NEVER), rank)


def position_ranks(scores: torch.Tensor, answer: Sequence[int], draft_vocab: int) -> dict[str, torch.Tensor]:
    """Per answer position: the target token ``y``, the drafter's proposal ``a`` (argmax over ids < draft_vocab;
    0 = every id) and y's rank among the fork guesses, for both fork vocabularies: ``excl_*`` with ``a`` removed
    (a lookup at k < K), ``incl_*`` without (k = K). ``scores`` [n, V] are the drafter's full-head scores."""
    scores = scores.float()
    vocab = scores.shape[-1]
    limit = draft_vocab or vocab
    capped = scores.clone()
    capped[:, limit:] = float("-inf")
    y = torch.tensor(list(answer), dtype=torch.long)
    a = capped.argmax(-1)
    return {
        "y": y,
        "a": a,
        "outside": y >= limit,
        "excl_full": _rank(scores, y, a),
        "excl_draft": _rank(capped, y, a),
        "incl_full": _rank(scores, y, None),
        "incl_draft": _rank(capped, y, None),
    }


def replay_lookups(match: Sequence[bool], k_max: int) -> list[tuple[int, int]]:
    """SSD's lookups on a greedy answer of ``len(match)`` tokens: ``match[i]`` says whether the drafter's proposal
    at position i is the target's token. The prefill emits position 0; a round whose pending bonus is position b
    accepts the leading k <= K matches among b+1.., emits b+1..b+k+1, and the next round looks up (k, position
    b+k+1) unless the answer is complete by then. Returns [(k, position)]."""
    n, b, lookups = len(match), 0, []
    while b + 1 < n:
        k = 0
        while k < k_max and b + 1 + k < n and match[b + 1 + k]:
            k += 1
        nxt = b + k + 1
        if nxt + 1 >= n:  # the answer is complete after this round: no next lookup
            break
        lookups.append((k, nxt))
        b = nxt
    return lookups


def _recall(ranks: torch.Tensor, fans: dict[int, int]) -> float:
    """Mean over positions of P(rank < F) with F drawn from the fan-out histogram ``fans`` {F: count}."""
    total = sum(fans.values())
    if ranks.numel() == 0 or total == 0:
        return float("nan")
    return sum(count * float((ranks < f).double().mean()) for f, count in fans.items()) / total


def predict(
    ranks: list[dict[str, torch.Tensor]], k_max: int, fork_vocab: str, fanout_by_k: Sequence[dict[int, int]]
) -> dict:
    """Teacher-forced hit-rate predictions per k for one SSD configuration over every prompt's ranks."""
    mode = "full" if fork_vocab == "full" else "draft"
    cat = {key: torch.cat([r[key][1:] for r in ranks]) for key in ranks[0]}  # position 0 is the prefill's token
    miss = cat["y"] != cat["a"]
    replayed: list[list[tuple[int, int]]] = []
    for r in ranks:
        replayed.append(replay_lookups((r["y"] == r["a"]).tolist(), k_max))
    all_misses, at_lookups, lookups_by_k, outside_at_lookups = [], [], [0] * (k_max + 1), 0
    n_lookups = sum(len(x) for x in replayed)
    for k in range(k_max + 1):
        fans = {int(f): c for f, c in fanout_by_k[k].items()} if k < len(fanout_by_k) else {}
        key = f"excl_{mode}" if k < k_max else f"incl_{mode}"
        all_misses.append(_recall(cat[key][miss] if k < k_max else cat[key], fans))
        at_k = [r[key][i] for r, lookups in zip(ranks, replayed) for kk, i in lookups if kk == k]
        lookups_by_k[k] = len(at_k)
        at_lookups.append(_recall(torch.stack(at_k) if at_k else torch.empty(0, dtype=torch.long), fans))
    for r, lookups in zip(ranks, replayed):
        outside_at_lookups += sum(bool(r["outside"][i]) for _, i in lookups)
    # the replay's overall prediction: every replayed lookup weighed alike
    overall = sum(p * n for p, n in zip(at_lookups, lookups_by_k) if n) / max(n_lookups, 1)
    return {
        "fork_vocab": fork_vocab,
        "all_misses_by_k": all_misses,
        "replayed_by_k": at_lookups,
        "replayed_lookups_by_k": lookups_by_k,
        "replayed_hit_rate": overall,
        "replayed_lookups_outside_draft_vocab": outside_at_lookups,
    }


def recall_curve(ranks: list[dict[str, torch.Tensor]], max_f: int) -> dict[str, list[float]]:
    """P(y in the top F fork guesses | the drafter's top-1 missed), F = 1..max_f, for both fork vocabularies."""
    cat = {key: torch.cat([r[key][1:] for r in ranks]) for key in ranks[0]}
    miss = cat["y"] != cat["a"]
    return {
        mode: [
            float((cat[f"excl_{mode}"][miss] < f).double().mean()) if bool(miss.any()) else float("nan")
            for f in range(1, max_f + 1)
        ]
        for mode in ("full", "draft")
    }


def vocab_shares(ranks: list[dict[str, torch.Tensor]], max_f: int = 8) -> dict:
    """How many target tokens lie beyond the drafter's vocabulary limit, and how the drafter's whole head ranks
    them where its top-1 missed (what ``fork_vocab=full`` can gain): recall at F = 1..max_f and the median fan-out
    a fork would need to guess them."""
    cat = {key: torch.cat([r[key][1:] for r in ranks]) for key in ranks[0]}
    miss = cat["y"] != cat["a"]
    out_ranks = cat["excl_full"][miss & cat["outside"]]
    return {
        "positions": int(cat["y"].numel()),
        "rank1_misses": int(miss.sum()),
        "outside_positions": int(cat["outside"].sum()),
        "outside_share_all": float(cat["outside"].double().mean()),
        "outside_share_of_misses": float(cat["outside"][miss].double().mean()) if bool(miss.any()) else 0.0,
        "outside_full_recall_given_miss": [
            float((out_ranks < f).double().mean()) if out_ranks.numel() else float("nan") for f in range(1, max_f + 1)
        ],
        # the fan-out a fork at that position would need to guess it (1 = the first guess)
        "outside_full_median_f_needed": int(out_ranks.median()) + 1 if out_ranks.numel() else None,
        "top1_agreement": float((~miss).double().mean()),
    }


# --------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced_scores(draft, prompt: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
    """The drafter's whole-vocabulary scores [len(answer), V]: row i predicts answer[i] from prompt + answer[:i]."""
    draft.reset(1)
    ids = torch.tensor([list(prompt) + list(answer[:-1])], device=draft.device)
    return draft.forward(ids).logits[0, len(prompt) - 1 :].float().cpu()


def greedy_answers(
    target, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int]
) -> list[list[int]]:
    ar = build_algorithm("ar", target)
    return [
        ar.generate(list(p), max_new_tokens=max_new_tokens, sampling=SamplingParams(0.0), eos_ids=eos).tokens
        for p in prompts
    ]


def ssd_runs(results: dict, labels: Sequence[str] = ()) -> list[dict]:
    """The greedy SSD runs of an evaluate results dict that carry the lookup fan-out counters."""
    runs = [
        r
        for r in results["runs"]
        if r["algorithm"].split("@")[0] == "ssd"
        and r.get("temperature", 0) == 0
        and "cache_lookup_fanout_by_k" in r
        and (not labels or r["algorithm"] in labels)
    ]
    if not runs:
        raise UserError(
            "no greedy ssd run with cache_lookup_fanout_by_k in the results (evaluate an ssd variant "
            "at temperature=0 with this code)"
        )
    return runs


def compare(run: dict, ranks_by_vocab: dict[int, list[dict[str, torch.Tensor]]]) -> dict:
    """One SSD run of an evaluate results file against the teacher-forced predictions."""
    k_max, vocab, fork = run["ssd_lookahead"], run["draft_vocab"], run["fork_vocab"]
    ranks = ranks_by_vocab[vocab]
    pred = predict(ranks, k_max, fork, run["cache_lookup_fanout_by_k"])
    engine = run["cache_hit_rate_by_k"]
    lookups = run["cache_lookups_by_k"]
    gaps = [None if e is None or p != p else round(e - p, 4) for e, p in zip(engine, pred["replayed_by_k"])]
    weighted = [abs(g) * n for g, n in zip(gaps, lookups) if g is not None]
    hits = sum(round((rate or 0.0) * n) for rate, n in zip(engine, lookups))
    outside, outside_hits = run.get("cache_lookups_outside_draft_vocab"), run.get("cache_hits_outside_draft_vocab")
    return {
        "algorithm": run["algorithm"],
        "lookahead": k_max,
        "budget": run["ssd_budget"],
        "draft_vocab": vocab,
        "fork_vocab": fork,
        "fanout_hit": run.get("fanout_hit"),
        "greedy_equal_to_ar": run.get("greedy_equal_to_ar"),
        "tau": run.get("tau"),
        "engine_hit_rate": run["cache_hit_rate"],
        "engine_hit_rate_by_k": engine,
        "engine_lookups_by_k": lookups,
        "engine_lookup_fanout_by_k": run["cache_lookup_fanout_by_k"],
        "engine_lookups_outside_draft_vocab": run.get("cache_lookups_outside_draft_vocab"),
        "engine_hits_outside_draft_vocab": outside_hits,
        # the hit rate over the lookups whose bonus the drafter can propose (id < draft_vocab)
        "engine_hit_rate_inside_draft_vocab": None
        if outside is None or sum(lookups) == outside
        else (hits - outside_hits) / (sum(lookups) - outside),
        **pred,
        "engine_minus_replayed_by_k": gaps,
        "mean_abs_gap_per_lookup": sum(weighted) / max(sum(n for g, n in zip(gaps, lookups) if g is not None), 1),
    }


def measure(cfg) -> dict:
    if not cfg.eval or not cfg.drafter:
        raise OverrideError(f"eval=FILE and drafter=DIR are required; usage: {USAGE}")
    results = json.loads(Path(cfg.eval).read_text())
    ecfg = results["config"]
    runs = ssd_runs(results, cfg.runs)
    apply_threads(cfg)
    dtype = cfg.dtype or ecfg.get("dtype", "auto")
    target_name = cfg.target or ecfg["target"]
    start = time.perf_counter()
    target = load_lm(target_name, device="cpu", max_seq_len=cfg.max_seq_len, dtype=model_dtype(dtype, "cpu"))
    draft = load_drafter("draft_lm", cfg.drafter, target, device="cpu", max_seq_len=cfg.max_seq_len)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    benches = ecfg["bench"] if isinstance(ecfg["bench"], list) else [ecfg["bench"]]
    if len(benches) != 1:
        raise UserError(f"the evaluate run has benches {benches}: compare one bench at a time")
    prompts = load_bench_prompts(benches[0], target.tokenizer, ecfg["n_prompts"]).ids
    answers = greedy_answers(target.runner, prompts, ecfg["max_new_tokens"], eos)
    scores = [teacher_forced_scores(draft, p, a) for p, a in zip(prompts, answers)]
    ranks_by_vocab = {
        v: [position_ranks(s, a, v) for s, a in zip(scores, answers)] for v in sorted({r["draft_vocab"] for r in runs})
    }
    max_f = max([1] + [int(f) for r in runs for fans in r["cache_lookup_fanout_by_k"] for f in fans])
    return {
        "eval": cfg.eval,
        "drafter": cfg.drafter,
        "target": target_name,
        "dtype": dtype,
        "bench": benches[0],
        "n_prompts": len(prompts),
        "max_new_tokens": ecfg["max_new_tokens"],
        "answer_tokens": sum(len(a) for a in answers),
        "seconds": round(time.perf_counter() - start, 1),
        "by_draft_vocab": {
            str(v): {**vocab_shares(r, max_f), "recall_given_miss": recall_curve(r, max_f)}
            for v, r in ranks_by_vocab.items()
        },
        "runs": [compare(r, ranks_by_vocab) for r in runs],
    }


def _fmt(x) -> str:
    return "–" if x is None or x != x else f"{x:.3f}"


def report(result: dict) -> str:
    lines = [
        f"{result['bench']}: {result['n_prompts']} prompts, {result['answer_tokens']} greedy answer tokens of "
        f"{result['target']} ({result['dtype']}), drafter {result['drafter']}, {result['seconds']} s",
        "",
    ]
    for vocab, v in result["by_draft_vocab"].items():
        lines.append(
            f"draft_vocab={vocab}: top-1 agreement {v['top1_agreement']:.3f}; target ids >= draft_vocab: "
            f"{v['outside_share_all']:.3f} of {v['positions']} positions, {v['outside_share_of_misses']:.3f} "
            f"of {v['rank1_misses']} rank-1 misses"
        )
        if v["outside_positions"]:
            lines.append(
                f"  the drafter's whole head on the {v['outside_positions']} target ids >= draft_vocab where "
                f"its top-1 missed: in ranks 2..F+1 for F = 1..{len(v['outside_full_recall_given_miss'])}: "
                + " ".join(f"{c:.3f}" for c in v["outside_full_recall_given_miss"])
                + f"; median F needed {v['outside_full_median_f_needed']}"
            )
        for mode, curve in v["recall_given_miss"].items():
            lines.append(
                f"  P(target in ranks 2..F+1 | rank-1 miss), {mode} vocab, F = 1..{len(curve)}: "
                + " ".join(f"{c:.3f}" for c in curve)
            )
    for run in result["runs"]:
        k_max = run["lookahead"]
        lines += [
            "",
            f"{run['algorithm']} (K = {k_max}, B = {run['budget']}, fork_vocab={run['fork_vocab']}, "
            f"final fan-out {run['fanout_hit']}; greedy = AR: {run['greedy_equal_to_ar']}): engine hit rate "
            f"{_fmt(run['engine_hit_rate'])}, replayed prediction {_fmt(run['replayed_hit_rate'])}; lookups of "
            f"a bonus id >= draft_vocab: engine {run['engine_lookups_outside_draft_vocab']} "
            f"({run['engine_hits_outside_draft_vocab']} hits), replay "
            f"{run['replayed_lookups_outside_draft_vocab']}; engine hit rate on the other lookups "
            f"{_fmt(run['engine_hit_rate_inside_draft_vocab'])}",
            "",
            "| k | engine lookups | replayed lookups | F_k at lookup (F: count) | engine hit rate | "
            "teacher-forced, SSD's lookups | teacher-forced, all misses | engine − replayed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k in range(k_max + 1):
            fans = ", ".join(f"{f}: {c}" for f, c in run["engine_lookup_fanout_by_k"][k].items())
            gap = run["engine_minus_replayed_by_k"][k]
            lines.append(
                f"| {k}{' (= K)' if k == k_max else ''} | {run['engine_lookups_by_k'][k]} | "
                f"{run['replayed_lookups_by_k'][k]} | {fans} | {_fmt(run['engine_hit_rate_by_k'][k])} | "
                f"{_fmt(run['replayed_by_k'][k])} | {_fmt(run['all_misses_by_k'][k])} | "
                f"{'–' if gap is None else f'{gap:+.3f}'} |"
            )
        lines.append(f"Mean |engine − replayed| per lookup: {run['mean_abs_gap_per_lookup']:.3f}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, RecallConfig, USAGE)


def run(argv: Sequence[str]) -> str:
    cfg = parse_args(argv)
    result = measure(cfg)
    if cfg.out:
        atomic_write_text(Path(cfg.out), json.dumps(result, indent=2) + "\n")
    return report(result)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, run, doc=__doc__, schema=RecallConfig, report=print)


if __name__ == "__main__":
    sys.exit(main())
