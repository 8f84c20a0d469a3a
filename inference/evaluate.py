"""``python -m inference.evaluate target=smollm2 drafters=DIR algorithms=all bench=[mt_bench,humaneval] ...``

Drafters: ``drafters=DIR`` is a directory of exports (``python -m spectrain.export`` outputs, found by the kind
their ``config.json`` records: draft_lm, eagle3, specblock, dflash, peagle, hrad). Each can also be named on its own,
which wins over the directory: ``drafter=PATH`` (a draft LM, or any export: its kind decides), ``drafter.KIND=PATH``
when several kinds run together (e.g. ``drafter.eagle3=DIR drafter.draft_lm=DIR``), ``specbranch.hrad=PATH``
(SpecBranch's H-RAD; ``specbranch.hrad=none`` for the ablation).

Algorithms: a list of names, ``all`` (every algorithm whose drafter is available; the others are listed as
skipped with the reason), and variants ``NAME@key=value[@key=value]`` that run an algorithm again with other
options in the same run, e.g. ``algorithms=[sps,sps@verifier=hsd,specbranch@hrad=none,sps@temperature=1@seed=3]``.
An algorithm's options are keys under its name (``ssd.budget=8``; in a variant by their names, ``ssd@budget=8``).
A variant may set its algorithm's options, ``adapt``, sampling (temperature, top_k, top_p), seed and max_new_tokens;
the other keys (models, prompts, placement, outputs) are fixed for the run. An option that none of the run's
algorithms reads is refused (``inference.engine_args``), so nothing is accepted and ignored.

Runs every algorithm on the same prompts in ONE process (an ``ar`` baseline is always included, so speedups
compare like with like) and writes ``out/results.json``, ``out/report.md`` and PNGs (acceptance by position,
speedup, tokens per round). MT-Bench prompts are the first user turn of each question.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.atomic import check_output
from core.drafters.kinds import CAUSAL_LM_KIND, engine_kind
from core.errors import UserError
from core.overrides import OverrideError, run_cli
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms import ALGORITHMS, algorithm_class
from inference.algorithms.base import Algorithm, GenerationStats
from inference.algorithms.options import apply_threads
from inference import exactness
from inference.drafters import LoadedModel, eos_token_ids
from inference.engine_args import (
    EngineArgs,
    build_algorithms,
    check_algorithm_options,
    check_drafters,
    check_placement,
    drafter_kind_for,
    drafter_paths,
    load_target,
    parse_engine_cli,
    parse_variant,
    sampling_params,
    with_overrides,
)
from inference.report import acceptance_plot, markdown_table, speedup_plot, tau_distribution_plot

USAGE = (
    "python -m inference.evaluate target=smollm2 drafters=DIR algorithms=[ar,sps,sps@verifier=hsd] "
    "bench=mt_bench n_prompts=N max_new_tokens=M temperature=T out=DIR"
)


@dataclass
class EvalConfig(EngineArgs):
    algorithms: list[str] = field(default_factory=lambda: ["ar"])
    bench: list[str] = field(default_factory=lambda: ["mt_bench"])
    n_prompts: int = 10
    # prompts answered side by side by algorithms that batch (those on the engine loop: ar, sps, dflash, peagle; and
    # ssd); the others run one by one. The target then serves that many rows: exact on a CPU where the probe passed,
    # refused where it left only one row exact
    batch_size: int = 1
    warmup: bool = True
    out: str = "results/eval"


def parse_args(argv: Sequence[str]) -> Any:
    # Accept the singular forms users type (bench=mt_bench, algorithms=sps) for the list fields.
    argv = [_listify(arg, ("bench", "algorithms")) for arg in argv]
    cfg, given = parse_engine_cli(argv, EvalConfig, USAGE)
    if cfg.n_prompts < 1 or cfg.batch_size < 1:
        raise OverrideError("n_prompts and batch_size must be >= 1")
    check_output(cfg.out)  # results are written after the whole run: a bad out= must fail now
    check_placement(cfg)
    _check_generation(cfg, "")
    # unknown algorithms, and options none of them reads, fail here, before any model loads
    check_algorithm_options(cfg, given, cfg.algorithms)
    for label in cfg.algorithms:
        if label != "all":
            _check_generation(with_overrides(cfg, parse_variant(label)[1], label), f"algorithm variant '{label}': ")
    return cfg


def _check_generation(cfg: Any, where: str) -> None:
    if cfg.max_new_tokens < 1:
        raise OverrideError(f"{where}max_new_tokens={cfg.max_new_tokens} must be >= 1")
    try:
        sampling_params(cfg)
    except ValueError as exc:
        raise OverrideError(f"{where}{exc}") from None


def generation_settings(cfg: Any) -> dict[str, Any]:
    """What a run generated with (a variant may change each): recorded on every run record."""
    return {
        "temperature": float(cfg.temperature),
        "top_k": int(cfg.top_k),
        "top_p": float(cfg.top_p),
        "seed": int(cfg.seed),
        "max_new_tokens": int(cfg.max_new_tokens),
    }


def _listify(arg: str, list_keys: tuple[str, ...]) -> str:
    key, sep, value = arg.partition("=")
    if sep and key in list_keys and not value.startswith("["):
        return f"{key}=[{value}]"
    return arg


def select_algorithms(cfg: Any, available: set[str]) -> tuple[list[str], dict[str, str]]:
    """The run's algorithm labels (``ar`` first) and, for ``all``, the skipped ones with why."""
    labels, skipped = ["ar"], {}
    for label in cfg.algorithms:
        if label == "all":
            for name in ALGORITHMS:
                kind = algorithm_class(name).drafter
                if kind == "none" or drafter_kind_for(kind, available) is not None:
                    labels.append(name)
                else:
                    skipped[name] = f"needs {engine_kind(kind).needs}"
        else:
            labels.append(label)
    labels = list(dict.fromkeys(labels))
    check_drafters(labels, available, cfg.drafter)
    return labels, skipped


@dataclass
class BenchPrompts:
    bench: str
    ids: list[list[int]]


def load_bench_conversations(bench: str, n: int) -> list:
    """The first ``n`` conversations of ``bench``; refuses (one line) a bench that gives none."""
    conversations = load_prompts(bench, n=n)
    if not conversations:
        raise UserError(f"bench={bench} gives no prompts; give a bench with at least one conversation")
    return conversations


def load_bench_prompts(bench: str, tokenizer, n: int) -> BenchPrompts:
    conversations = load_bench_conversations(bench, n)
    return BenchPrompts(bench, [render_prompt(tokenizer, prompt_turns(c)) for c in conversations])


def check_exact_batching(batch_size: int, runner: Any) -> None:
    """Refuse (one line) ``batch_size > 1`` where it alone takes the target off the exact path: batched CPU rows are
    exact where the probe passed, but where it left only the token-by-token path a batched runner runs the
    approximate one. Where exact mode is off anyway (a GPU, the transformers fallback) batching changes nothing."""
    if batch_size > 1 and runner.exactness.reason == exactness.BATCHED_ROWS:
        raise UserError(
            f"batch_size={batch_size} serves {batch_size} rows at once, and on this CPU batched rows leave "
            "the exact path (the probe found GEMM rows that depend on the row count; greedy output would "
            "equal AR's only up to rounding); use batch_size=1 here"
        )


def batches_prompts(algorithm) -> bool:
    """Whether ``algorithm`` answers several prompts at once: on the engine loop, or with its own batch (SSD)."""
    return algorithm.batchable or type(algorithm).generate_batch is not Algorithm.generate_batch


def run_one(algorithm, prompts: BenchPrompts, cfg: Any, eos: list[int], progress=None) -> tuple[GenerationStats, list]:
    """Generate for every prompt with ``cfg``'s sampling, seed and max_new_tokens (the variant's config, when the
    algorithm is a variant)."""
    stats, outputs = GenerationStats(), []
    sampling = sampling_params(cfg)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    batch = getattr(cfg, "batch_size", 1) if batches_prompts(algorithm) else 1
    for start in range(0, len(prompts.ids), batch):
        chunk = prompts.ids[start : start + batch]
        kw = {"max_new_tokens": cfg.max_new_tokens, "sampling": sampling, "generator": generator, "eos_ids": eos}
        results = algorithm.generate_batch(chunk, **kw) if batch > 1 else [algorithm.generate(chunk[0], **kw)]
        for result in results:
            stats.merge(result.stats)
            outputs.append(result.tokens)
        if progress is not None:
            progress.update(len(chunk))
            progress.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", tau=f"{stats.tau:.2f}")
    return stats, outputs


def run_record(name: str, bench: str, n_prompts: int, stats: GenerationStats) -> dict[str, Any]:
    return {
        "algorithm": name,
        "bench": bench,
        "n_prompts": n_prompts,
        "new_tokens": stats.new_tokens,
        "wall_s": round(stats.wall_s, 4),
        "tokens_per_s": round(stats.tokens_per_s, 3),
        "target_forwards": stats.target_forwards,
        "tau": round(stats.tau, 4),
        "draft_forwards": stats.draft_forwards,
        "drafted_tokens": stats.drafted_tokens,
        "rollback_rate": round(stats.rollback_rate, 4),
        # tree drafting's seconds per round; None where an algorithm does not time its drafter
        "draft_ms_per_round": round(1000 * stats.draft_s / stats.rounds, 3) if stats.draft_s and stats.rounds else None,
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
        "accepted_hist": list(stats.accepted_hist),
    }


def greedy_equal(outputs: list, cfg: Any, ar_outputs: list, ar_cfg: Any) -> bool | None:
    """Whether a greedy run emitted AR's greedy tokens; None unless both ran greedily (sampled outputs differ by
    design). Compared over the shorter max_new_tokens of the two, so a variant's own length still compares."""
    if cfg.temperature != 0 or ar_cfg.temperature != 0:
        return None
    n = min(cfg.max_new_tokens, ar_cfg.max_new_tokens)
    return [out[:n] for out in outputs] == [out[:n] for out in ar_outputs]


def evaluate(
    cfg: Any,
    target: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    drafters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the evaluation a config describes; returns the results dict (also written to ``cfg.out``).
    ``draft`` (a draft LM) and ``drafters`` (drafter kind -> a loaded drafter module, e.g. {"eagle3": drafter})
    replace loading them from ``cfg``."""
    from tqdm.auto import tqdm  # tqdm: a heavy import, deferred to first use

    preloaded = {CAUSAL_LM_KIND: draft.runner if isinstance(draft, LoadedModel) else draft, **(drafters or {})}
    available = {kind for kind, obj in preloaded.items() if obj is not None} | set(drafter_paths(cfg))
    labels, skipped = select_algorithms(cfg, available)
    for name, why in skipped.items():
        print(f"[evaluate] skipping {name}: it {why}", file=sys.stderr)
    for bench in cfg.bench:  # an unreadable or empty bench fails before any model loads (re-read below: cheap)
        load_bench_conversations(bench, cfg.n_prompts)
    target = target or load_target(cfg, cfg.batch_size)
    check_exact_batching(cfg.batch_size, target.runner)
    target, algorithms = build_algorithms(cfg, labels, target, preloaded, cfg.batch_size)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    benches = [load_bench_prompts(b, target.tokenizer, cfg.n_prompts) for b in cfg.bench]

    runs, totals, ar_runs = [], {}, {}
    total = len(labels) * sum(len(b.ids) for b in benches)
    with tqdm(total=total, desc="evaluate", unit="prompt", file=sys.stderr) as progress:
        # One algorithm at a time (ar first), released before the next: a multiprocess executor's draft process
        # and process group live only while its algorithm runs, so several such variants fit in one run.
        for name, (algorithm, variant_cfg) in algorithms.items():
            if cfg.warmup:  # first calls pay for allocation and kernel selection; keep them out of the timings
                # the variant's sampling takes the same code path as its run; its own generator leaves the run's
                # draws (seeded by the variant's seed) untouched
                warmup_rng = torch.Generator(device="cpu").manual_seed(variant_cfg.seed)
                algorithm.generate(
                    benches[0].ids[0],
                    max_new_tokens=8,
                    sampling=sampling_params(variant_cfg),
                    generator=warmup_rng,
                    eos_ids=eos,
                )
            for prompts in benches:
                progress.set_description(f"{name}/{prompts.bench}")
                algorithm.extra_metrics()  # starts this run's period (drops warm-up figures)
                stats, outputs = run_one(algorithm, prompts, variant_cfg, eos, progress)
                record = run_record(name, prompts.bench, len(prompts.ids), stats) | generation_settings(variant_cfg)
                record.update(algorithm.extra_metrics())
                if name == "ar":  # labels start with the baseline, so every later run finds it
                    ar_runs[prompts.bench] = (outputs, variant_cfg)
                equal = greedy_equal(outputs, variant_cfg, *ar_runs[prompts.bench])
                if equal is not None:
                    record["greedy_equal_to_ar"] = equal
                runs.append(record)
                totals.setdefault(name, GenerationStats()).merge(stats)
            getattr(algorithm, "close", lambda: None)()  # executors with a draft process or thread
    order = {b.bench: i for i, b in enumerate(benches)}
    runs.sort(key=lambda record: order[record["bench"]])  # by bench, algorithms in their order (stable)
    ar_rate = totals["ar"].tokens_per_s
    for record in runs:
        base = next(r for r in runs if r["algorithm"] == "ar" and r["bench"] == record["bench"])
        record["speedup_vs_ar"] = (
            round(record["tokens_per_s"] / base["tokens_per_s"], 4) if base["tokens_per_s"] else None
        )
    results = {
        "config": OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else dict(cfg),
        "device": str(target.runner.device),
        "dtype": str(target.runner.dtype).removeprefix("torch."),
        "exactness": target.runner.exactness.as_dict(),
        "runs": runs,
        "skipped": skipped,
        "speedup_vs_ar": {n: round(s.tokens_per_s / ar_rate, 4) if ar_rate else None for n, s in totals.items()},
    }
    write_outputs(results, Path(cfg.out))
    return results


def write_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(markdown_table(results))
    acceptance_plot(results, out / "acceptance.png")
    speedup_plot(results, out / "speedup.png")
    tau_distribution_plot(results, out / "tau_distribution.png")


def _run(args: list[str]) -> Any:
    cfg = parse_args(args)
    apply_threads(cfg)
    evaluate(cfg)
    return cfg


def _report(cfg: Any) -> None:
    print(Path(cfg.out, "report.md").read_text())
    print(f"wrote {cfg.out}/results.json, report.md, acceptance.png, speedup.png, tau_distribution.png")


def main(argv: Sequence[str] | None = None) -> int:
    doc = f"{__doc__}\nalgorithms: {', '.join(ALGORITHMS)}"
    return run_cli(argv, _run, doc=doc, schema=EvalConfig, report=_report)


if __name__ == "__main__":
    sys.exit(main())
