#!/usr/bin/env bash
# First the preflight (python -m bench.preflight config/kaggle_t4x2.py: train.py's own checks, versions, GPUs and peer
# access, /dev/shm, the NCCL collective; its report beside gpu_check's, preflight_report.json). Then:
# On a machine with one CUDA GPU (a Kaggle T4 is enough): fp16 + GradScaler, bf16 (refused on GPUs before Ampere),
# torch.compile off and on at GPT-2 (124M) shapes: training MFU, greedy and MBR-16 decoding speed with a real EOS,
# graph breaks, compilations and host syncs against their targets, 16-bit losses against float32's, the Kaggle
# preset's compiled decoding of real dialogues, and the Kaggle presets' peak training memory against
# python -m bench --section=memory; one JSON report (gpu_check_report.json here, or --report=PATH) to attach to an
# issue. Then python -m bench's side-by-side figures (ours vs transformers) at the same shapes. About 10 minutes on a T4,
# mostly compiling, and a few more for the presets' memory (--presets= leaves it out).
#     bash bench/gpu_check.sh [--iters=30 --report=PATH ...]      extra flags go to bench/gpu_check.py
# Exits non-zero if a check fails (the report says which) or python -m bench fails.
set -uo pipefail
report="$PWD/gpu_check_report.json"
for arg in "$@"; do
    case "$arg" in --report=*) report="$(realpath -m -- "${arg#--report=}")" ;; esac
done
cd "$(dirname "$0")/.." || exit 1
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || true
status=0
python -m bench.preflight config/kaggle_t4x2.py --report="$(dirname "$report")/preflight_report.json" || status=$?
python -m bench.gpu_check --model=gpt2 --device=cuda "$@" --report="$report" || status=$?
python -m bench --model=gpt2 --device=cuda || status=$?
echo "gpu_check report: $report (attach it to an issue)"
exit "$status"
