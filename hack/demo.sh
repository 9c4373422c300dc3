#!/usr/bin/env bash
# The demo (README): on a fresh CPU machine, install what is needed, make the tiny
# model and a toy dataset, and run examples/local-run.yaml to the end with `grpo run`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GRPO_EXTRAS=${GRPO_EXTRAS:-dev,operator,server,trainer,local} bash hack/venv.sh
GRPO=.venv/bin/grpo
mkdir -p demo
[ -f demo/tiny-model/config.json ] || "$GRPO" make-model --preset tiny demo/tiny-model
[ -f demo/prompts.jsonl ] || "$GRPO" make-dataset --model demo/tiny-model demo/prompts.jsonl
exec "$GRPO" run -f examples/local-run.yaml "$@"
