"""``python -m benchmarks.extract_scaling [n_samples=32] [max_len=256] [source=sharegpt] [processes=[1,2]] [threads=1]``

Feature extraction (``data_prep.extract``, SmolLM2-135M-Instruct, EAGLE-3 layers, bf16 storage) by 1 process and
by 2 processes under torchrun, ``threads`` intra-op threads each, on the same source items, one run after the
other in this script (repeat a count, e.g. ``processes=[1,2,1,2]``, to interleave): wall time from launch to the
final manifest (model loading included), tokens written, tokens/s and the ratio to the first run. Each run writes a
fresh directory under a temporary folder, deleted afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig, Target, parse_bench

USAGE = "python -m benchmarks.extract_scaling n_samples=32 max_len=256 processes=[1,2]"


@dataclass
class ExtractScalingConfig(BenchConfig, Target):
    source: str = "sharegpt"
    n_samples: int = 32
    max_len: int = 256
    batch_size: int = 4
    processes: list[int] = field(default_factory=lambda: [1, 2])


def run(cfg: Any, processes: int, out: Path) -> tuple[float, int]:
    """(wall seconds, tokens written) of one extraction by ``processes`` processes."""
    args = [
        f"target={cfg.target}",
        f"source={cfg.source}",
        f"n_samples={cfg.n_samples}",
        f"max_len={cfg.max_len}",
        "layers=eagle3",
        "dtype=bf16",
        f"batch_size={cfg.batch_size}",
        "device=cpu",
        f"out={out}",
    ]
    launcher = (
        [sys.executable, "-m", "data_prep.extract"]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            "-m",
            "data_prep.extract",
        ]
    )
    threads = {"OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)} if cfg.threads else {}
    env = {
        **os.environ,
        **threads,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    start = time.perf_counter()
    subprocess.run([*launcher, *args], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, int(json.loads((out / "manifest.json").read_text())["num_tokens"])


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, ExtractScalingConfig, USAGE)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, n in enumerate(cfg.processes):  # a fresh directory per run: a finished one is only reported
            wall, tokens = run(cfg, n, Path(tmp) / f"run{i}")
            rows.append((n, tokens, wall))
            print(f"[extract_scaling] {n} process(es): {tokens} tokens in {wall:.1f} s", file=sys.stderr, flush=True)
    base = rows[0][1] / rows[0][2]
    print(f"| processes ({cfg.threads or 'default'} thread(s) each) | tokens | wall s | tokens/s | × first run |")
    print("|---|---|---|---|---|")
    for n, tokens, wall in rows:
        print(f"| {n} | {tokens:,} | {wall:.1f} | {tokens / wall:.0f} | {tokens / wall / base:.2f} |")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main(sys.argv[1:])
