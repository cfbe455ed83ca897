#!/usr/bin/env bash
# A command run as on a CPU without AVX-512, on one that has it: torch's kernels and oneDNN's capped at AVX2,
# and a /proc/cpuinfo without the avx512* and amx* flags, so that `precision=auto` picks fp32 as it does there
# (src/sysinfo.py reads the flags). Everything else is still this CPU's (clock, caches, cores), so its figures
# show what the missing instructions cost, not how fast such a machine is (docs/results.md).
#   sudo benchmarks/without_avx512.sh <command> [args...]
# Needs root and util-linux's unshare where the flags are there to hide: the cpuinfo copy is mounted in a mount
# namespace of the command's own.
set -euo pipefail
if (($# == 0)); then echo "error: usage: benchmarks/without_avx512.sh <command> [args...]" >&2; exit 2; fi
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
hidden='avx512[a-z0-9_]*|amx[a-z0-9_]*'  # the flags of /proc/cpuinfo that the command does not see
# A CPU without them, or a command already run by this script: nothing to hide.
if ! grep -qE " ($hidden)( |\$)" /proc/cpuinfo; then exec "$@"; fi
if ((EUID != 0)) || ! command -v unshare >/dev/null; then
    echo "error: benchmarks/without_avx512.sh needs root and unshare (util-linux), to mount its own /proc/cpuinfo" >&2
    exit 2
fi
cpuinfo=$(mktemp)
sed -E "s/ ($hidden)//g" /proc/cpuinfo >"$cpuinfo"
# The copy is removed once mounted; the mount keeps it for the command.
exec unshare --mount --propagation private -- bash -c 'mount --bind "$1" /proc/cpuinfo && rm -f "$1" && shift && exec "$@"' \
    bash "$cpuinfo" "$@"
