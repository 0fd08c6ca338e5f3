#!/usr/bin/env bash
# The fast tier at pinned versions: bash tests/versions/run.sh floors|kaggle [pytest args]
# Makes a venv (VENV=, default a temporary folder; PYTHON=, default python3), installs requirements.txt under
# tests/versions/<name>.txt as constraints, then runs the fast tier. A CUDA torch from PyPI is several GB.
set -euo pipefail
cd "$(dirname "$0")/../.."
name="$1"; shift
venv="${VENV:-$(mktemp -d)/venv}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -c "tests/versions/$name.txt" -r requirements.txt
python -c "import sys, torch, transformers, accelerate, numpy, pandas, peft; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, \
'numpy', numpy.__version__, 'pandas', pandas.__version__, 'peft', peft.__version__)"
python -m pytest -q -m "not slow" "$@"
