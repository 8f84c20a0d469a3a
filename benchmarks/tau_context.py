"""``python -m benchmarks.tau_context drafters=DIR [algorithms=[eagle3_tree,peagle,dflash]]
[contexts=[512,2048,4096,8192]] [attention_windows=[256]] [n_prompts=2] [max_new_tokens=128] [threads=1] [out=DIR]
[figure=FILE.png]``

τ against context length. The bench: held-out GSM-symbolic problems (``gsm_symbolic``, the evaluation seeds), each
asked after ``k`` solved ones (their worked solutions as earlier chat turns), ``k`` the most that keep the rendered
prompt within each context length (and within the target's window, less the answer and the lookahead). Every
algorithm (``ar`` first, always) answers every prompt greedily on the engine as ``inference.evaluate`` runs it;
per context length and algorithm the run records τ (new tokens per target forward, prefill included, as evaluate
counts it), the tokens kept per verification round, tokens/s over the whole request and over decoding alone (from
the first emitted token on: a long prompt's prefill is most of a short answer's wall time), the time to the first
token, and whether the output equals AR's token for token.

``attention_windows=[W, ...]``: the EAGLE-3 and P-EAGLE drafters run again with a sliding window of ``W`` positions
applied at serving time (their weights as trained; ``core.drafters.eagle3``), one run per window and context length.

Writes ``out/results.json`` (rewritten after every run, so a run cut short keeps what it measured) and,
at the end, ``out/tau_context.png`` (τ and decoding speed-up over AR against the prompt's tokens; also ``figure=FILE``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Output, Workload, run_dir
from core.atomic import atomic_write_text, check_output
from core.drafters.eagle3 import Eagle3Drafter
from core.errors import UserError
from core.overrides import OverrideError, run_cli
from core.prompts import Conversation, load_prompts, render_prompt
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_lm, model_dtype, pick_device
from inference.engine.state import GenerationStats
from inference.engine_args import (
    EngineArgs,
    build_algorithms,
    check_algorithm_options,
    check_placement,
    load_target,
    parse_engine_cli,
    sampling_params,
)
from inference.evaluate import generation_settings, greedy_equal, run_record

USAGE = (
    "python -m benchmarks.tau_context drafters=DIR algorithms=[eagle3_tree,peagle,dflash] "
    "contexts=[512,2048,4096,8192] attention_windows=[256] n_prompts=2 max_new_tokens=128 threads=1 out=DIR"
)
LIST_KEYS = ("algorithms", "contexts", "attention_windows")
SHOT_POOL = 96  # solved problems a prompt may carry (~250 tokens each with SmolLM2's tokenizer: 8k needs ~32)


@dataclass
class TauContextConfig(BenchConfig, Output, Workload, EngineArgs):
    """The engine's arguments, with the benchmarks' threads (one), and ``out``: a directory (default
    runs/tau_context)."""

    algorithms: list[str] = field(default_factory=lambda: ["eagle3_tree", "peagle", "dflash"])
    contexts: list[int] = field(default_factory=lambda: [512, 2048, 4096, 8192])  # prompt tokens, at most
    attention_windows: list[int] = field(default_factory=list)  # serving-time windows of EAGLE-3 / P-EAGLE drafters
    n_prompts: int = 2  # per context length: a long prompt's prefill takes minutes on a CPU
    max_seq_len: int = 8192  # SmolLM2's window
    warmup: bool = True
    # false: the target's plain CPU kernels (one GEMM and one attention call per layer for a whole prompt) instead of
    # the exact path's (bitwise batch-invariant, attention planned per row), whose prefill of thousands of tokens
    # takes minutes on a CPU; greedy output then equals AR's up to rounding, and the run says whether it did
    exact: bool = True
    figure: str | None = None  # another copy of the plot (e.g. benchmarks/figures/tau_context.png)


@dataclass
class ContextPrompt:
    question: str  # the held-out problem's id
    shots: int  # solved problems before it
    ids: list[int]


def as_list(arg: str) -> str:
    """``algorithms=peagle`` -> ``algorithms=[peagle]`` for the list keys (the singular form users type)."""
    key, sep, value = arg.partition("=")
    return f"{key}=[{value}]" if sep and key in LIST_KEYS and not value.startswith("[") else arg


def parse_args(argv: Sequence[str]) -> Any:
    argv = [as_list(arg) for arg in argv]
    cfg, given = parse_engine_cli(argv, TauContextConfig, USAGE)
    if cfg.n_prompts < 1 or cfg.max_new_tokens < 1 or not cfg.contexts or min(cfg.contexts) < 1:
        raise OverrideError("n_prompts, max_new_tokens and every context length must be >= 1")
    if cfg.temperature != 0:
        raise OverrideError(
            f"temperature={cfg.temperature}: τ against context is measured greedily (outputs compared "
            "with AR's); drop temperature"
        )
    if "ar" in cfg.algorithms:
        raise OverrideError("ar always runs (the baseline); list only the speculative algorithms in algorithms=")
    cfg.out = str(run_dir(cfg, "tau_context"))
    check_output(cfg.out)
    check_placement(cfg)
    check_algorithm_options(cfg, given, cfg.algorithms)
    return cfg


def shots_and_questions(n_prompts: int) -> tuple[list[Conversation], list[Conversation]]:
    """(held-out problems, solved problems to put before them): disjoint items of the evaluation seeds."""
    items = load_prompts("gsm_symbolic", n=n_prompts + SHOT_POOL)
    return items[:n_prompts], items[n_prompts:]


def context_prompts(
    tokenizer, questions: Sequence[Conversation], shots: Sequence[Conversation], contexts: Sequence[int], limit: int
) -> dict[int, list[ContextPrompt]]:
    """Per context length L: each question after the most solved problems (user turn, worked answer) that keep its
    rendered prompt within ``min(L, limit)`` tokens."""
    budgets = {length: min(length, limit) for length in contexts}
    out: dict[int, list[ContextPrompt]] = {length: [] for length in contexts}
    for question in questions:
        asked = [{"role": "user", "content": question.first_user_message}]
        fits: dict[int, tuple[int, list[int]]] = {}  # budget -> (shots, the longest prompt within it)
        for k in range(len(shots) + 1):
            ids = render_prompt(tokenizer, [turn for shot in shots[:k] for turn in shot.turns[:2]] + asked)
            inside = [budget for budget in set(budgets.values()) if len(ids) <= budget]
            if not inside:
                break
            fits.update({budget: (k, ids) for budget in inside})
        else:
            raise UserError(
                f"{len(shots)} solved problems do not fill {max(budgets.values())} tokens; give shorter contexts"
            )
        for length, budget in budgets.items():
            if budget not in fits:
                raise UserError(
                    f"context {length}: problem {question.id} alone is longer than {budget} tokens; give "
                    "longer contexts"
                )
            out[length].append(ContextPrompt(question.id, *fits[budget]))
    return out


@contextmanager
def drafter_window(algorithm: Any, window: int) -> Iterator[None]:
    """``algorithm``'s EAGLE-3 / P-EAGLE drafter attends over ``window`` positions (0: as trained) for the block."""
    drafter = getattr(algorithm, "drafter", None)
    if not window:
        yield
        return
    trained = drafter.config
    drafter.config = replace(trained, attention_window=window)  # checked as any config (its narrowest window)
    try:
        yield
    finally:
        drafter.config = trained


def windowable(algorithm: Any) -> bool:
    """Whether the algorithm drafts with an EAGLE-3-layer drafter (EAGLE-3, P-EAGLE): a window applies to it."""
    return isinstance(getattr(algorithm, "drafter", None), Eagle3Drafter)


@dataclass
class Timed:
    """One algorithm's answers to one context length's prompts: the engine's counters, and the decoding share."""

    stats: GenerationStats
    outputs: list[list[int]]
    first_token_s: float = 0.0  # summed over prompts: prefill (and the first emission)
    decode_s: float = 0.0  # from the first emitted tokens to the end
    decode_tokens: int = 0  # tokens emitted after the first emission


def answer(algorithm: Any, prompts: Sequence[ContextPrompt], cfg: Any, eos: list[int]) -> Timed:
    """Greedy answers to ``prompts`` one by one, timing the first emission apart (``on_tokens`` sees it)."""
    timed = Timed(GenerationStats(), [])
    for prompt in prompts:
        emitted: list[tuple[float, int]] = []  # (when, how many) of each emission

        def note(tokens: list[int], into: list[tuple[float, int]] = emitted) -> None:
            into.append((time.perf_counter(), len(tokens)))

        start = time.perf_counter()
        result = algorithm.generate(
            prompt.ids, max_new_tokens=cfg.max_new_tokens, sampling=sampling_params(cfg), eos_ids=eos, on_tokens=note
        )
        end = time.perf_counter()
        timed.stats.merge(result.stats)
        timed.outputs.append(result.tokens)
        if emitted:
            timed.first_token_s += emitted[0][0] - start
            timed.decode_s += end - emitted[0][0]
            timed.decode_tokens += len(result.tokens) - emitted[0][1]
    return timed


def context_record(
    label: str, window: int, length: int, prompts: Sequence[ContextPrompt], timed: Timed, cfg: Any
) -> dict[str, Any]:
    stats = timed.stats
    record = run_record(label, f"gsm_symbolic@{length}", len(prompts), stats) | generation_settings(cfg)
    record.update(
        context=length,
        attention_window=window,
        prompt_tokens=[len(p.ids) for p in prompts],
        shots=[p.shots for p in prompts],
        tokens_per_round=round(1 + stats.accepted_draft_tokens / stats.rounds, 4) if stats.rounds else None,
        first_token_s=round(timed.first_token_s / len(prompts), 3),
        decode_tokens_per_s=round(timed.decode_tokens / timed.decode_s, 3) if timed.decode_s else None,
    )
    return record


def tau_context(cfg: Any) -> dict[str, Any]:
    labels = ["ar", *cfg.algorithms]
    target = (
        load_target(cfg)
        if cfg.exact
        else load_lm(
            cfg.target,
            device=cfg.device,
            max_seq_len=cfg.max_seq_len,
            chat_template=cfg.chat_template,
            dtype=model_dtype(cfg.dtype, pick_device(cfg.device)),
            exact=False,
        )
    )
    target, algorithms = build_algorithms(cfg, labels, target)
    runs = [(label, 0) for label in labels]
    runs += [(label, w) for w in cfg.attention_windows for label in labels if windowable(algorithms[label][0])]
    if cfg.attention_windows and len(runs) == len(labels):
        raise OverrideError(
            f"attention_windows={list(cfg.attention_windows)} apply to EAGLE-3 and P-EAGLE drafters, "
            f"and none of {list(cfg.algorithms)} drafts with one; add eagle3_tree or peagle"
        )
    limit = cfg.max_seq_len - cfg.max_new_tokens - max(alg.lookahead() for alg, _ in algorithms.values())
    questions, shots = shots_and_questions(cfg.n_prompts)
    bench = context_prompts(target.tokenizer, questions, shots, cfg.contexts, limit)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    results: dict[str, Any] = {
        "config": OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else dict(vars(cfg)),
        "device": str(target.runner.device),
        "dtype": str(target.runner.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "exactness": target.runner.exactness.as_dict(),
        "questions": [q.id for q in questions],
        "runs": [],
    }
    if cfg.warmup:  # first calls pay for allocation and kernel selection; a short prompt keeps them out
        short = [
            ContextPrompt(
                questions[0].id,
                0,
                render_prompt(target.tokenizer, [{"role": "user", "content": questions[0].first_user_message}]),
            )
        ]
        for label, window in runs:
            with drafter_window(algorithms[label][0], window):
                answer(algorithms[label][0], short, replace_tokens(algorithms[label][1], 8), eos)
    for length in cfg.contexts:
        ar_outputs = None
        for label, window in runs:
            algorithm, variant = algorithms[label]
            with drafter_window(algorithm, window):
                timed = answer(algorithm, bench[length], variant, eos)
            record = context_record(label, window, length, bench[length], timed, variant)
            if label == "ar":
                ar_outputs = (timed.outputs, variant)
            record["greedy_equal_to_ar"] = greedy_equal(timed.outputs, variant, *ar_outputs)
            results["runs"].append(record)
            add_speedups(results["runs"])
            write_json(results, Path(cfg.out))  # after every run: a run cut short keeps what it measured
            print(
                f"[tau_context] {length:>5} {label}{f'@window={window}' if window else ''}: tau "
                f"{record['tau']:.3f}, decode {record['decode_tokens_per_s']} tok/s, equal to AR "
                f"{record['greedy_equal_to_ar']}",
                file=sys.stderr,
                flush=True,
            )
    plot(results, [Path(cfg.out) / "tau_context.png"] + ([Path(cfg.figure)] if cfg.figure else []))
    return results


def replace_tokens(cfg: Any, max_new_tokens: int) -> Any:
    return (
        OmegaConf.merge(cfg, {"max_new_tokens": max_new_tokens})
        if OmegaConf.is_config(cfg)
        else replace(cfg, max_new_tokens=max_new_tokens)
    )


def add_speedups(runs: list[dict[str, Any]]) -> None:
    """Each run's tokens/s (whole request, decoding alone) over AR's at its context length."""
    ar = {r["context"]: r for r in runs if r["algorithm"] == "ar"}
    for record in runs:
        base = ar[record["context"]]
        record["speedup_vs_ar"] = (
            round(record["tokens_per_s"] / base["tokens_per_s"], 4) if base["tokens_per_s"] else None
        )
        record["decode_speedup_vs_ar"] = (
            round(record["decode_tokens_per_s"] / base["decode_tokens_per_s"], 4)
            if record["decode_tokens_per_s"] and base["decode_tokens_per_s"]
            else None
        )


def series(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs by line of the plot (algorithm, and its window when one was applied), in context order."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for record in runs:
        window = record.get("attention_window")
        name = record["algorithm"] + (f" (window {window})" if window else "")
        lines.setdefault(name, []).append(record)
    return {name: sorted(points, key=lambda r: r["context"]) for name, points in lines.items()}


def plot(results: dict[str, Any], paths: Sequence[Path]) -> None:
    import matplotlib  # matplotlib: a heavy import, deferred to first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tau_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (name, points) in enumerate(series(results["runs"]).items()):
        x = [sum(r["prompt_tokens"]) / len(r["prompt_tokens"]) for r in points]
        style = dict(linestyle="--" if "window" in name else "-", marker="o", label=name, color=f"C{index}")
        tau_ax.plot(x, [r["tau"] for r in points], **style)
        speed_ax.plot(x, [r["decode_speedup_vs_ar"] or 0 for r in points], **style)
    for ax, label in ((tau_ax, "τ (new tokens per target forward)"), (speed_ax, "decoding tokens/s ÷ AR")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (held-out GSM problem after k solved ones)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    speed_ax.legend(fontsize=8)
    fig.suptitle(
        f"τ against context: {results['config'].get('target')}, {results['dtype']}, "
        f"{results['threads']} thread(s), {len(results['questions'])} problems per length, greedy"
    )
    fig.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")


def _run(args: list[str]) -> Any:
    cfg = parse_args(args)
    apply_threads(cfg)
    tau_context(cfg)
    return cfg


def _report(cfg: Any) -> None:
    print(f"wrote {cfg.out}/results.json and {cfg.out}/tau_context.png")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, _run, doc=__doc__, schema=TauContextConfig, report=_report)


if __name__ == "__main__":
    sys.exit(main())
