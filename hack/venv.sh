#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with every extra
# needed to run the demo and the tests on a CPU machine. Prints nothing but errors when up to date.
#
# The packages are installed by uv (a pinned version, itself installed once from PyPI by the new environment's
# pip into ~/.cache/grpo-tools/uv-VERSION): it resolves the same versions as pip from the same index and installs
# them by linking files from its cache (~/.cache/uv). This machine's network strips the index's caching
# headers, so neither pip's HTTP cache nor uv's revalidated one ever hits (each online install downloads
# every wheel again, 5 GB): uv first resolves from its cache alone (--offline: the index pages and wheels
# it holds), and only when that cannot satisfy pyproject.toml (a new pin, a cold machine) from the index,
# after which `uv cache prune` drops the copies the new download replaced. Unpinned dependencies therefore
# stay at the versions of the machine's last online resolution until pyproject.toml needs a new one.
# pip, setuptools and wheel are installed too, as `pip install --upgrade` did: tests run `python -m pip`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
EXTRAS=${GRPO_EXTRAS:-dev,operator,server,trainer,local}
UV_VERSION=0.13.9
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${EXTRAS//,/-}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  uv_dir=${XDG_CACHE_HOME:-$HOME/.cache}/grpo-tools/uv-$UV_VERSION
  if [ ! -x "$uv_dir/bin/uv" ]; then
    rm -rf "$uv_dir.partial"
    .venv/bin/python -m pip install -q --disable-pip-version-check --target "$uv_dir.partial" "uv==$UV_VERSION"
    rm -rf "$uv_dir"
    mv "$uv_dir.partial" "$uv_dir"
  fi
  # --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (as in this machine's environment), a module
  # without its .pyc is compiled again by every process that imports it (torch, transformers, trl...).
  uv_install() {
    "$uv_dir/bin/uv" pip install -q --python .venv/bin/python --compile-bytecode "$@" \
      --upgrade pip setuptools wheel -e ".[${EXTRAS}]"
  }
  if ! uv_install --offline 2>/dev/null; then
    uv_install
    "$uv_dir/bin/uv" cache prune -q
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
