#!/usr/bin/env bash
# The GPU checks and measurements of docs/results.md (§ GPU) on a machine with a CUDA GPU, and one record of them.
#   benchmarks/gpu_check.sh <part> <data root> <log folder>
# parts: quick           what matters, within 5 minutes on an H100: side by side, each under its own time bound, the
#                        book's two recipes (experiment=d2l_lenet and d2l_resnet18, seed 1, packed on the GPU by
#                        hydra/launcher=parallel: test acc >= 0.83 and >= 0.90, val/acc above the first epoch's by the
#                        last), the float64 SyncBatchNorm oracle, CUDA graphs against eager steps (uneven last batch,
#                        validation, cosine warm-up, 16-mixed), the host waits of 16-mixed steps, two NCCL ranks (one
#                        hook; SIGTERM and resume), one run as src.train starts a DDP rank (spawned by torch's elastic
#                        agent; the launching process must hold no GPU memory); then alone, ResNet-18's speed rows
#                        (eager and graphed) with DDP's step with and without the callback that logs xfer/*. No pass
#                        where a selected test was skipped or none ran.
#        tests           pytest -m gpu, the two-rank module left out
#        ddp2            tests/test_gpu_ddp.py: two NCCL ranks on one GPU, each a torchrun node of its own
#        speed-lenet     benchmarks/speed.py: the rows of docs/results.md (GPU), side by side
#        speed-resnet18
#        accuracy        experiment=d2l_lenet and d2l_resnet18, seeds 1-3, at the GPU defaults
#        all             every part above but quick: tests and ddp2 side by side (they check, they time nothing that
#                        docs/results.md reports), then speed and accuracy alone; about 10 minutes on an H100
# WHEELS=<folder> unpacks the wheels in it (pure Python ones: hydra-core, omegaconf, antlr4-python3-runtime, submitit,
# cloudpickle, made here with `pip wheel --no-deps -w <folder> <name>==<version>`) onto PYTHONPATH first, for a machine
# whose Python has torch and Lightning but not these. Each part writes <log folder>/<part>.log and <part>.status (its
# exit status, 124 when it ran out of time, and its seconds; tests also <part>.xml); every call ends by writing
# <log folder>/summary.md from whatever the folder holds (benchmarks/gpu_summary.py). Run folders go to a temporary
# folder; the log folder keeps their records without checkpoints. Exit status 1 without a CUDA GPU, if a part failed,
# a test part ran no test (or, in quick, skipped one) or quick's recipes missed a bar; 2 for a wrong command line.
set -uo pipefail
parts=(quick tests ddp2 speed-lenet speed-resnet18 accuracy)
usage="usage: benchmarks/gpu_check.sh <${parts[*]// /|}|all> <data root> <log folder>"
if (($# != 3)); then echo "error: $usage" >&2; exit 2; fi
part=$1 data=$2 logs=$3
if [[ $part != all && " ${parts[*]} " != *" $part "* ]]; then
    echo "error: part=$part: choose one of ${parts[*]} or all" >&2; exit 2
fi
if [[ ! -d $data/FashionMNIST/raw ]]; then
    echo "error: data root=$data: no FashionMNIST/raw in it" >&2; exit 2
fi
if [[ -n ${WHEELS:-} && -z $(compgen -G "$WHEELS/*.whl") ]]; then
    echo "error: WHEELS=$WHEELS: no .whl files in it" >&2; exit 2
fi
py=${PYTHON:-python3}
# Without a GPU every check would be skipped, and pytest counts skipped tests a success.
if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "error: no CUDA GPU here ($py: torch.cuda.is_available() is false or torch is missing); these checks need one" >&2
    exit 1
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/ import src where the project is not installed
data=$(cd "$OLDPWD" && cd "$data" && pwd)
mkdir -p "$logs" && logs=$(cd "$logs" && pwd)
runs=$(mktemp -d)  # run folders, checkpoints and all; the log folder keeps their records alone (keep_records)
export PYTHONUNBUFFERED=1 FASHION_MNIST_ROOT="$data"
status=0

if [[ -n ${WHEELS:-} ]]; then  # a wheel is a zip of the package as it is installed
    site=$(mktemp -d)
    for wheel in "$WHEELS"/*.whl; do "$py" -m zipfile -e "$wheel" "$site" || status=1; done
    export PYTHONPATH="$PYTHONPATH:$site"
fi

run() {  # [-t seconds] name command...: the command's output to <log folder>/<name>.log, its status remembered
    local limit=()
    # SIGINT, as Ctrl-C: pytest then ends its tests' own process groups (two-rank runs), and runs say where they stopped
    if [[ $1 == -t ]]; then limit=(timeout -s INT -k 20 "$2"); shift 2; fi
    local name=$1; shift
    echo "== $name: $*"
    local start=$SECONDS code=0
    "${limit[@]}" "$@" >"$logs/$name.log" 2>&1 || code=$?
    echo "$code $((SECONDS - start))" >"$logs/$name.status"
    if ((code)); then echo "   failed with status $code$( ((code == 124)) && echo ' (out of time)')"; status=1; fi
    echo "   $((SECONDS - start)) s"
    tail -n 3 "$logs/$name.log"
}

wanted() { [[ $part == "$1" || ($part == all && $1 != quick) ]]; }

keep_records() {  # from to: a sweep's or run's folder without its checkpoints, small enough for a caller to fetch
    [[ -d $1 ]] || return 0
    "$py" -c 'import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], ignore=shutil.ignore_patterns("*.ckpt", "*.partial"), dirs_exist_ok=True)' "$@"
}

spawned() {  # seconds: one run as src.train starts a DDP rank (torch's elastic agent, spawn); the launching process
             # must hold no GPU memory: it must not be among the GPU's processes while its rank trains
    "$py" -m src.train debug=quick strategy=ddp devices=1 accelerator=gpu "data.root=$data" "hydra.run.dir=$runs/spawned" &
    local launcher=$! seen=" " code=0 deadline=$((SECONDS + $1))
    while kill -0 "$launcher" 2>/dev/null; do
        if ((SECONDS > deadline)); then kill -INT "$launcher"; echo "out of time"; deadline=$((SECONDS + 60)); fi
        seen+="$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
        sleep 0.5
    done
    wait "$launcher" || code=$?
    keep_records "$runs/spawned" "$logs/spawned"
    local pids
    pids=$(tr ' ' '\n' <<<"$seen" | sort -un | xargs)
    echo "launching process: $launcher; processes on the GPU meanwhile: ${pids:-none}"
    if ((code)); then return "$code"; fi
    if [[ -z $pids ]]; then echo "cannot tell: nvidia-smi listed no process on the GPU, not even the rank"; return 1; fi
    if [[ " $pids " == *" $launcher "* ]]; then echo "the launching process held GPU memory"; return 1; fi
    echo "the launching process held no GPU memory"
}

{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    else
        echo "no nvidia-smi on this machine"
    fi
    "$py" -c 'import platform, torch, lightning, torchmetrics, torchvision, hydra
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}), "
      f"lightning {lightning.__version__}, torchmetrics {torchmetrics.__version__}, torchvision {torchvision.__version__}, "
      f"hydra {hydra.__version__}")'
    echo "$(nproc) CPU cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
} >"$logs/environment.log" 2>&1 || status=1
cat "$logs/environment.log"

pytest=("$py" -m pytest -v --tb=short --durations=20 -p no:cacheprovider -o junit_logging=system-out)
# ResNet-18's speed rows of quick; the last two time DDP's step (one process) with and without the xfer/ callback.
quick_speed="framework default,framework cuda_graphs=auto,framework compile=true cuda_graphs=true,plain reduce-overhead,framework ddp,framework ddp without comm callback"
checks=()
if wanted quick; then  # each part a few percent of the GPU; they share it, and the 16 cores
    q=180  # seconds each part of the first stage may take; the speed rows then take at most 100, alone
    (run -t $q recipes "$py" -m src.train -m experiment=d2l_lenet,d2l_resnet18 seed=1 "data.root=$data" \
        hydra/launcher=parallel hydra.launcher.jobs_per_gpu=2 "hydra.sweep.dir=$runs/recipes"
     keep_records "$runs/recipes" "$logs/recipes"; exit $status) &
    checks+=($!)
    (run spawned spawned $q; exit $status) &
    checks+=($!)
    (run -t $q syncbn "${pytest[@]}" -m gpu --junitxml="$logs/syncbn.xml" tests/test_sync_batchnorm.py tests/test_gpu_ddp.py \
        -k "torch_syncbatchnorm or (two_ranks_end and lenet_bn_sync)"; exit $status) &
    checks+=($!)
    (run -t $q syncbn-resnet18 "${pytest[@]}" --junitxml="$logs/syncbn-resnet18.xml" tests/test_gpu_ddp.py \
        -k "two_ranks_end and resnet18"; exit $status) &
    checks+=($!)
    (run -t $q graphs "${pytest[@]}" --junitxml="$logs/graphs.xml" tests/test_gpu.py \
        -k "(cuda_graph_steps_train and not lenet-True) or waits_in_its_forward or 16_mixed_steps_wait"; exit $status) &
    checks+=($!)
    (run -t $q nccl "${pytest[@]}" --junitxml="$logs/nccl.xml" tests/test_gpu_ddp.py \
        -k "(every_hook and lenet and not fp16 and not bf16 and not powersgd) or (sigterm and lenet)"; exit $status) &
    checks+=($!)
    # Compiles what the speed rows compile, so that torch.compile's caches serve them there; its times count for nothing.
    (run -t $q speed-warm-up "$py" benchmarks/speed.py --data-root "$data" --model resnet18 --steps 8 --rounds 2 \
        --only "framework compile=true cuda_graphs=true,plain reduce-overhead"; exit $status) &
    checks+=($!)
fi
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
if wanted quick; then
    run -t 100 speed-resnet18 "$py" benchmarks/speed.py --data-root "$data" --model resnet18 --steps 64 --rounds 4 \
        --only "$quick_speed"
fi
# The rows docs/results.md reports; speed.py --ablation without --only times every setting and precision.
common="book (torchvision + 4 workers),plain reduce-overhead,framework fp32 (old default),framework default,framework cuda_graphs=auto,framework one step a batch,framework compile=true cuda_graphs=true"
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
            "hydra.sweep.dir=$runs/accuracy/$experiment"
        keep_records "$runs/accuracy/$experiment" "$logs/accuracy/$experiment"
    done
fi
summary=("$py" benchmarks/gpu_summary.py "$logs")
if [[ $part == quick ]]; then summary+=(--quick); fi
"${summary[@]}" || status=1
exit $status
