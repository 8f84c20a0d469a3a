#!/usr/bin/env bash
# EAGLE-3 with objective=accept beside the plain recipe (objective=kl): GSM-symbolic (eagle3_smollm2_gsm) and the
# general setting (eagle3_smollm2, ShareGPT), on SmolLM2-135M-Instruct features extracted once (data_prep.extract,
# layers 1/14/26 + final hidden state, bf16): N_TRAIN train-split and N_VAL eval-split samples per setting. Both arms
# train the same steps on the same batches (seed 0); each fit's wall and CPU seconds are recorded (/usr/bin/time), so
# the arms' training time can be compared; each is validated once, at its end, on the eval-split features
# (val/tau_sim: greedy, gamma = 4; val/tau_sim_t1: at T = 1). One process at a time, one thread each (on a loaded
# 2-core host more threads only spin). Writes OUT/results.json. Run from the repository root.
set -euo pipefail
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-40}
MAX_LEN=${MAX_LEN:-256}
N_TRAIN=${N_TRAIN:-96}
N_VAL=${N_VAL:-32}
WEIGHT=${WEIGHT:-1.0}
SETTINGS=${SETTINGS:-"gsm general"}
RUNS=${RUNS:-runs/accept_objective}
OUT=${OUT:-benchmarks/results/accept_objective}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1
mkdir -p "$RUNS/feats"
for setting in $SETTINGS; do
  case $setting in
    gsm) recipe=eagle3_smollm2_gsm; source=gsm_symbolic_train ;;
    general) recipe=eagle3_smollm2; source=sharegpt ;;
    *) echo "unknown setting $setting (gsm, general)" >&2; exit 2 ;;
  esac
  for split in train val; do
    n=$([ "$split" = train ] && echo "$N_TRAIN" || echo "$N_VAL")
    "$PYTHON" -m data_prep.extract target=smollm2 source="$source" split="$([ "$split" = train ] && echo train || echo eval)" \
      n_samples="$n" max_len="$MAX_LEN" layers=eagle3 dtype=bf16 batch_size=4 out="$RUNS/feats/${setting}_$split" \
      > "$RUNS/feats/${setting}_$split.log" 2>&1
  done
  for objective in kl accept; do
    /usr/bin/time -f "%e %U %S" -o "$RUNS/${setting}_$objective.time" \
      "$PYTHON" -m spectrain.fit recipe="$recipe" source="$source" n_samples="$N_TRAIN" max_len="$MAX_LEN" \
      data.dataset_dir="$RUNS/feats/${setting}_train" data.val_dataset_dir="$RUNS/feats/${setting}_val" \
      data.bucket_by_length=false trainer.precision=auto seed=0 objective="$objective" accept_weight="$WEIGHT" \
      run_name="${setting}_$objective" max_steps="$STEPS" val_check_interval="$STEPS" \
      checkpoint_every_n_steps="$STEPS" warmup_steps=10 runs_dir="$RUNS" resume=auto > "$RUNS/${setting}_$objective.log" 2>&1
    echo "$setting $objective: $STEPS steps, wall/user/sys s $(cat "$RUNS/${setting}_$objective.time")"
  done
done
"$PYTHON" - "$RUNS" "$OUT" "$SETTINGS" "$STEPS" <<'PY'
import csv, json, subprocess, sys
from pathlib import Path

runs, out, settings, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
for setting in settings:
    arms = {}
    for objective in ("kl", "accept"):
        run = runs / f"{setting}_{objective}"
        rows = [r for p in sorted(run.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(p.open())]
        val = [{k: float(v) for k, v in r.items() if v and (k.startswith("val/") or k == "step")} for r in rows]
        val = [v for v in val if "val/tau_sim" in v]
        train = [r for r in rows if r.get("train/loss_step0")]
        wall, user, system = (float(x) for x in (runs / f"{setting}_{objective}.time").read_text().split()[-3:])
        arms[objective] = {
            "steps": steps,
            "wall_s": wall,
            "cpu_s": round(user + system, 1),
            "validation": val[-1] if val else None,
            "last_train_loss_step0": float(train[-1]["train/loss_step0"]) if train else None,
            "last_train_accepted_length": next(
                (float(r["train/accepted_length"]) for r in reversed(rows) if r.get("train/accepted_length")), None
            ),
        }
    ratio = {
        key: arms["accept"]["validation"][key] / arms["kl"]["validation"][key]
        for key in ("val/tau_sim", "val/tau_sim_t1")
    }
    results[setting] = {"commit": commit, "arms": arms, "ratio_accept_over_kl": ratio}
(out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
print(json.dumps({s: results[s]["ratio_accept_over_kl"] for s in settings}))
PY
