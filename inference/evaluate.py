"""``python -m inference.evaluate target=smollm2 drafter=PATH algorithms=[ar,sps] verifier=hsd bench=mt_bench ...``

``drafter=PATH`` is a draft LM for draft-LM algorithms (``sps``) or an EAGLE-3 export for ``eagle3_tree``; to run
both kinds at once give the EAGLE-3 export as ``feature_drafter=PATH``.

Runs every listed algorithm on the same prompts in ONE process (an ``ar`` baseline is always included, so
speedups compare like with like) and writes ``out/results.json``, ``out/report.md`` and ``out/acceptance.png``.
MT-Bench prompts are the first user turn of each question.
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

from inference.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from inference.algorithms.base import GenerationStats
from inference.algorithms.options import AlgorithmOptions, apply_threads
from inference.drafters import LoadedModel, eos_token_ids, load_draft_lm, load_eagle3, load_lm
from inference.sampling import SamplingParams
from spectrain.overrides import OverrideError, parse_cli, run_cli

USAGE = ("python -m inference.evaluate target=smollm2 drafter=PATH algorithms=[ar,sps] verifier=tokenwise "
         "bench=mt_bench n_prompts=N max_new_tokens=M temperature=T out=DIR")


@dataclass
class EvalConfig(AlgorithmOptions):
    target: str = "smollm2"
    drafter: str | None = None  # a draft LM (exported dir, HF dir or registry name), or an EAGLE-3 export
    feature_drafter: str | None = None  # the EAGLE-3 export when draft-LM and feature algorithms run together
    algorithms: list[str] = field(default_factory=lambda: ["ar"])
    bench: list[str] = field(default_factory=lambda: ["mt_bench"])
    n_prompts: int = 10
    max_new_tokens: int = 128
    warmup: bool = True
    out: str = "results/eval"


def parse_args(argv: Sequence[str]) -> Any:
    # Accept the singular forms users type (bench=mt_bench, algorithms=sps) for the list fields.
    argv = [_listify(arg, ("bench", "algorithms")) for arg in argv]
    cfg = parse_cli(argv, EvalConfig, USAGE)
    for name in cfg.algorithms:
        algorithm_class(name)  # unknown names fail here, before any model loads
    if cfg.max_new_tokens < 1 or cfg.n_prompts < 1:
        raise OverrideError("max_new_tokens and n_prompts must be >= 1")
    SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    return cfg


def _listify(arg: str, list_keys: tuple[str, ...]) -> str:
    key, sep, value = arg.partition("=")
    if sep and key in list_keys and not value.startswith("["):
        return f"{key}=[{value}]"
    return arg


@dataclass
class BenchPrompts:
    bench: str
    ids: list[list[int]]


def load_bench_prompts(bench: str, tokenizer, n: int) -> BenchPrompts:
    from data_prep.prompts import load_prompts, prompt_turns, render_prompt

    conversations = load_prompts(bench, n=n)
    return BenchPrompts(bench, [render_prompt(tokenizer, prompt_turns(c)) for c in conversations])


def run_one(algorithm, prompts: BenchPrompts, cfg: Any, eos: list[int], progress=None) -> tuple[GenerationStats, list]:
    stats, outputs = GenerationStats(), []
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    for ids in prompts.ids:
        result = algorithm.generate(ids, max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                                    generator=generator, eos_ids=eos)
        stats.merge(result.stats)
        outputs.append(result.tokens)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", tau=f"{stats.tau:.2f}")
    return stats, outputs


def run_record(name: str, bench: str, n_prompts: int, stats: GenerationStats) -> dict[str, Any]:
    return {
        "algorithm": name, "bench": bench, "n_prompts": n_prompts, "new_tokens": stats.new_tokens,
        "wall_s": round(stats.wall_s, 4), "tokens_per_s": round(stats.tokens_per_s, 3),
        "target_forwards": stats.target_forwards, "tau": round(stats.tau, 4),
        "draft_forwards": stats.draft_forwards, "drafted_tokens": stats.drafted_tokens,
        "rollback_rate": round(stats.rollback_rate, 4),
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
        "accepted_hist": list(stats.accepted_hist),
    }


def evaluate(cfg: Any, target: LoadedModel | None = None, draft: LoadedModel | None = None,
             features=None) -> dict[str, Any]:
    """Run the evaluation a config describes; returns the results dict (also written to ``cfg.out``).
    ``draft`` / ``features`` (an EAGLE-3 drafter module) replace loading them from ``cfg``."""
    from tqdm.auto import tqdm

    names = ["ar"] + [a for a in cfg.algorithms if a != "ar"]
    kinds = {n: algorithm_class(n).drafter for n in names}
    needs_draft, needs_features = "draft_lm" in kinds.values(), "features" in kinds.values()
    if needs_draft and not cfg.drafter and draft is None:
        raise OverrideError(f"algorithms {[n for n in names if kinds[n] == 'draft_lm']} need a "
                            "draft LM: add drafter=PATH")
    feature_path = cfg.feature_drafter or (None if needs_draft else cfg.drafter)
    if needs_features and not feature_path and features is None:
        raise OverrideError(f"algorithms {[n for n in names if kinds[n] == 'features']} need an EAGLE-3 export: add "
                            "drafter=PATH (feature_drafter=PATH when a draft LM is also given)")
    target = target or load_lm(cfg.target, device=cfg.device, max_seq_len=cfg.max_seq_len)
    if needs_draft and draft is None:
        draft = load_draft_lm(cfg.drafter, target, device=cfg.device, max_seq_len=cfg.max_seq_len)
    if needs_features and features is None:
        features = load_eagle3(feature_path, target)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    drafters = {"draft_lm": draft.runner if draft else None, "features": features}
    algorithms = {n: build_algorithm(n, target.runner, drafters.get(kinds[n]),
                                     **algorithm_class(n).options_from_config(cfg)) for n in names}
    benches = [load_bench_prompts(b, target.tokenizer, cfg.n_prompts) for b in cfg.bench]

    if cfg.warmup:  # first calls pay for allocation and kernel selection; keep them out of the timings
        for algorithm in algorithms.values():
            algorithm.generate(benches[0].ids[0], max_new_tokens=8, sampling=SamplingParams(cfg.temperature),
                               eos_ids=eos)

    runs, totals, ar_outputs = [], {}, {}
    total = len(names) * sum(len(b.ids) for b in benches)
    with tqdm(total=total, desc="evaluate", unit="prompt", file=sys.stderr) as progress:
        for prompts in benches:
            for name, algorithm in algorithms.items():
                progress.set_description(f"{name}/{prompts.bench}")
                stats, outputs = run_one(algorithm, prompts, cfg, eos, progress)
                record = run_record(name, prompts.bench, len(prompts.ids), stats)
                if cfg.temperature == 0:
                    if name == "ar":
                        ar_outputs[prompts.bench] = outputs
                    record["greedy_equal_to_ar"] = outputs == ar_outputs[prompts.bench]
                runs.append(record)
                totals.setdefault(name, GenerationStats()).merge(stats)

    ar_rate = totals["ar"].tokens_per_s
    for record in runs:
        base = next(r for r in runs if r["algorithm"] == "ar" and r["bench"] == record["bench"])
        record["speedup_vs_ar"] = round(record["tokens_per_s"] / base["tokens_per_s"], 4) if base["tokens_per_s"] else None
    results = {
        "config": OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else dict(cfg),
        "device": str(target.runner.device),
        "runs": runs,
        "speedup_vs_ar": {n: round(s.tokens_per_s / ar_rate, 4) if ar_rate else None for n, s in totals.items()},
    }
    write_outputs(results, Path(cfg.out))
    return results


def write_outputs(results: dict[str, Any], out: Path) -> None:
    from inference.report import acceptance_plot, markdown_table, speedup_plot, tau_distribution_plot

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
