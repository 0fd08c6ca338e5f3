"""Benchmarks (python -m bench) and the GPU check (bash bench/gpu_check.sh)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMSUM_CSV = os.path.join(ROOT, "..", "shared", "data", "samsum-validation.csv")  # --samsum_csv's default
