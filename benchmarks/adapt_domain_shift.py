"""Serving-time adaptation on a domain shift: a feature drafter's tree with ``adapt=none`` vs ``adapt=bandit``, greedy.

    python benchmarks/adapt_domain_shift.py drafter=DIR [algorithm=eagle3_tree] [target=smollm2] [n_prompts=6]
        [max_new_tokens=128] [streams=[shift,in_domain]] [threads=1] [block=1] [out=runs/adapt_domain_shift]
        [key=value of adapt_*]

``algorithm``: ``eagle3_tree`` (an EAGLE-3 export; tree ``tree_depth``/``tree_topk``/``tree_total``) or
``specblock_tree`` (a SpecBlock export; tree ``specblock_width``/``specblock_budget``).

Streams: ``shift`` = n_prompts HumanEval prompts then n_prompts GSM-symbolic prompts (a drafter trained on
ShareGPT sees code, then math); ``in_domain`` = 2 n_prompts held-out ShareGPT prompts (the ``eval`` split). Each
mode loads a FRESH drafter (the bandit updates its copy in place); both serve the stream in order, interleaved in
blocks of ``block`` prompts (default 1) in ABBA order so machine load hits both alike; one process, ``threads``
threads (one by default). Reported per run: τ (new tokens per target forward), accept length per round,
tokens/s over the whole stream with every update's time included (updates run inside ``generate``; with
``adapt_background=true`` on a worker thread: a
wait for it counts, and so does finishing it before an ``adapt=none`` query starts, which it must not slow;
``close_s`` is the wait for the last query's work, which serves no token), the number of updates / rollbacks,
and whether the
tokens equal those of ``adapt=none`` (they must: the verifier is untouched). The start-up cost measurement is
reported separately (cached across runs). Per-query decisions: ``out/<stream>/decisions.csv`` and ``tau.png``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Drafter, Output, Target, Workload, parse_bench, renamed, run_dir, split_own
from core.drafters.eagle3.kind import load_eagle3
from core.drafters.specblock.kind import load_specblock
from core.errors import UserError
from core.overrides import OverrideError, split_key_values
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_lm
from inference.sampling import SamplingParams
from spectrain.adapt.adapter import AdaptSettings
from spectrain.adapt.log import plot_tau

USAGE = __doc__.splitlines()[2].strip()
OLD_SPELLINGS = {"n": "n_prompts"}


@dataclass
class ShiftConfig(BenchConfig, Output, Target, Drafter, Workload):
    """``n_prompts``: prompts per domain; ``out``: a directory (default runs/adapt_domain_shift)."""

    streams: list[str] = field(default_factory=lambda: ["shift", "in_domain"])
    tree_depth: int = 4  # a small tree: CPU verification cost grows with tree_total
    tree_topk: int = 4
    tree_total: int = 16
    max_prompt_tokens: int = 384  # longer prompts are skipped (CPU time)
    block: int = 1  # prompts a mode serves in a row before the other takes over (ABBA order over blocks)
    algorithm: str = "eagle3_tree"  # eagle3_tree | specblock_tree (the drafter's kind)
    specblock_width: int = 4  # specblock_tree: the CPU tree (16 nodes), as the GSM pipeline's fastest setting
    specblock_budget: int = 16


def stream_prompts(name: str, n: int, tokenizer, max_tokens: int) -> list[tuple[str, list[int]]]:
    sources = {"shift": [("humaneval", "all"), ("gsm_symbolic", "all")], "in_domain": [("sharegpt", "eval")]}
    if name not in sources:
        raise UserError(f"unknown stream '{name}'; use shift or in_domain")
    prompts = []
    for source, split in sources[name]:
        want = n * (2 if name == "in_domain" else 1)
        kept = []
        for conversation in load_prompts(source, n=8 * want, split=split):
            ids = render_prompt(tokenizer, prompt_turns(conversation))
            if len(ids) <= max_tokens:
                kept.append((source, ids))
            if len(kept) == want:
                break
        prompts += kept
    return prompts


TREE_ALGORITHMS = ("eagle3_tree", "specblock_tree")


def _build(cfg: ShiftConfig, target, adapt: str, settings: AdaptSettings | None):
    # fresh weights per run: the bandit updates its copy in place
    if cfg.algorithm == "specblock_tree":
        drafter = load_specblock(cfg.drafter, target)
        shape = dict(width=cfg.specblock_width, budget=cfg.specblock_budget)
    else:
        drafter = load_eagle3(cfg.drafter, target)
        shape = dict(tree_depth=cfg.tree_depth, tree_topk=cfg.tree_topk, tree_total=cfg.tree_total)
    start = time.perf_counter()
    algorithm = build_algorithm(cfg.algorithm, target.runner, drafter, adapt=adapt, adapt_settings=settings, **shape)
    return algorithm, time.perf_counter() - start


def interleaved(n: int, block: int) -> list[tuple[int, str]]:
    """(prompt, mode) in serving order: blocks of ``block`` prompts, none then bandit, then bandit then none
    (ABBA: a linear drift of machine speed hits both modes alike). Background work that a bandit query starts
    overlaps the next bandit query inside a block; only at a switch to none must it be waited for."""
    if block < 1:
        raise UserError(f"block must be >= 1, got {block}")
    schedule = []
    for b, first in enumerate(range(0, n, block)):
        indices = range(first, min(first + block, n))
        for adapt in ("none", "bandit") if b % 2 == 0 else ("bandit", "none"):
            schedule += [(i, adapt) for i in indices]
    return schedule


def run_pair(cfg: ShiftConfig, target, eos, prompts, settings: AdaptSettings) -> dict[str, dict]:
    """Serve the stream with adapt=none and adapt=bandit interleaved (:func:`interleaved`), so both see the
    same machine load; each keeps its own drafter."""
    algorithms, setup = {}, {}
    for adapt in ("none", "bandit"):
        algorithms[adapt], setup[adapt] = _build(cfg, target, adapt, settings if adapt == "bandit" else None)
    greedy = SamplingParams(0.0)
    runs = {adapt: {"adapt": adapt, "setup_s": setup[adapt], "per_query": [], "outputs": []} for adapt in algorithms}
    schedule = interleaved(len(prompts), cfg.block)
    background = algorithms["bandit"].adapter.background
    for step, (i, adapt) in enumerate(schedule):
        source, ids = prompts[i]
        result = algorithms[adapt].generate(ids, max_new_tokens=cfg.max_new_tokens, sampling=greedy, eos_ids=eos)
        s = result.stats
        wall, drain = s.wall_s, 0.0
        if (
            background is not None
            and adapt == "bandit"
            and step + 1 < len(schedule)
            and schedule[step + 1][1] == "none"
        ):
            # adapt_background: the work this query started must not run during adapt=none's next query; waiting
            # for it is charged to this query (conservative: in a real stream it overlaps the next bandit query)
            started = time.perf_counter()
            background.wait()
            drain = time.perf_counter() - started
        runs[adapt]["per_query"].append(
            {
                "source": source,
                "new_tokens": s.new_tokens,
                "target_forwards": s.target_forwards,
                "rounds": s.rounds,
                "accepted": s.accepted_draft_tokens,
                "wall_s": wall + drain,
                "drain_s": drain,
                "accept_len": (s.accepted_draft_tokens + s.rounds) / max(s.rounds, 1),
            }
        )
        runs[adapt]["outputs"].append(result.tokens)
    for adapt, run in runs.items():
        queries = run["per_query"]
        tokens, wall = sum(q["new_tokens"] for q in queries), sum(q["wall_s"] for q in queries)
        rounds = sum(q["rounds"] for q in queries)
        adapter = algorithms[adapt].adapter
        close_s = 0.0
        if adapter:  # with adapt_background this waits for the last query's work (its result serves no token)
            started = time.perf_counter()
            adapter.close()
            close_s = time.perf_counter() - started
        rows = adapter.log.rows if adapter else []
        run.update(
            tokens=tokens,
            wall_s=wall,
            tokens_per_s=tokens / wall,
            tau=tokens / sum(q["target_forwards"] for q in queries),
            accept_len=(sum(q["accepted"] for q in queries) + rounds) / max(rounds, 1),
            updates=sum(r.get("arm") not in (None, "skip") for r in rows),
            rollbacks=sum(bool(r.get("rolled_back")) for r in rows),
            resets=sum(bool(r.get("reset")) for r in rows),
            update_s=sum(float(r["update_s"]) for r in rows if r.get("update_s") not in (None, "")),
            drain_s=sum(q.get("drain_s", 0.0) for q in queries),
            close_s=close_s,
            arms=[r.get("arm") for r in rows],
            log=rows,
        )
    return runs


def parse_args(argv: list[str]) -> tuple[Any, dict[str, str], AdaptSettings]:
    """The benchmark's config, the adapter's settings given (``adapt.NAME``, ``adapt_NAME`` or ``NAME``), and the
    adapter's settings with them (type-checked now, before any model loads)."""
    own, rest = split_own(renamed(argv, OLD_SPELLINGS, USAGE), ShiftConfig)
    adapt_fields = set(AdaptSettings.__dataclass_fields__)
    adapt_values = {}
    for key, value in split_key_values(rest, USAGE):
        if key.removeprefix("adapt.").removeprefix("adapt_") not in adapt_fields:  # adapt.NAME (adapt_NAME: as before)
            keys = ", ".join(ShiftConfig.__dataclass_fields__)
            raise OverrideError(f"unknown key '{key}': neither one of {keys} nor an adapter setting (adapt.NAME)")
        adapt_values[key.removeprefix("adapt.").removeprefix("adapt_")] = value
    cfg = parse_bench(own, ShiftConfig, USAGE)
    if cfg.algorithm not in TREE_ALGORITHMS:
        raise OverrideError(f"algorithm={cfg.algorithm} is not one of {', '.join(TREE_ALGORITHMS)}")
    if not cfg.drafter:
        raise OverrideError(f"drafter=DIR (an EAGLE-3 or SpecBlock export) is required; usage: {USAGE}")
    return cfg, adapt_values, AdaptSettings.with_overrides(AdaptSettings(), adapt_values)


def main(argv: list[str]) -> int:
    cfg, adapt_values, base = parse_args(argv)
    apply_threads(cfg)
    target = load_lm(cfg.target, device="cpu", max_seq_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 64)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    out = run_dir(cfg, "adapt_domain_shift")
    summary = {"config": OmegaConf.to_container(cfg), "adapt_overrides": adapt_values, "streams": {}}
    for stream in cfg.streams:
        prompts = stream_prompts(stream, cfg.n_prompts, target.tokenizer, cfg.max_prompt_tokens)
        settings = AdaptSettings.with_overrides(base, {"log": str(out / stream)})
        runs = run_pair(cfg, target, eos, prompts, settings)
        none, bandit = runs["none"], runs["bandit"]
        lossless = none["outputs"] == bandit["outputs"]
        plot_tau(bandit["log"], out / stream / "tau.png", title=f"{stream}: τ per query, adapt=bandit")
        gain = bandit["tokens_per_s"] / none["tokens_per_s"] - 1
        summary["streams"][stream] = {
            "prompts": [s for s, _ in prompts],
            "none": none,
            "bandit": bandit,
            "lossless": lossless,
            "tokens_per_s_gain": gain,
        }
        print(f"[{stream}] {len(prompts)} prompts, {none['tokens']} tokens; identical outputs: {lossless}")
        for run in (none, bandit):
            print(
                f"  adapt={run['adapt']:6s} tau={run['tau']:.3f} accept_len={run['accept_len']:.3f} "
                f"tok/s={run['tokens_per_s']:.2f} wall={run['wall_s']:.1f}s updates={run['updates']} "
                f"rollbacks={run['rollbacks']} resets={run['resets']} update_s={run['update_s']:.1f} "
                f"setup_s={run['setup_s']:.1f} drain_s={run['drain_s']:.1f} close_s={run['close_s']:.1f}"
            )
        print(f"  tokens/s bandit vs none: {100 * gain:+.1f} %   arms: {bandit['arms']}")
        print("  per-query accept length none  :", [round(q["accept_len"], 2) for q in none["per_query"]])
        print("  per-query accept length bandit:", [round(q["accept_len"], 2) for q in bandit["per_query"]])
    for stream in summary["streams"].values():
        for mode in ("none", "bandit"):
            stream[mode].pop("outputs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
