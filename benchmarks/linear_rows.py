"""``python benchmarks/linear_rows.py [rows=[1,2,3,4,6,8]] [threads=1] [repeats=7] [out=DIR]``

What a forward's linears cost by row count on this CPU: milliseconds for one pass over SmolLM2-135M's decoder
matmul shapes (30 layers x q/k/v/o + gate/up/down, fp32, weights streamed from memory as in a real forward) and over
its 49,152-row lm_head, with plain ``F.linear``, the runner's ``Linear`` (which pads 2-3 rows to 4 for MKL) and the
runner's ``Linear`` in exact mode (``core.kernels.exact_cpu.linear``: every row's bits fixed whatever the call holds,
what the engine runs in fp32 on a CPU). Prints a table; compare the columns of one run only. ``out=DIR`` also writes
``DIR/results.json`` (the config, the CPU and every figure).
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
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Output, Repeats, parse_bench
from core.blocks.linear import Linear
from core.overrides import OverrideError
from inference.algorithms.options import apply_threads
from inference.device import cpu_description

USAGE = "python benchmarks/linear_rows.py rows=[1,2,3,4,6,8] threads=1 repeats=7"
HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M


@dataclass
class LinearRowsConfig(BenchConfig, Output, Repeats):
    """``out``: a directory for results.json (optional)."""

    rows: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])


def _modules(shapes: list[tuple[int, int]]) -> list[Linear]:
    torch.manual_seed(0)
    modules = []
    for fan_in, fan_out in shapes:
        module = Linear(fan_in, fan_out, bias=False).requires_grad_(False)
        torch.nn.init.normal_(module.weight, std=0.02)
        modules.append(module)
    return modules


def _median_ms(fn, repeats: int) -> float:
    fn()  # kernel selection out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


@torch.no_grad()
def measure(cfg: Any) -> list[dict]:
    apply_threads(cfg)
    layer_shapes = [
        (HIDDEN, HIDDEN),
        (HIDDEN, KV),
        (HIDDEN, KV),
        (HIDDEN, HIDDEN),
        (HIDDEN, INTERMEDIATE),
        (HIDDEN, INTERMEDIATE),
        (INTERMEDIATE, HIDDEN),
    ] * LAYERS
    decoder, lm_head = _modules(layer_shapes), _modules([(HIDDEN, VOCAB)])[0]
    inputs = {width: {rows: torch.randn(rows, width) for rows in cfg.rows} for width in (HIDDEN, INTERMEDIATE)}

    def run(modules, rows, path):
        for module in modules:
            x = inputs[module.in_features][rows]
            module.exact = path == "exact"
            F.linear(x, module.weight) if path == "plain" else module(x)

    results = []
    for rows in cfg.rows:
        row = {"rows": rows}
        for name, modules in (("decoder", decoder), ("lm_head", [lm_head])):
            for path in ("plain", "padded", "exact"):
                row[f"{name}_{path}_ms"] = _median_ms(
                    lambda modules=modules, rows=rows, path=path: run(modules, rows, path), cfg.repeats
                )
        results.append(row)
    return results


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, LinearRowsConfig, USAGE)


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
    except OverrideError as error:
        sys.exit(f"error: {error}")
    results = measure(cfg)
    cpu = cpu_description()
    print(f"SmolLM2-135M matmul shapes, fp32, {cfg.threads} thread(s), median of {cfg.repeats}, {cpu}\n")
    print(
        "| rows | decoder: F.linear | Linear | exact | lm_head: F.linear | Linear | exact | exact ÷ F.linear, "
        "decoder / lm_head |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['rows']} | {row['decoder_plain_ms']:.1f} | {row['decoder_padded_ms']:.1f} | "
            f"{row['decoder_exact_ms']:.1f} | {row['lm_head_plain_ms']:.1f} | {row['lm_head_padded_ms']:.1f} | "
            f"{row['lm_head_exact_ms']:.1f} | {row['decoder_exact_ms'] / row['decoder_plain_ms']:.2f} / "
            f"{row['lm_head_exact_ms'] / row['lm_head_plain_ms']:.2f} |"
        )
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "config": OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else vars(cfg),
            "cpu": cpu,
            "torch": torch.__version__,
            "unit": "ms",
            "rows": results,
        }
        (out / "results.json").write_text(json.dumps(record, indent=1))
        print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
