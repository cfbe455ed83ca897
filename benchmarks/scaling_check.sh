#!/usr/bin/env bash
# Predicted against measured (docs/scaling.md): one-process LeNet and ResNet-18 runs, the same on
# 2 CPU processes under each DDP hook (none, fp16, bf16, powersgd) and on 4 under plain all-reduce,
# then `python -m src.scaling` over all of them with a fresh gloo probe. Waits while the machine's
# 1-minute load is above LOAD_LIMIT (default 2.5: other jobs would slow the timed runs) and logs
# the load before each run.
#
#     bash benchmarks/scaling_check.sh [DATA_ROOT] [OUT]    # defaults: ../shared/data, outputs/scaling_check
#     MODELS=lenet bash benchmarks/scaling_check.sh ...      # one model only (default: lenet resnet18)
#     REPEATS=1 bash benchmarks/scaling_check.sh ...         # each setting once (default: 3)
#     BASELINE_RUNS=1 bash benchmarks/scaling_check.sh ...   # one-process runs per repeat (default: 2)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-outputs/scaling_check}
PY=${PY:-.venv/bin/python}
MODELS=${MODELS:-lenet resnet18}
COMMON=(data.root="$DATA" max_epochs=3 trainer.limit_val_batches=1 trainer.limit_test_batches=1
        trainer.enable_progress_bar=false trainer.enable_model_summary=false trainer.log_every_n_steps=1)
# One thread per process: the one-process run is then one core, as each of 2 DDP processes on
# 2 cores is (Lightning gives each cores / processes threads), and on a busy machine several
# threads of one process mostly wait for each other.
export OMP_NUM_THREADS=1
LOAD_LIMIT=${LOAD_LIMIT:-2.5}
REPEATS=${REPEATS:-3}
# Every prediction scales from the one-process run, so its noise moves them all (LeNet's epoch here:
# 1.93 to 2.29 s between repeats); it runs BASELINE_RUNS times in each repeat.
BASELINE_RUNS=${BASELINE_RUNS:-2}

wait_for_quiet() {
  while awk -v limit="$LOAD_LIMIT" '{exit !($1 > limit)}' /proc/loadavg; do echo "load $(cut -d' ' -f1 /proc/loadavg): waiting"; sleep 60; done
  echo "load $(cut -d' ' -f1-3 /proc/loadavg) at $(date +%T): $*"
}

# One run's epoch time here can differ from the next one's by as much as the model's error: every
# setting runs REPEATS times, the repeats interleaved so that a slow spell touches all settings alike, and
# `src.scaling` compares the medians.
for repeat in $(seq 1 "$REPEATS"); do
  for model in $MODELS; do
    if [ "$model" = lenet ]; then SIZE=(data.batch_size=256 trainer.limit_train_batches=30)
    else SIZE=(data.batch_size=32 trainer.limit_train_batches=5); fi
    DIR="$OUT/$model/r$repeat"
    for run in $(seq 1 "$BASELINE_RUNS"); do
      wait_for_quiet "$model, repeat $repeat, 1 process, run $run"
      $PY -m src.train model=$model "${SIZE[@]}" "${COMMON[@]}" hydra.run.dir="$DIR/1proc$([ "$run" = 1 ] || echo "_$run")" 2>&1 | tail -1
    done
    wait_for_quiet "$model, repeat $repeat, DDP on 2 processes, each hook"
    $PY -m src.train -m model=$model strategy=ddp,ddp_fp16,ddp_bf16 devices=2 "${SIZE[@]}" "${COMMON[@]}" hydra.sweep.dir="$DIR/ddp2" 2>&1 | grep -E "test/acc|error" || true
    $PY -m src.train model=$model strategy=ddp_powersgd devices=2 strategy.start_powersgd_iter=2 "${SIZE[@]}" "${COMMON[@]}" hydra.run.dir="$DIR/ddp2/powersgd" 2>&1 | tail -1
    wait_for_quiet "$model, repeat $repeat, DDP on 4 processes"
    $PY -m src.train model=$model strategy=ddp devices=4 "${SIZE[@]}" "${COMMON[@]}" hydra.run.dir="$DIR/ddp4" 2>&1 | tail -1
  done
done
wait_for_quiet "probe and prediction"
$PY -m src.scaling "$OUT" --probe
