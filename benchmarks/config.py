"""What the benchmark CLIs share: their common ``key=value`` options, each declared once, and how they are parsed.

Every benchmark's config dataclass extends :class:`BenchConfig` and the groups of options it reads, so a shared
option has one spelling, one type and one default (``threads=1``, ``target=smollm2``, ``out=``, ...). A benchmark
restates an option only where its measurement needs another default (a size such as ``n_prompts``; each one is
listed, with why, in tests/benchmarks/test_bench_cli.py). Benchmarks over the engine (``tau_context``,
``serve_load``) also take the engine's own arguments (``inference.engine_args.EngineArgs``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.overrides import parse_cli, split_key_values


@dataclass
class BenchConfig:
    """What every benchmark reads."""

    threads: int = 1  # torch intra-op threads; 0 = torch's default (one keeps timings comparable on a shared CPU)


@dataclass
class Output:
    out: str | None = None  # where results are written (FILE or DIR: the benchmark's usage says); see run_dir


@dataclass
class Target:
    target: str = "smollm2"  # the target: a registry name, an HF model directory or id


@dataclass
class Dtype:
    dtype: str = "auto"  # auto (bf16 where the CPU computes it natively, else fp32) | fp32 | bf16


@dataclass
class Drafter:
    drafter: str | None = None  # an export (spectrain.export); a draft LM may also be an HF directory or registry name


@dataclass
class DraftLM(Drafter):
    draft_vocab: int = 0  # K > 0: the draft proposes only ids < K (evaluate's draft_vocab); 0 = all


@dataclass
class Bench:
    bench: str = "gsm_symbolic"  # where the prompts come from (core.prompts: gsm_symbolic, mt_bench, humaneval, ...)


@dataclass
class Workload:
    n_prompts: int = 6  # prompts answered
    max_new_tokens: int = 128  # the answer's length


@dataclass
class Seeded:
    seed: int = 0


@dataclass
class Repeats:
    repeats: int = 7  # timed repetitions per cell (the median is reported)


@dataclass
class SeqLen:
    max_seq_len: int = 2048  # the target's KV-cache length


def renamed(argv: Sequence[str], old_spellings: Mapping[str, str], usage: str) -> list[str]:
    """``argv`` with each old spelling (``n=4``) written as its new key (``n_prompts=4``), with a one-line warning on
    stderr naming the new one."""
    out = []
    for (key, value), arg in zip(split_key_values(argv, usage), argv, strict=True):
        if key in old_spellings:
            new = old_spellings[key]
            print(
                f"warning: {key}={value} is the old spelling; write {new}={value} (accepted until the next release)",
                file=sys.stderr,
            )
            arg = f"{new}={value}"
        out.append(arg)
    return out


def parse_bench(argv: Sequence[str], schema: type, usage: str, old_spellings: Mapping[str, str] | None = None) -> Any:
    """``key=value`` args parsed into ``schema`` (``core.overrides.parse_cli``: a full or unambiguous key, one-line
    errors naming the fix); an old spelling in ``old_spellings`` is read as its new key, with a warning."""
    return parse_cli(renamed(argv, old_spellings or {}, usage), schema, usage)


def split_own(argv: Sequence[str], schema: type) -> tuple[list[str], list[str]]:
    """``argv`` split into the args that set a key of ``schema`` and the rest (recipe overrides, a server's keys)."""
    keys = set(schema.__dataclass_fields__)
    own, rest = [], []
    for arg in argv:
        (own if arg.partition("=")[0].lstrip("+") in keys else rest).append(arg)
    return own, rest


def run_dir(cfg: Any, name: str) -> Path:
    """Where a benchmark that writes a directory of results puts them: ``out=DIR``, else ``runs/<name>``."""
    return Path(cfg.out or Path("runs") / name)
