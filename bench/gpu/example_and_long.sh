#!/usr/bin/env bash
# Issue 29's GPU example and issue 28's long shape, each one device call on a warm machine where vLLM is
# installed in /tmp/site (../shared/device/README.md):
#   bash bench/gpu/example_and_long.sh callD   # prep; examples/grpo-run.yaml through `grpo run` on the GPU, with
#                                              # only what the device lacks swapped (bench/gpu/example_run.py)
#   bash bench/gpu/example_and_long.sh callE   # the long shape: 8 x 8 completions of 256 tokens at lr 2e-2,
#                                              # TRL colocate + sleep mode, then ours (spec defaults)
# Outputs go to /tmp/o and come back as one archive, $OUT/<call>.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site
R=$OUT; export OUT=/tmp/o; mkdir -p $OUT; S=$(date +%s)
left() { echo $(( $1 - $(date +%s) + S )); }   # seconds until mark $1 of this call
save() { tar czf "$R/$CALL.tgz" -C /tmp/o .; }
CALL=${1:?callD or callE}
case $CALL in
  callD)
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    PYTHONPATH=/tmp/site:$PWD/services:$PWD/operator:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
      TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false \
      python3 bench/gpu/example_run.py --model /tmp/m15 --dataset /tmp/m15-prompts.jsonl --steps 20 \
        --out $OUT/example --timeout $(left 570) > $OUT/example.log 2>&1
    tail -3 $OUT/example.log; save ;;
  callE)
    ONLY=colocate COMPLETION=256 NAME=long-colocate GRPO_TIMEOUT=$(left 270) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 COMPLETION=256 NAME=long-sync GRPO_TIMEOUT=$(left 575) bash bench/gpu/session.sh grpo
    save ;;
esac
echo "t $(( $(date +%s)-S ))s"; save
python3 bench/gpu/curves.py /tmp/o/*.json 2>/dev/null | tail -20
