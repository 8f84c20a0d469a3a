#!/usr/bin/env bash
# The longer CPU run behind BENCHMARKS.md: the same pipeline as `make demo` (extract -> train draft LM, H-RAD,
# EAGLE-3, SpecBlock -> export -> evaluate every algorithm against AR in one run), with more data, more steps,
# three benchmarks. About an hour on a 2-core CPU; re-running resumes finished stages.
#   bash benchmarks/full_cpu.sh [OUT]        (default runs/full_cpu; figures in OUT/eval/report.md, results.json)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/full_cpu}"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m inference.demo out="$OUT" n_samples=240 n_val_samples=16 max_len=192 train_steps=200 \
    trace_prompts=32 bench=[mt_bench,humaneval,gsm_symbolic] n_prompts=3 max_new_tokens=48
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ), $(nproc) cores"
