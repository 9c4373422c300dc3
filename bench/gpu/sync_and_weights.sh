#!/usr/bin/env bash
# Issue 28 (adapter sync with BLAKE3 manifests; ours against TRL's async trainer at equal staleness) and issue 29
# (generation on a pushed-weights server), the learning workload unless set: three device calls on a warm machine
# where vLLM is installed in /tmp/site (../shared/device/README.md), outputs as one archive per call, $OUT/<call>.tgz:
#   bash bench/gpu/sync_and_weights.sh call1   # prep; the checksum bench (sha256 vs blake3); TRL colocate + sleep mode; ours synchronous (spec defaults)
#   bash bench/gpu/sync_and_weights.sh call2   # TRL AsyncGRPOTrainer vs vllm serve, max_staleness 1; ours at depth 1
#   bash bench/gpu/sync_and_weights.sh call3   # gen-weights; full fine-tuning (merged sync over ipc) against TRL
#                                              # colocate at LR (default 3e-4), a rate that may learn at 64 tokens
#   bash bench/gpu/sync_and_weights.sh push    # prep; a full push's phases (layerwise vs in-place loads, packed vs separate); the ipc weight tests
#   bash bench/gpu/sync_and_weights.sh full    # full fine-tuning against TRL colocate at LR (default 3e-4)
# In-place loads (GRPO_SERVER_WEIGHT_LOADS=in-place) against their baselines, three calls of one lease:
#   bash bench/gpu/sync_and_weights.sh inplace1  # prep; a full push's phases, layerwise vs in-place (packed);
#                                                # ours full fine-tuning at LR (default 3e-4) with in-place loads
#   bash bench/gpu/sync_and_weights.sh inplace2  # TRL colocate, full fine-tuning; the ipc GPU tests (both loads);
#                                                # ours LoRA, spec defaults (adapter sync's phases in the trainer log)
#   bash bench/gpu/sync_and_weights.sh inplace3  # TRL colocate, LoRA; ours LoRA with sync: merged, in-place loads
# Prefetch depth 1 as a default candidate (LoRA and full fine-tuning), the spec defaults with the sync's fsync beside
# the load, and the compact logprob transport (GRPO_SERVER_LOGPROB_TRANSPORT=compact), three calls of one lease:
#   bash bench/gpu/sync_and_weights.sh depth1   # prep; the adapter snapshot's phases (bench/adapter_snapshot.py);
#                                               # TRL colocate, LoRA; ours at prefetchDepth 1, LoRA
#   bash bench/gpu/sync_and_weights.sh depth2   # ours with the spec defaults, LoRA; TRL colocate and ours at
#                                               # prefetchDepth 1, full fine-tuning at LR (default 3e-4)
#   bash bench/gpu/sync_and_weights.sh compact  # gen-weights with both transports (no LLM.generate baseline: the
#                                               # third lease's 33,454 tokens/s plain on the H100)
# The compact transport's rows held until each request's last step against plain LLM.generate, and prefetch depth 1
# with the budgeted back-off against no prefetch (issue 28 item 3), two calls of one lease:
#   bash bench/gpu/sync_and_weights.sh held1    # prep; gen-weights, compact transport, LLM.generate baseline;
#                                               # ours at prefetchDepth 1, LoRA
#   bash bench/gpu/sync_and_weights.sh held2    # ours with the spec defaults, LoRA; TRL colocate, LoRA
# Where the engine core's time goes with logprobs (issue 29) and depth 1 against no prefetch over 20 steps (issue 28
# item 3), two calls of one lease:
#   bash bench/gpu/sync_and_weights.sh prof1    # prep; gen-weights, compact transport, the same server without
#                                               # logprobs first, py-spy of both runs, LLM.generate baseline; ours
#                                               # with the spec defaults, LoRA
#   bash bench/gpu/sync_and_weights.sh prof2    # ours at prefetchDepth 1, LoRA (the whole call: a first start
#                                               # compiles); TRL colocate, LoRA, if time is left
# Where the server's gap to LLM.generate comes from (issue 29: 0.56x without logprobs after the usage context, the
# engine core's Python busy) and the defaults against colocate and depth 1 with it (issue 28), three calls of one
# lease:
#   bash bench/gpu/sync_and_weights.sh ab1      # prep; LLM.generate with its usual engine arguments and with the
#                                               # server's (py-spy of both)
#   bash bench/gpu/sync_and_weights.sh ab2      # gen-weights (the server with and without logprobs, py-spy) against
#                                               # ab1's first; ours with the spec defaults, LoRA (CAP > 500; a
#                                               # shorter CAP gives gen-weights the whole call)
#   bash bench/gpu/sync_and_weights.sh ab3      # TRL colocate, ours at depth 1 (LoRA)
# Whether the server's gap to LLM.generate is more engine steps for the same tokens or slower steps (issue 29: both
# sides count their steps from vLLM's own metrics), and the defaults against colocate and depth 1 (issue 28), three
# calls of one lease:
#   bash bench/gpu/sync_and_weights.sh steps1   # prep; LLM.generate with the server's engine arguments (stats on:
#                                               # its steps), then gen-weights (the server with and without logprobs)
#   bash bench/gpu/sync_and_weights.sh steps2   # TRL colocate, ours with the spec defaults (LoRA)
#   bash bench/gpu/sync_and_weights.sh steps3   # ours at depth 1 (LoRA)
#   bash bench/gpu/sync_and_weights.sh steps4   # prep (no dataset); the server's engine in-process through AsyncLLM
#                                               # and VllmEngine (plain; logprobs from the sampler and rescored),
#                                               # then LLM.generate with its engine arguments
#   bash bench/gpu/sync_and_weights.sh steps4q  # the same engine's runs alone, for a call of ~220 s: the model only
#                                               # (no dataset, no adapter), gen_async's log straight to the output
#   bash bench/gpu/sync_and_weights.sh steps5   # gen-weights through HTTP with logprobsSource sampler (the spec's
#                                               # default; every gen-weights before the tenth lease ran auto) and auto
#   bash bench/gpu/sync_and_weights.sh steps6   # the dataset; ours with the spec defaults, then with logprobsSource
#                                               # auto (LoRA, the learning workload)
# The importance-sampling ratio formed in the training forward (one policy forward fewer a step; TRL colocate keeps
# its own scoring forward, GRPO_TRAINER_OLD_LOGPS=forward) against the separate forward, LoRA (issue 28) and full
# fine-tuning (issue 29), three calls of one lease:
#   bash bench/gpu/sync_and_weights.sh ol1      # prep; TRL colocate, LoRA; ours with the spec defaults (LoRA)
#   bash bench/gpu/sync_and_weights.sh ol2      # ours with the spec defaults and TRL's scoring forward (the A/B);
#                                               # TRL colocate, full fine-tuning at LR (default 3e-4)
#   bash bench/gpu/sync_and_weights.sh ol3      # ours, full fine-tuning (no prefetch); the same with TRL's scoring
#                                               # forward where 200 s are left
# Where the LoRA step's training time goes against full fine-tuning's (bench/train_step.py: scoring forward,
# training forward and backward, optimizer; LoRA with and without PEFT's float32 input casts) and the whole step
# with and without those casts (GRPO_TRAINER_ADAPTER_INPUT_CASTS=keep), two calls of one lease:
#   bash bench/gpu/sync_and_weights.sh lc1      # prep; train_step.py; TRL colocate, LoRA; ours with the spec defaults
#   bash bench/gpu/sync_and_weights.sh lc2      # ours with PEFT's casts kept; ours with the spec defaults again
# CAP: seconds the call may take (default 560). bench/gpu/curves.py prints each run's steps beside its curves.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site
R=$OUT; export OUT=/tmp/o; mkdir -p $OUT; S=$(date +%s)
CAP=${CAP:-560}
left() { echo $(( $1 - $(date +%s) + S )); }   # seconds until mark $1 of this call
save() { tar czf "$R/$CALL.tgz" -C /tmp/o .; }   # after each run: a call cut off still returns what it measured
CALL=${1:?call1, call2, call3, push, full, inplace1-3, depth1-2, compact, held1-2, prof1-2, ab1-3, steps1-6, steps4q, ol1-3 or lc1-2}
case $CALL in
  call1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    PYTHONPATH=/tmp/site:services:operator:.:bench python3 bench/manifest_digest.py --out $OUT/manifest_digest.json
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=200 bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  call2)
    SERVER=vllm STALENESS=1 TRL_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh trl-async; save
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  call3)
    bash bench/gpu/session.sh gen-weights; save
    TUNING=full SYNC=merged PREFETCH=0 LR=${LR:-3e-4} NAME=full GRPO_TIMEOUT=$(left $CAP) \
      bash bench/gpu/session.sh grpo; save ;;
  push)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    PUSH_TIMEOUT=$(left $(( CAP - 150 ))) bash bench/gpu/session.sh weight-push; save
    TESTS_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh weight-transfer-tests; save ;;
  inplace1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    FORMS=packed PUSH_TIMEOUT=$(left $(( CAP - 200 ))) bash bench/gpu/session.sh weight-push; save
    ONLY=server TUNING=full PREFETCH=0 LR=${LR:-3e-4} NAME=full-inplace SERVER_ENV=GRPO_SERVER_WEIGHT_LOADS=in-place \
      GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  inplace2)
    ONLY=colocate TUNING=full PREFETCH=0 LR=${LR:-3e-4} NAME=full-colocate GRPO_TIMEOUT=$(left $(( CAP / 3 ))) \
      bash bench/gpu/session.sh grpo; save
    TESTS_TIMEOUT=$(left $(( CAP * 2 / 3 ))) bash bench/gpu/session.sh weight-transfer-tests; save
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  inplace3)
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 SYNC=merged NAME=merged-inplace SERVER_ENV=GRPO_SERVER_WEIGHT_LOADS=in-place \
      GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  depth1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    PYTHONPATH=/tmp/site:services:operator:. timeout 120 python3 bench/adapter_snapshot.py --model /tmp/m15 \
      --out $OUT/adapter_snapshot.json > $OUT/adapter_snapshot.log 2>&1; grep -A10 median_ms $OUT/adapter_snapshot.log
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  depth2)
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $(( CAP * 2 / 5 ))) bash bench/gpu/session.sh grpo; save
    ONLY=colocate TUNING=full PREFETCH=0 LR=${LR:-3e-4} NAME=full-colocate GRPO_TIMEOUT=$(left $(( CAP * 13 / 20 ))) \
      bash bench/gpu/session.sh grpo; save
    ONLY=server TUNING=full PREFETCH=1 LR=${LR:-3e-4} NAME=full-d1 GRPO_TIMEOUT=$(left $CAP) \
      bash bench/gpu/session.sh grpo; save ;;
  compact)
    OFFLINE_GEN=0 TRANSPORTS="vllm compact" GEN_TIMEOUT=$(( ($(left $CAP) - 10) / 2 )) \
      bash bench/gpu/session.sh gen-weights; save ;;
  held1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    TRANSPORTS=compact GEN_TIMEOUT=200 bash bench/gpu/session.sh gen-weights; save
    grep -h "logprob transport compact\|logprobs reach the server" $OUT/gen_http_weights_compact_server.log | head -3
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  held2)
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  prof1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    PLAIN_RUN=1 PROFILE=1 TRANSPORTS=compact GEN_TIMEOUT=240 bash bench/gpu/session.sh gen-weights; save
    grep -h "compact\|logprobs reach the server\|schedules up to" $OUT/gen_http_weights_compact_server.log | head -5
    head -40 $OUT/profile_compact/server-summary.txt 2>/dev/null
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  prof2)
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $(( CAP - 20 ))) bash bench/gpu/session.sh grpo; save
    [ "$(left $CAP)" -lt 150 ] || { ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save; } ;;
  ab1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    PROFILE=1 GEN_TIMEOUT=$(( ($(left $CAP) - 10) / 2 )) bash bench/gpu/session.sh gen-engines; save ;;
  ab2)  # the GRPO run only when 250 s are left (a short CAP gives gen-weights the call)
    OFFLINE_GEN=0 PLAIN_RUN=1 PROFILE=1 TRANSPORTS=compact GEN_TIMEOUT=$(left $(( CAP > 500 ? CAP / 2 : CAP - 10 ))) \
      bash bench/gpu/session.sh gen-weights; save
    grep -h "schedules up to" $OUT/gen_http_weights_compact_server.log | head -2
    [ "$(left $CAP)" -lt 250 ] || { ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) \
      bash bench/gpu/session.sh grpo; save; } ;;
  ab3)
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP * 2 / 5 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  steps1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"; tail -3 $OUT/prep.log
    ENGINES=offline_server_engine PROFILE=0 GEN_TIMEOUT=200 bash bench/gpu/session.sh gen-engines; save
    OFFLINE_GEN=0 OFFLINE_JSON=$OUT/gen_offline_server_engine.json PLAIN_RUN=1 TRANSPORTS=compact \
      GEN_TIMEOUT=$(left $(( CAP - 10 ))) bash bench/gpu/session.sh gen-weights; save
    grep -h "schedules up to" $OUT/gen_http_weights_compact_server.log | head -2 ;;
  steps2)
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP * 2 / 5 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  steps3)
    ONLY=server PREFETCH=1 NAME=d1 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  steps4)  # in the call that installs vLLM; LLM.generate after, where 150 s are left
    NO_DATASET=1 bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    GEN_TIMEOUT=$(( CAP > 450 ? 240 : CAP - 130 )) bash bench/gpu/session.sh gen-async; save
    [ "$(left $CAP)" -lt 150 ] || { ENGINES=offline_server_engine PROFILE=0 GEN_TIMEOUT=$(left $(( CAP - 5 ))) \
      bash bench/gpu/session.sh gen-engines; save; } ;;
  steps4q)  # in the call that installs vLLM; a cut-off call still returns each finished run's line
    NO_DATASET=1 NO_ADAPTER=1 bash bench/gpu/session.sh prep > $R/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    OUT=$R GEN_TIMEOUT=$(left $(( CAP - 5 ))) bash bench/gpu/session.sh gen-async; exit 0 ;;
  steps5)
    OFFLINE_GEN=0 OFFLINE_JSON=$OUT/gen_offline_server_engine.json PLAIN_RUN=1 TRANSPORTS=compact SOURCES="sampler auto" \
      GEN_TIMEOUT=$(( ($(left $CAP) - 10) / 2 )) bash bench/gpu/session.sh gen-weights; save ;;
  steps6)
    bash bench/gpu/session.sh prep > $OUT/prep6.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 LOGPROBS=auto NAME=auto GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  ol1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  ol2)
    GRPO_TRAINER_OLD_LOGPS=forward ONLY=server PREFETCH=0 NAME=defaults_forward GRPO_TIMEOUT=$(left $(( CAP / 2 ))) \
      bash bench/gpu/session.sh grpo; save
    ONLY=colocate TUNING=full LR=${LR:-3e-4} NAME=colocate_full GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo
    save ;;
  ol3)
    ONLY=server TUNING=full PREFETCH=0 LR=${LR:-3e-4} NAME=full GRPO_TIMEOUT=$(left $(( CAP / 2 ))) \
      bash bench/gpu/session.sh grpo; save
    [ "$(left $CAP)" -lt 200 ] || { GRPO_TRAINER_OLD_LOGPS=forward ONLY=server TUNING=full PREFETCH=0 LR=${LR:-3e-4} \
      NAME=full_forward GRPO_TIMEOUT=$(left $(( CAP - 5 ))) bash bench/gpu/session.sh grpo; save; } ;;
  lc1)  # in the call that installs vLLM
    bash bench/gpu/session.sh prep > $OUT/prep.log 2>&1; echo "prep $(( $(date +%s)-S ))s"
    PYTHONPATH=/tmp/site:services timeout 150 python3 bench/train_step.py --model /tmp/m15 \
      --out $OUT/train_step.json 2>&1 | grep '^{'; save
    ONLY=colocate NAME=colocate GRPO_TIMEOUT=$(left $(( CAP * 3 / 5 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=defaults GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  lc2)
    GRPO_TRAINER_ADAPTER_INPUT_CASTS=keep ONLY=server PREFETCH=0 NAME=defaults_casts \
      GRPO_TIMEOUT=$(left $(( CAP / 2 ))) bash bench/gpu/session.sh grpo; save
    ONLY=server PREFETCH=0 NAME=defaults2 GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
  full)
    TUNING=full PREFETCH=0 LR=${LR:-3e-4} NAME=full GRPO_TIMEOUT=$(left $CAP) bash bench/gpu/session.sh grpo; save ;;
esac
echo "t $(( $(date +%s)-S ))s"; save
python3 bench/gpu/curves.py /tmp/o/*.json
