#!/usr/bin/env bash
# Screenshots of TensorBoard's Time Series, HParams and Custom Scalars views of a small sweep, taken in headless
# Chromium (Debian: apt-get install chromium), for docs/outputs.md.
#
#   bash benchmarks/tensorboard_screenshots.sh <data root> [<out folder, default docs/img>] [<sweep folder>]
#
# The sweep: LeNet under DDP on 1 and 2 processes, seeds 1 and 2, 2 epochs of 6 batches each (4 jobs,
# a few minutes on 2 CPU cores). An existing sweep folder given as third argument is reused.
set -euo pipefail

data_root=${1:?usage: $0 <data root> [<out folder>] [<sweep folder>]}
out=${2:-docs/img}
sweep=${3:-$(mktemp -d)/sweep}
python=${PYTHON:-.venv/bin/python}
tensorboard=$(dirname "$python")/tensorboard
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "error: no chromium on PATH (Debian: apt-get install chromium)" >&2; exit 2; }
mkdir -p "$out"

if [ ! -f "$sweep/report.md" ]; then
    "$python" -m src.train -m model=lenet strategy=ddp devices=1,2 seed=1,2 "data.root=$data_root" \
        max_epochs=2 data.batch_size=64 trainer.limit_train_batches=6 trainer.limit_val_batches=2 \
        trainer.limit_test_batches=2 trainer.enable_progress_bar=false trainer.log_every_n_steps=2 "hydra.sweep.dir=$sweep"
fi

port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$tensorboard" --logdir "$sweep" --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
board=$!
trap 'kill $board 2>/dev/null || true' EXIT
expected=$(find "$sweep" -name 'events.out.tfevents.*' -printf '%h\n' | sort -u | wc -l)
for _ in $(seq 120); do  # until every run folder is served
    served=$(curl -sf "http://127.0.0.1:$port/data/runs" | "$python" -c 'import json, sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
    [ "$served" -ge "$expected" ] && break
    sleep 0.5
done

shot() {  # <view> <file>: the page after its scripts and data requests have settled, curves unsmoothed
    "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1000 \
        --virtual-time-budget=20000 --screenshot="$2" "http://127.0.0.1:$port/?smoothing=0#$1" 2>/dev/null
}
shot timeseries "$out/tensorboard_time_series.png"
shot hparams "$out/tensorboard_hparams.png"
shot custom_scalars "$out/tensorboard_custom_scalars.png"
echo "screenshots of $sweep -> $out/tensorboard_{time_series,hparams,custom_scalars}.png"
