"""``python -m benchmarks.fp8_features [n_train=256] [n_val=32] [max_len=384] [steps=60] [threads=1] [out=DIR]
[work=DIR]``

FP8 against bf16 feature storage (``data_prep.extract dtype=fp8`` / ``dtype=bf16``) on SmolLM2-135M-Instruct and
GSM-symbolic (``gsm_symbolic_train``: the dataset's worked solutions; train split for training, eval split for
validation), in one process, one stage after the other (the target on the runner's approximate path: extraction
verifies nothing):

1. error: the first ``n_error`` validation samples' fp32 features stored as bf16 and as e4m3 under three scalings
   (one power-of-two scale per sample, per token, per token and layer): relative RMS error per column, and the
   teacher distribution ``lm_head(last_hidden)`` against the fp32 one (mean KL, top-1 agreement);
2. disk: the same train and validation samples extracted in bf16 and in fp8: shard bytes per token;
3. tau: the EAGLE-3 drafter (recipe ``eagle3_smollm2_gsm``, ``data.dataset_dir``) trained ``steps`` steps on each
   dataset with the same seed, batches and optimiser; validation ``val/tau_sim`` (gamma 4) at half way and at the end.

``out=DIR`` gets ``results.json``; ``work=DIR`` (default runs/fp8_features) holds the datasets and training runs.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.config import BenchConfig, Output, Seeded, parse_bench
from data_prep.capture import HiddenCapture
from data_prep.extract import extract
from data_prep.extract import parse_args as extract_args
from data_prep.fp8 import FP8, FP8_MAX, dequantize, quantize
from data_prep.samples import SampleBuilder, load_source
from inference.algorithms.options import apply_threads
from inference.drafters import load_lm
from spectrain import fit as fit_cli

USAGE = "python -m benchmarks.fp8_features n_train=256 n_val=32 max_len=384 steps=60 out=DIR"
SOURCE = "gsm_symbolic_train"
RECIPE = "eagle3_smollm2_gsm"


@dataclass
class Fp8BenchConfig(BenchConfig, Output, Seeded):
    """``out``: a directory for results.json (optional)."""

    n_train: int = 256  # source conversations of the train split
    n_val: int = 32  # of the eval split
    n_error: int = 4  # validation samples whose quantization error is measured
    max_len: int = 384
    batch_size: int = 8  # extraction batch
    steps: int = 60
    work: str = "runs/fp8_features"


def relative_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact).norm() / exact.norm())


def per_tensor(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize(x.reshape(1, -1), 1)
    return dequantize(codes, scales, torch.float32).reshape(x.shape)


def per_block(x: torch.Tensor, blocks: int) -> torch.Tensor:
    codes, scales = quantize(x, blocks)
    return dequantize(codes, scales, torch.float32)


def teacher_error(approx: torch.Tensor, exact_logp: torch.Tensor, head: torch.Tensor) -> dict[str, float]:
    """Mean KL(p_exact || p_approx) and top-1 agreement of ``softmax(last_hidden @ head.T)``."""
    q = (approx.float() @ head.T).log_softmax(-1)
    kl = (exact_logp.exp() * (exact_logp - q)).sum(-1)
    return {
        "kl_mean": float(kl.mean()),
        "top1_agreement": float((exact_logp.argmax(-1) == q.argmax(-1)).float().mean()),
    }


def quantization_error(cfg: Any, target) -> dict[str, Any]:
    """Stage 1 on the first ``n_error`` eval-split samples, from fp32 features (the runner's dtype on a CPU)."""
    build = SampleBuilder(target.tokenizer, cfg.max_len)
    conversations = load_source(SOURCE, cfg.n_error, cfg.seed, "eval")
    samples = [s for i, c in enumerate(conversations) if (s := build(i, c)) is not None]
    layers = [1, 14, 26]
    capture = HiddenCapture(target.runner, layers, "fp32")
    rows = [
        row
        for start in range(0, len(samples), cfg.batch_size)
        for row in capture(samples[start : start + cfg.batch_size])
    ]
    aux = torch.cat([r["aux_hidden"] for r in rows]).float()
    last = torch.cat([r["last_hidden"] for r in rows]).float()
    head = target.model.lm_head.weight.detach().float()
    exact_logp = (last @ head.T).log_softmax(-1)
    hidden = last.shape[1]
    stored = {
        "bf16": (aux.bfloat16(), last.bfloat16()),
        "fp8 per sample": (
            torch.cat([per_tensor(r["aux_hidden"]) for r in rows]),
            torch.cat([per_tensor(r["last_hidden"]) for r in rows]),
        ),
        "fp8 per token": (per_block(aux, 1), per_block(last, 1)),
        "fp8 per token and layer": (per_block(aux, len(layers)), per_block(last, 1)),
    }
    result: dict[str, Any] = {"tokens": len(last), "layers": layers, "rel_rms": {}, "teacher": {}}
    for name, (stored_aux, stored_last) in stored.items():
        errors = {
            f"aux layer {layer}": relative_rms(
                stored_aux[:, j * hidden : (j + 1) * hidden], aux[:, j * hidden : (j + 1) * hidden]
            )
            for j, layer in enumerate(layers)
        }
        errors["last_hidden"] = relative_rms(stored_last, last)
        result["rel_rms"][name] = errors
        result["teacher"][name] = teacher_error(stored_last, exact_logp, head)
        print(f"[fp8_features] {name}: {errors}, teacher {result['teacher'][name]}", file=sys.stderr, flush=True)
    # What the per-token scales must span: the largest magnitude of each layer block, across tokens.
    peaks = aux.abs().reshape(len(aux), len(layers), hidden).amax(-1)
    result["block_peak_range"] = {
        f"aux layer {layer}": [float(peaks[:, j].min()), float(peaks[:, j].max())] for j, layer in enumerate(layers)
    }
    result["block_peak_range"]["last_hidden"] = [float(last.abs().amax(-1).min()), float(last.abs().amax(-1).max())]
    result["format"] = {"dtype": str(FP8).removeprefix("torch."), "max": FP8_MAX, "scales": "powers of two"}
    return result


def extract_dataset(cfg: Any, target, dtype: str, split: str, n: int) -> dict[str, Any]:
    out = Path(cfg.work) / f"{dtype}_{split}"
    start = time.perf_counter()
    manifest = extract(
        extract_args(
            [
                "target=smollm2",
                f"source={SOURCE}",
                f"split={split}",
                f"n_samples={n}",
                f"max_len={cfg.max_len}",
                "layers=eagle3",
                f"dtype={dtype}",
                f"batch_size={cfg.batch_size}",
                "device=cpu",
                f"seed={cfg.seed}",
                f"out={out}",
            ]
        ),
        target=target,
    )
    shard_bytes = sum(s["bytes"] for s in manifest["shards"])
    return {
        "dir": str(out),
        "samples": manifest["num_rows"],
        "tokens": manifest["num_tokens"],
        "shard_bytes": shard_bytes,
        "bytes_per_token": shard_bytes / manifest["num_tokens"],
        "extract_s": round(time.perf_counter() - start, 1),
    }


def validations(run_dir: Path) -> list[dict[str, float]]:
    """Every validation row of the run's metrics.csv (``val/*`` columns)."""
    path = next((run_dir / "logs").glob("*/metrics.csv"))
    out = []
    for row in csv.DictReader(open(path)):
        values = {k: float(v) for k, v in row.items() if k.startswith("val/") and v}
        if values:
            out.append({"step": float(row["step"]), **values})
    return out


def train(cfg: Any, dtype: str) -> dict[str, Any]:
    work = Path(cfg.work)
    args = [
        f"recipe={RECIPE}",
        f"run_name={RECIPE}_{dtype}",
        f"source={SOURCE}",
        f"n_samples={cfg.n_train}",
        f"dataset_dir={work / f'{dtype}_train'}",
        f"val_dataset_dir={work / f'{dtype}_eval'}",
        "data.bucket_by_length=false",
        f"max_len={cfg.max_len}",
        f"max_steps={cfg.steps}",
        f"val_check_interval={cfg.steps // 2}",
        f"checkpoint_every_n_steps={cfg.steps}",
        f"seed={cfg.seed}",
        f"runs_dir={work / 'runs'}",
    ]
    start = time.perf_counter()
    result = fit_cli.fit(fit_cli.compose_recipe(args))
    return {
        "fit_args": args,
        "wall_s": round(time.perf_counter() - start, 1),
        "global_step": result["global_step"],
        "validations": validations(Path(result["run_dir"])),
    }


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, Fp8BenchConfig, USAGE)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    apply_threads(cfg)
    torch.manual_seed(cfg.seed)
    # The approximate path: extraction verifies nothing, and on a CPU the exact one (load_lm's default there) costs
    # several times more for [B, T] forwards. Both datasets come from this one runner.
    target = load_lm("smollm2", device="cpu", max_seq_len=cfg.max_len + 1, max_batch_size=cfg.batch_size, exact=False)
    results: dict[str, Any] = {
        "settings": {k: cfg[k] for k in Fp8BenchConfig.__dataclass_fields__},
        "source": SOURCE,
        "recipe": RECIPE,
    }
    results["error"] = quantization_error(cfg, target)
    results["datasets"] = {}
    for dtype in ("bf16", "fp8"):
        results["datasets"][dtype] = {
            split: extract_dataset(cfg, target, dtype, split, n)
            for split, n in (("train", cfg.n_train), ("eval", cfg.n_val))
        }
    bf16, fp8 = (results["datasets"][d]["train"]["bytes_per_token"] for d in ("bf16", "fp8"))
    results["disk_ratio_fp8_to_bf16"] = fp8 / bf16
    print(f"[fp8_features] bytes/token bf16 {bf16:.1f}, fp8 {fp8:.1f}: ratio {fp8 / bf16:.3f}", file=sys.stderr)
    del target
    results["runs"] = {dtype: train(cfg, dtype) for dtype in ("bf16", "fp8")}
    final = {d: results["runs"][d]["validations"][-1]["val/tau_sim"] for d in ("bf16", "fp8")}
    results["delta_tau_sim"] = final["fp8"] - final["bf16"]
    print(
        f"[fp8_features] val tau_sim at step {cfg.steps}: bf16 {final['bf16']:.4f}, fp8 {final['fp8']:.4f}",
        file=sys.stderr,
    )
    text = json.dumps(results, indent=2)
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "results.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
