"""``python -m benchmarks.exact_prefill [baseline=REV] [lengths=[512,2048]] [repeats=2] [threads=1] [max_seq_len=N]
[out=DIR]``

What an exact-mode prefill of a long prompt costs on SmolLM2-135M in fp32: seconds of one runner forward over a
random prompt of each length (the last token's logits only, as the engine prefills), on

- ``exact``: this checkout's exact path (``docs/numerics.md``);
- ``baseline``: the exact path of the git revision ``baseline``, checked out into a temporary worktree (left out
  without ``baseline=``);
- ``plain``: this checkout's plain kernels (``exact=false``), for reference.

Each measurement runs in a process of its own (SmolLM2 loaded, the probe run, one short forward to pack the weights,
then the timed prefill), the variants in turn, ``repeats`` rounds, so that a change in a shared machine's load hits
them alike: compare the ratios of one run, not absolute seconds. Each run records wall seconds and the CPU seconds of
its process (``time.process_time``, which another job on the machine inflates less). The runners hold
``max_seq_len`` positions (default: the prompt's length + 16). Each exact run also hashes the KV cache's written slots
and the logits it returned; ``bitwise_equal`` says whether the baseline's hashes equal this checkout's (the exact path's
promise is that a change of its speed changes no bit). Prints a table; ``out=DIR`` writes ``DIR/results.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Output, Repeats, parse_bench
from core.overrides import OverrideError, run_cli
from inference.device import cpu_description

USAGE = (
    "python -m benchmarks.exact_prefill [baseline=REV] lengths=[512,2048] repeats=2 threads=1 [max_seq_len=N] out=DIR"
)
REPO = Path(__file__).resolve().parents[1]

# Run in the checkout under test (its own imports only, the API every revision of it has): prints one JSON line.
CHILD = """
import hashlib, json, sys, time
import torch
from core import assets
from inference.runner import ModelRunner

length, path, threads, max_seq_len = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
model = assets.load_model("smollm2")
runner = ModelRunner.from_hf_model(model, dtype=torch.float32, max_seq_len=max_seq_len, exact=path != "plain")
ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
runner.reset(1)
runner.forward(ids[:, :8], only_last_logits=True)  # packs the weights, loads the kernels: not timed
runner.reset(1)
start, cpu = time.perf_counter(), time.process_time()
logits = runner.forward(ids, only_last_logits=True).logits
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
digest = hashlib.sha256()
# the written slots only (the caches' padding may differ between revisions); exact mode keeps keys transposed
keys = runner.k_cache[..., :length] if path != "plain" else runner.k_cache[:, :, :, :length]
for tensor in (keys, runner.v_cache[:, :, :, :length], logits):
    digest.update(tensor.detach().contiguous().numpy().tobytes())
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "sha256": digest.hexdigest(), "exactness": runner.exactness.summary()}))
"""


@dataclass
class ExactPrefillConfig(BenchConfig, Output, Repeats):
    """``out``: a directory for results.json (optional)."""

    baseline: str | None = None  # a git revision whose exact path is timed beside this checkout's
    lengths: list[int] = field(default_factory=lambda: [512, 2048])
    repeats: int = 2  # each run is a process that loads SmolLM2 and prefills for up to a minute
    max_seq_len: int = 0  # the runners' cache length; 0: each prompt's length + 16


def parse_args(argv: Sequence[str]) -> ExactPrefillConfig:
    return parse_bench(argv, ExactPrefillConfig, USAGE)


def _run_child(tree: Path, length: int, path: str, threads: int, max_seq_len: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(length), path, str(threads), str(max_seq_len)],
        cwd=tree,
        env={**_environment(), "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the {path} prefill of {length} tokens in {tree} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _environment() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _commit(tree: Path, rev: str = "HEAD") -> str:
    return subprocess.run(
        ["git", "rev-parse", rev], cwd=tree, capture_output=True, text=True, check=True
    ).stdout.strip()


def measure(cfg) -> dict:
    """Every length's times (seconds per run, in the order run), medians, ratios and hashes."""
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"exact": REPO, "plain": REPO}
        if cfg.baseline:
            base = Path(scratch) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), cfg.baseline], cwd=REPO, check=True)
            trees = {"baseline": base, **trees}
        try:
            rows = []
            for length in cfg.lengths:
                runs = {name: [] for name in trees}
                for _ in range(cfg.repeats):
                    for name, tree in trees.items():
                        runs[name].append(
                            _run_child(
                                tree,
                                length,
                                "plain" if name == "plain" else "exact",
                                cfg.threads,
                                cfg.max_seq_len or length + 16,
                            )
                        )
                        print(f"  {length} tokens, {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr)
                rows.append(_summary(length, runs))
        finally:
            if cfg.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    return {
        "config": OmegaConf.to_container(cfg),
        "commit": _commit(REPO),
        "baseline_commit": _commit(REPO, cfg.baseline) if cfg.baseline else None,
        "cpu": cpu_description(),
        "unit": "s",
        "rows": rows,
    }


def _summary(length: int, runs: dict[str, list[dict]]) -> dict:
    row = {"length": length, "exactness": runs["exact"][0]["exactness"]}
    for name, results in runs.items():
        row[f"{name}_s"] = [r["seconds"] for r in results]
        row[f"{name}_median_s"] = statistics.median(row[f"{name}_s"])
        row[f"{name}_cpu_s"] = [r["cpu_seconds"] for r in results]
        row[f"{name}_median_cpu_s"] = statistics.median(row[f"{name}_cpu_s"])
    hashes = {name: {r["sha256"] for r in results} for name, results in runs.items() if name != "plain"}
    row["deterministic"] = all(len(h) == 1 for h in hashes.values())
    row["exact_over_plain"] = row["exact_median_s"] / row["plain_median_s"]
    row["exact_over_plain_cpu"] = row["exact_median_cpu_s"] / row["plain_median_cpu_s"]
    if "baseline" in runs:
        row["bitwise_equal"] = hashes["baseline"] == hashes["exact"] and row["deterministic"]
        row["baseline_over_exact"] = row["baseline_median_s"] / row["exact_median_s"]
        row["baseline_over_exact_cpu"] = row["baseline_median_cpu_s"] / row["exact_median_cpu_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    def run(args: list[str]) -> dict:
        cfg = parse_args(args)
        if cfg.repeats < 1 or not cfg.lengths or min(cfg.lengths) < 8:
            raise OverrideError("repeats must be >= 1 and every length >= 8 (the untimed warm-up forward's tokens)")
        return measure(cfg)

    def report(record: dict) -> None:
        print(f"SmolLM2-135M fp32 prefill, {record['config']['threads']} thread(s), {record['cpu']}")
        baseline = record["baseline_commit"]
        print(f"commit {record['commit'][:9]}" + (f", baseline {baseline[:9]}" if baseline else ""))
        print("medians; wall seconds (CPU seconds of the process)")
        print("| prompt tokens | baseline exact | exact | plain | baseline ÷ exact | exact ÷ plain | bitwise |")
        print("|---|---|---|---|---|---|---|")
        for row in record["rows"]:
            cells = []
            for name in ("baseline", "exact", "plain"):
                wall, cpu = row.get(f"{name}_median_s"), row.get(f"{name}_median_cpu_s")
                cells.append("-" if wall is None else f"{wall:.1f} s ({cpu:.1f} s)")
            for ratio in ("baseline_over_exact", "exact_over_plain"):
                wall, cpu = row.get(ratio), row.get(f"{ratio}_cpu")
                cells.append("-" if wall is None else f"{wall:.2f} ({cpu:.2f})")
            print(f"| {row['length']} | {' | '.join(cells)} | {row.get('bitwise_equal', '-')} |")
        if record["config"]["out"]:
            out = Path(record["config"]["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {out / 'results.json'}")

    return run_cli(argv, run, doc=__doc__, schema=ExactPrefillConfig, report=report)


if __name__ == "__main__":
    sys.exit(main())
