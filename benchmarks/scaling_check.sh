#!/usr/bin/env bash
# Predicted against measured (docs/scaling.md): one-process LeNet and ResNet-18 runs, the same on
# 2 and 4 CPU processes under each DDP hook, then `python -m src.scaling` over all of them with a
# fresh gloo probe. Waits while the machine's 1-minute load is above 2.5 (other jobs would slow
# the timed runs) and logs the load before each run.
#
#     bash benchmarks/scaling_check.sh [DATA_ROOT] [OUT]    # defaults: ../shared/data, outputs/scaling_check
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-outputs/scaling_check}
PY=.venv/bin/python
COMMON=(data.root="$DATA" max_epochs=3 trainer.limit_val_batches=1 trainer.limit_test_batches=1
        trainer.enable_progress_bar=false trainer.enable_model_summary=false trainer.log_every_n_steps=1)
DDP=(strategy=ddp,ddp_fp16,ddp_bf16,ddp_powersgd devices=2,4 strategy.start_powersgd_iter=2)

wait_for_quiet() {
  while awk '{exit !($1 > 2.5)}' /proc/loadavg; do echo "load $(cut -d' ' -f1 /proc/loadavg): waiting"; sleep 60; done
  echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date +%T): $*"
}

for model in lenet resnet18; do
  if [ "$model" = lenet ]; then SIZE=(data.batch_size=256 trainer.limit_train_batches=40)
  else SIZE=(data.batch_size=32 trainer.limit_train_batches=8); fi
  wait_for_quiet "$model, 1 process"
  $PY -m src.train model=$model "${SIZE[@]}" "${COMMON[@]}" hydra.run.dir="$OUT/$model/1proc" 2>&1 | tail -1
  wait_for_quiet "$model, DDP on 2 and 4 processes"
  $PY -m src.train -m model=$model "${DDP[@]}" "${SIZE[@]}" "${COMMON[@]}" hydra.sweep.dir="$OUT/$model/ddp" 2>&1 | grep -E "test/acc|error" || true
done
wait_for_quiet "probe and prediction"
$PY -m src.scaling "$OUT" --probe
