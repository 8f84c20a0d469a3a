#!/usr/bin/env bash
# EAGLE-3 with objective=accept beside the plain recipe (objective=kl) at equal training wall time, on GSM-symbolic
# (eagle3_smollm2_gsm) and on the general setting (eagle3_smollm2, ShareGPT), SmolLM2 features computed online.
# Per setting: a step-time probe per objective (benchmarks.train_step: the same first batches, this process's CPU
# seconds per step, which a shared machine's load does not inflate), then the plain recipe for STEPS steps and
# objective=accept for STEPS x (plain CPU s/step / accept CPU s/step) steps, one fit at a time, each validated once
# at its end on the source's held-out split (val/tau_sim: greedy, gamma = 4). Writes OUT/results.json.
# Run from the repository root.
set -euo pipefail
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-60}  # the plain run's steps; BUDGET_S=seconds sets them from the probe's wall s/step instead
MAX_LEN=${MAX_LEN:-256}
WEIGHT=${WEIGHT:-1.0}
SETTINGS=${SETTINGS:-"gsm general"}
RUNS=${RUNS:-runs/accept_objective}
OUT=${OUT:-benchmarks/results/accept_objective}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS"
for setting in $SETTINGS; do
  case $setting in
    gsm) recipe=eagle3_smollm2_gsm; source=gsm_symbolic_train ;;
    general) recipe=eagle3_smollm2; source=sharegpt ;;
    *) echo "unknown setting $setting (gsm, general)" >&2; exit 2 ;;
  esac
  common=(recipe="$recipe" source="$source" n_samples=2000 n_val_samples=32 max_len="$MAX_LEN" trainer.precision=auto
          seed=0 accept_weight="$WEIGHT")
  for objective in kl accept; do
    "$PYTHON" -m benchmarks.train_step "${common[@]}" objective="$objective" steps=3 threads=2 \
      > "$RUNS/$setting.probe.$objective.log" 2>&1
  done
  cpu() { grep -A2 '^| s/step' "$RUNS/$setting.probe.$1.log" | tail -1 | awk -F'|' '{gsub(/ /, "", $7); print $7}'; }
  kl_s=$(cpu kl); accept_s=$(cpu accept)
  if [ -n "${BUDGET_S:-}" ]; then  # the plain run's steps from a wall budget and the probe's wall s/step
    wall=$(grep -A2 '^| s/step' "$RUNS/$setting.probe.kl.log" | tail -1 | awk -F'|' '{gsub(/ /, "", $2); print $2}')
    STEPS=$("$PYTHON" -c "print(max(1, round($BUDGET_S / $wall)))")
  fi
  accept_steps=$("$PYTHON" -c "print(max(1, round($STEPS * $kl_s / $accept_s)))")
  echo "$setting probe CPU s/step: kl $kl_s, accept $accept_s -> steps kl $STEPS, accept $accept_steps"
  echo "{\"kl\": {\"cpu_s_per_step\": $kl_s, \"steps\": $STEPS}, \"accept\": {\"cpu_s_per_step\": $accept_s, \"steps\": $accept_steps}}" \
    > "$RUNS/$setting.plan.json"
  for objective in kl accept; do
    steps=$([ "$objective" = kl ] && echo "$STEPS" || echo "$accept_steps")
    start=$(date +%s)
    "$PYTHON" -m spectrain.fit "${common[@]}" objective="$objective" run_name="${setting}_$objective" \
      max_steps="$steps" val_check_interval="$steps" checkpoint_every_n_steps="$steps" warmup_steps=10 \
      runs_dir="$RUNS" resume=auto > "$RUNS/${setting}_$objective.log" 2>&1
    echo "$(( $(date +%s) - start ))" > "$RUNS/${setting}_$objective.wall_s"
    echo "$setting $objective: $steps steps, wall $(cat "$RUNS/${setting}_$objective.wall_s") s"
  done
done
"$PYTHON" - "$RUNS" "$OUT" "$SETTINGS" <<'PY'
import csv, json, subprocess, sys
from pathlib import Path

runs, out, settings = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split()
results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
for setting in settings:
    plan = json.loads((runs / f"{setting}.plan.json").read_text())
    arms = {}
    for objective in ("kl", "accept"):
        run = runs / f"{setting}_{objective}"
        rows = [r for p in sorted(run.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(p.open())]
        val = [{k: float(v) for k, v in r.items() if v and (k.startswith("val/") or k == "step")} for r in rows]
        val = [v for v in val if "val/tau_sim" in v]
        train = [r for r in rows if r.get("train/loss_step0")]
        arms[objective] = {
            **plan[objective],
            "wall_s": int((runs / f"{setting}_{objective}.wall_s").read_text()),
            "validation": val[-1] if val else None,
            "last_train_loss_step0": float(train[-1]["train/loss_step0"]) if train else None,
        }
    ratio = {
        key: arms["accept"]["validation"][key] / arms["kl"]["validation"][key]
        for key in ("val/tau_sim", "val/tau_sim_t1")
    }
    results[setting] = {"commit": commit, "arms": arms, "ratio_accept_over_kl": ratio}
(out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
print(json.dumps({s: results[s]["ratio_accept_over_kl"] for s in settings}))
PY
