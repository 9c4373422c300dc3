#!/usr/bin/env bash
# Issue 28's GPU batches (learning workload: 8 prompts x 8 completions of 64 tokens, lr 2e-2 unless LR is set),
# each one device call on a warm machine where vLLM is installed in /tmp/site (../shared/device/README.md):
#   bash bench/gpu/async_learning.sh callA   # prep; TRL colocate + sleep mode; ours synchronous (spec defaults)
#   bash bench/gpu/async_learning.sh callB   # TRL AsyncGRPOTrainer vs vllm serve; ours at prefetchDepth 1 and 2
#                                            # with the drift guard
#   bash bench/gpu/async_learning.sh callC   # TRL async vs grpo serve; ours at depth 2 with the guard at a
#                                            # quarter of the rate (5e-3)
# Outputs go to /tmp/o and come back as one archive, $OUT/<call>.tgz (a call returns at most 8 files);
# bench/gpu/curves.py prints each run's step times beside its reward, entropy and drift curves.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site
R=$OUT; export OUT=/tmp/o; mkdir -p $OUT; S=$(date +%s)
left() { echo $(( $1 - $(date +%s) + S )); }   # seconds until mark $1 of this call
save() { tar czf "$R/$CALL.tgz" -C /tmp/o .; }   # after each run: a call cut off still returns what it measured
CALL=${1:?callA, callB or callC}
case $CALL in
  callA)  # in the call that installs vLLM first: keep it under ~450 s
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=200 bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=sync GRPO_TIMEOUT=$(left 450) bash bench/gpu/session.sh grpo; save ;;
  callB)
    SERVER=vllm STALENESS=1 TRL_TIMEOUT=260 bash bench/gpu/session.sh trl-async; save
    ONLY=server PREFETCH=1 NAME=d1-guard GRPO_TIMEOUT=$(left 420) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=2 NAME=d2-guard GRPO_TIMEOUT=$(left 580) bash bench/gpu/session.sh grpo; save ;;
  callC)  # CAP: seconds this call may take (what is left of the lease)
    SERVER=grpo STALENESS=1 TRL_TIMEOUT=$(left $(( ${CAP:-580} / 2 ))) bash bench/gpu/session.sh trl-async; save
    ONLY=server PREFETCH=2 LR=5e-3 NAME=d2-guard-lr5e-3 GRPO_TIMEOUT=$(left ${CAP:-580}) \
      bash bench/gpu/session.sh grpo; save ;;
esac
echo "t $(( $(date +%s)-S ))s"; save
python3 bench/gpu/curves.py /tmp/o/*.json
