#!/usr/bin/env bash
# A command run as on a machine whose cores are half as fast as this one's: a busy loop pinned to each core takes
# half of it while the command runs. Exact for one or two busy processes on two cores; with more processes than
# cores they get a little more than half (2/3 at two per core), so its figures are a slow machine's at best.
# For the suite's time on the slower CPU that issue 32 names (docs/results.md, "The test suite's time"):
#   sudo benchmarks/half_speed.sh benchmarks/without_avx512.sh .venv/bin/python -m pytest -n 2 --dist worksteal
# Needs root: the kernel's automatic session groups are switched off meanwhile, so that a process that starts a
# session of its own does not get a whole core's share beside the loop.
set -euo pipefail
if (($# == 0)); then echo "error: usage: benchmarks/half_speed.sh <command> [args...]" >&2; exit 2; fi
autogroup=/proc/sys/kernel/sched_autogroup_enabled
if ((EUID != 0)) || [[ ! -w $autogroup ]]; then
    echo "error: benchmarks/half_speed.sh needs root, to switch off $autogroup while the command runs" >&2
    exit 2
fi
was=$(<"$autogroup")
loops=()
finish() {
    kill "${loops[@]}" 2>/dev/null || true
    echo "$was" >"$autogroup"
}
trap finish EXIT
echo 0 >"$autogroup"
for cpu in $(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))'); do
    taskset -c "$cpu" bash -c 'while :; do :; done' &
    loops+=($!)
done
status=0
"$@" || status=$?
exit "$status"
