#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): its sections one by one, each within its time, the report written after each.
#     bash bench/gpu_check.sh --quick [--samsum_csv=PATH] [--report=PATH]   within 8 minutes on an H100/H200
#     bash bench/gpu_check.sh [--iters=30 --presets= ...]                  every section; extra flags go to gpu_check.py
# The report is out-gpu-check/gpu_check_report.json in the repository (git-ignored), or --report=PATH, the
# preflight's preflight_report.json beside it: attach them to an issue. Exits non-zero if a section fails or runs out
# of its time, and at once, in one line, where no CUDA GPU is visible.
set -uo pipefail
args=()
for arg in "$@"; do  # paths as the caller meant them, before the cd
    case "$arg" in --report=* | --samsum_csv=*) args+=("${arg%%=*}=$(realpath -m -- "${arg#*=}")") ;; *) args+=("$arg") ;; esac
done
cd "$(dirname "$0")/.." || exit 1
# Without a GPU, one line at once: torch alone is imported here (the check's own imports take seconds more).
python -c 'import sys, torch; sys.exit(3 * (not torch.cuda.is_available()))'
if [ $? -eq 3 ]; then
    echo "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False): run it on a GPU machine" >&2
    exit 2
fi
exec python -m bench.gpu_check "${args[@]}"
