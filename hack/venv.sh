#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with every extra
# needed to run the demo and the tests on a CPU machine. pip's download cache
# (~/.cache/pip) makes a warm machine fast. Prints nothing but errors when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
EXTRAS=${GRPO_EXTRAS:-dev,operator,server,trainer,local}
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${EXTRAS//,/-}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
