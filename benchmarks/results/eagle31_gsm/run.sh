#!/usr/bin/env bash
# EAGLE-3 vs EAGLE-3.1 on GSM-symbolic at equal steps (same data, seed, batches, optimiser): validation τ_sim.
# Run from the repository root; one fit at a time. Prints each run's wall seconds.
set -euo pipefail
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-60}
RUNS=${RUNS:-runs/eagle31_gsm}
COMMON=(source=gsm_symbolic_train n_samples=2000 n_val_samples=32 max_len=${MAX_LEN:-640} max_steps="$STEPS"
        val_check_interval=$((STEPS / 2)) checkpoint_every_n_steps="$STEPS" trainer.precision=${PRECISION:-auto} seed=0
        runs_dir="$RUNS")
export HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
for recipe in eagle3_smollm2_gsm eagle31_smollm2_gsm; do
  start=$(date +%s)
  "$PYTHON" -m spectrain.fit recipe="$recipe" "${COMMON[@]}" > "$RUNS.$recipe.log" 2>&1
  echo "$recipe wall_s=$(( $(date +%s) - start ))"
done
