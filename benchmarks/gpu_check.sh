#!/usr/bin/env bash
# The GPU checks and measurements of docs/results.md (§ GPU) on a machine with a CUDA GPU, and one record of them.
#   benchmarks/gpu_check.sh <part> <data root> <log folder>
# parts: tests           pytest -m gpu, the two-rank module left out
#        ddp2            tests/test_gpu_ddp.py: two NCCL ranks on one GPU, each a torchrun node of its own
#        speed-lenet     benchmarks/speed.py: the rows of docs/results.md (GPU), side by side
#        speed-resnet18
#        accuracy        experiment=d2l_lenet and d2l_resnet18, seeds 1-3, at the GPU defaults
#        all             every part above: tests and ddp2 side by side (they check, they time nothing that
#                        docs/results.md reports), then speed and accuracy alone; about 10 minutes on an H100
# Each part writes <log folder>/<part>.log (tests also <part>.xml); every call ends by writing
# <log folder>/summary.md from whatever the folder holds (benchmarks/gpu_summary.py). Exit status 1
# if a part failed, 2 for a wrong command line.
set -uo pipefail
parts=(tests ddp2 speed-lenet speed-resnet18 accuracy)
usage="usage: benchmarks/gpu_check.sh <${parts[*]// /|}|all> <data root> <log folder>"
if (($# != 3)); then echo "error: $usage" >&2; exit 2; fi
part=$1 data=$2 logs=$3
if [[ $part != all && " ${parts[*]} " != *" $part "* ]]; then
    echo "error: part=$part: choose one of ${parts[*]} or all" >&2; exit 2
fi
if [[ ! -d $data/FashionMNIST/raw ]]; then
    echo "error: data root=$data: no FashionMNIST/raw in it" >&2; exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/ import src where the project is not installed
data=$(cd "$OLDPWD" && cd "$data" && pwd)
mkdir -p "$logs" && logs=$(cd "$logs" && pwd)
export PYTHONUNBUFFERED=1 FASHION_MNIST_ROOT="$data"
py=${PYTHON:-python3}
status=0

run() {  # name, command...: the command's output to <log folder>/<name>.log, and its status remembered
    local name=$1; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$logs/$name.log" 2>&1 || { echo "   failed with status $?"; status=1; }
    echo "   $((SECONDS - start)) s"
    tail -n 3 "$logs/$name.log"
}

wanted() { [[ $part == all || $part == "$1" ]]; }

{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    else
        echo "no nvidia-smi on this machine"
    fi
    "$py" -c 'import platform, torch, lightning, torchmetrics, torchvision
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}), "
      f"lightning {lightning.__version__}, torchmetrics {torchmetrics.__version__}, torchvision {torchvision.__version__}")'
    echo "$(nproc) CPU cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
} >"$logs/environment.log" 2>&1
cat "$logs/environment.log"

pytest=("$py" -m pytest -v --tb=short --durations=20 -p no:cacheprovider -o junit_logging=system-out)
checks=()
workers=0  # pytest-xdist's: three where there is a GPU; elsewhere every gpu test is skipped, and one process collects
if command -v nvidia-smi >/dev/null; then workers=3; fi
if wanted tests; then
    (run tests "${pytest[@]}" -n "$workers" -m gpu --junitxml="$logs/tests.xml" --ignore=tests/test_gpu_ddp.py tests/; exit $status) &
    checks+=($!)
fi
if wanted ddp2; then  # four pairs of ranks at a time: each pair is two processes of a few percent of the GPU
    (run ddp2 "${pytest[@]}" -n 4 --junitxml="$logs/ddp2.xml" tests/test_gpu_ddp.py; exit $status) &
    checks+=($!)
fi
for check in "${checks[@]}"; do wait "$check" || status=1; done
# The rows docs/results.md reports; speed.py --ablation without --only times every setting and precision.
common="book (torchvision + 4 workers),plain reduce-overhead,framework fp32 (old default),framework default,framework one step a batch,framework compile=true cuda_graphs=true"
rows_lenet="$common,plain fp32,framework 32,framework 32 channels_last,framework bf16-mixed"
rows_resnet18="$common,plain fast,framework compile=true,framework 32 channels_last,framework 16-mixed channels_last,framework bf16-mixed"
for model in lenet resnet18; do
    if wanted "speed-$model"; then
        rows=rows_$model
        run "speed-$model" "$py" benchmarks/speed.py --data-root "$data" --model "$model" --steps 64 --rounds 4 --ablation \
            --only "${!rows}"
    fi
done
if wanted accuracy; then
    for experiment in d2l_lenet d2l_resnet18; do
        run "accuracy-$experiment" "$py" -m src.train -m "experiment=$experiment" seed=1,2,3 "data.root=$data" \
            "hydra.sweep.dir=$logs/accuracy/$experiment"
    done
fi
"$py" benchmarks/gpu_summary.py "$logs" || status=1
exit $status
