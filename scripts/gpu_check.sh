#!/usr/bin/env bash
# On a machine with one CUDA GPU (a Kaggle T4 is enough): fp16 + GradScaler, bf16 (refused on GPUs before Ampere),
# torch.compile off and on, training MFU and generation speed at GPT-2 (124M) shapes, in one table; then bench.py's
# side-by-side figures (ours vs transformers) at the same shapes. About 10 minutes on a T4, mostly compiling.
#     bash scripts/gpu_check.sh [--iters=30 --micro_batch_size=8 ...]      extra flags go to scripts/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || true
python scripts/gpu_check.py --model=gpt2 --device=cuda "$@"
python bench.py --model=gpt2 --device=cuda
