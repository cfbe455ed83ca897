#!/usr/bin/env bash
# The GPU checks and measurements of docs/results.md ("On a GPU"), in parts that each fit a short session.
#   benchmarks/gpu_check.sh <part> <data root> <log folder>
# parts: tests (pytest -m gpu), speed-lenet, speed-resnet18 (benchmarks/speed.py --ablation),
#        accuracy (experiment=d2l_lenet and d2l_resnet18 at the defaults), all
set -uo pipefail
part=${1:?part: tests, speed-lenet, speed-resnet18, accuracy or all}
data=${2:?data root: a folder holding FashionMNIST/raw}
logs=${3:?log folder}
cd "$(dirname "$0")/.."
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 FASHION_MNIST_ROOT="$data"
py=${PYTHON:-python3}
status=0
run() {  # name, command...: the command's output to <log folder>/<name>.log, and its status remembered
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$logs/$name.log" 2>&1 || { echo "   failed with status $?"; status=1; }
    tail -n 4 "$logs/$name.log"
}
if [[ $part == tests || $part == all ]]; then
    run tests "$py" -m pytest -v --tb=short --durations=15 -m gpu -p no:cacheprovider tests/
fi
for model in lenet resnet18; do
    if [[ $part == speed-$model || $part == all ]]; then
        run "speed-$model" "$py" benchmarks/speed.py --data-root "$data" --model "$model" --steps 64 --rounds 4 --ablation
    fi
done
if [[ $part == accuracy || $part == all ]]; then
    for experiment in d2l_lenet d2l_resnet18; do
        run "$experiment" "$py" -m src.train "experiment=$experiment" "data.root=$data" "hydra.run.dir=$logs/runs/$experiment"
    done
fi
exit $status
