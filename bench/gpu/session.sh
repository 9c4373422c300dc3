#!/usr/bin/env bash
# GPU session on the device machine (see ../shared/device/README.md for carrying vLLM there).
# Each phase writes its logs and JSON under $OUT; run phases in separate device calls:
#   bash bench/gpu/session.sh prep                   # 1.5B model, dataset, adapter (needs no vLLM)
#   bash bench/gpu/session.sh server-tests           # the server's HTTP suites on the vllm engine
#   bash bench/gpu/session.sh hardening-tests        # TESTS=...: server-hardening suites on the vllm engine
#   bash bench/gpu/session.sh grpo                   # trainer vs the vLLM server, and TRL colocate
#   bash bench/gpu/session.sh gen-offline            # LLM.generate variants + HF generate (+ py-spy)
#   bash bench/gpu/session.sh gen-server             # engine direct, server HTTP, adapter sync, reload
#   bash bench/gpu/session.sh lora-decode            # LoRA decode cost at step batch sizes, per vLLM setting
#   bash bench/gpu/session.sh trainer-gpu-tests      # the trainer's CUDA-only tests (needs TRL, no vLLM)
#   bash bench/gpu/session.sh weight-transfer-tests  # vLLM weight transfer (ipc) on the vllm engine, pytest
#   bash bench/gpu/session.sh weight-push            # a full push's phases: the server's loads layerwise vs in place;
#                                                    # packed snapshot vs a tensor per allocation (LOADS, FORMS, REPS)
#   bash bench/gpu/session.sh trl-async              # TRL 1.16 AsyncGRPOTrainer (LoRA sync) vs vllm serve or grpo serve
#   bash bench/gpu/session.sh gen-weights            # a pushed-weights server (no LoRA) + logprobs vs LLM.generate plain
#                                                    # (TRANSPORTS="vllm compact": both logprob transports; PLAIN_RUN=1:
#                                                    # the server without logprobs too; PROFILE=1: py-spy of both runs)
#   bash bench/gpu/session.sh gen-engines            # LLM.generate plain and logprobs=0, its usual engine arguments vs
#                                                    # the pushed-weights server's (gen_offline.py --server-engine), py-spy
#   bash bench/gpu/session.sh gen-async              # the pushed-weights server's engine in-process: vLLM's AsyncLLM
#                                                    # against VllmEngine (plain; logprobs, both sources), steps, CPU
#   bash bench/gpu/session.sh lora-load              # where add_lora's time goes: vLLM's host loads vs the server's GPU-resident ones
#   bash bench/gpu/session.sh gpu-share              # two processes on one GPU: decode-shaped loop beside training (MPS=1: also under MPS)
# prep needs blake3 (adapter manifests' digests) when the device lacks it: carry its wheel in p1,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_17_x86_64 -d .device-stage/p1 blake3==1.0.11
# trl-async with SERVER=vllm needs watchfiles (vllm serve imports it; the bundle lacks it): carry its wheel in p1,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_17_x86_64 -d .device-stage/p1 watchfiles
# py-spy profiles are taken when a py-spy wheel was carried to /tmp/stage (installed to /tmp/pyspy):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 -d .device-stage/p1 py-spy
# NO_DATASET=1 (prep: no dataset, for a call that runs no GRPO).
# PRESET (prep: the model preset, default qwen2.5-1.5b-learn, whose reward can rise; rounds 1-4 and the first
# 2026-12-02 runs used qwen2.5-1.5b). Knobs: TESTS_K (pytest -k for server-tests), TESTS_TIMEOUT, SKIP_DIRECT / SKIP_RELOAD (gen-server),
# ONLY=server|colocate and LOGPROBS=sampler|auto (grpo: our run's spec.server.logprobsSource),
# COMPLETION / BATCH / ACCUM / STEPS (grpo and trl-async: the workload, default grpo_step.py's learning workload:
# 64 completions of 64 tokens a step, 20 steps, lr 2e-2; e.g. COMPLETION=1024 BATCH=8 ACCUM=4 STEPS=6), NAME (grpo:
# output names), IS=mask|truncate|off and MAX_DRIFT (grpo: our spec.trainer.importanceSampling, its maxDrift),
# PREFETCH (grpo: our run's prefetchDepth, default 1; 0 = the spec defaults), LR (grpo and trl-async: learning rate), TUNING=lora|full (grpo: trainer.tuning), SYNC=adapter|merged (grpo: our trainer.sync), REPLICAS (grpo: our server's replicas, sharing its GPU share), ENGINE_ARGS (grpo: JSON for our server's
# extraEngineArgs), SERVER_ENV (grpo: NAME=VALUE for our server's env), SETTINGS (lora-decode: default,specialize
# unless set; SETTINGS=dual-stream in a call of its own).
# trl-async (bench/trl_async.py, grpo_step.py's workload): SERVER=vllm|grpo (default vllm), STEPS (default 20),
# STALENESS (AsyncGRPOConfig.max_staleness, default 2); writes $OUT/trl_async_$SERVER.json and its _server.log,
# _trainer.log and _steps.jsonl beside it, e.g. SERVER=grpo STEPS=20 STALENESS=2 bash bench/gpu/session.sh trl-async
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT/services:$ROOT/operator:$ROOT
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PATH=/tmp/pyspy/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/m15; D=/tmp/m15-prompts.jsonl; A=/tmp/bench-adapter-r32
PY=python3
log() { echo "[$(date +%T)] $*"; }
# An engine left by an interrupted phase would hold most of the GPU: end every GPU process first.
# gen_server.py's work directory of the run that just ended (earlier runs leave theirs: a glob copies none of them)
newest_bench_dir() { ls -dt /tmp/grpo-bench-* 2>/dev/null | head -1; }
free_gpu() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; sleep 2; }

prep() {
  log "prep: 1.5B-shaped model (${PRESET:-qwen2.5-1.5b-learn}), dataset, r=32 adapter"
  [ -f $M/config.json ] || $PY -m grpo_cli.main make-model --preset ${PRESET:-qwen2.5-1.5b-learn} $M
  [ -f $D ] || [ -n "${NO_DATASET:-}" ] || $PY -m grpo_cli.main make-dataset --model $M --prompts 256 $D
  [ -f $A/adapter_config.json ] || [ -n "${NO_ADAPTER:-}" ] || $PY -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path; from gen_offline import make_adapter
make_adapter(Path('$M'), Path('$A'))"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
  # vllm serve (the trl-async baseline) imports watchfiles, which the bundle lacks: carry its wheel in p1
  ls /tmp/stage/watchfiles-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/watchfiles ] &&
    $PY -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/watchfiles-*.whl
  # adapter manifests hash with blake3 (a vLLM dependency the device may already have): carry its wheel in p1
  ls /tmp/stage/blake3-*.whl >/dev/null 2>&1 && ! $PY -c "import blake3" 2>/dev/null &&
    $PY -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/blake3-*.whl
  $PY -c "import blake3; print('blake3', blake3.__version__)"
  ls /tmp/stage/py_spy-*.whl >/dev/null 2>&1 && [ ! -x /tmp/pyspy/bin/py-spy ] &&
    $PY -m pip install -q --no-index --no-deps --target /tmp/pyspy /tmp/stage/py_spy-*.whl
  command -v py-spy || echo "no py-spy: benchmarks run without profiles"
  # the project runs from PYTHONPATH here, not installed: its vLLM plugin (the engine core's side of
  # GRPO_SERVER_LOGPROB_TRANSPORT=compact) needs an entry point that importlib.metadata finds on the path
  local info=/tmp/site/grpo_operator_device-0.0.0.dist-info
  mkdir -p $info
  printf 'Metadata-Version: 2.1\nName: grpo-operator-device\nVersion: 0.0.0\n' > $info/METADATA
  printf '[vllm.general_plugins]\ngrpo_compact_logprobs = grpo_server.engines.vllm_compact_logprobs:engine_plugin\n' \
    > $info/entry_points.txt
}

server_tests() {
  log "server tests on the vllm engine"
  GRPO_TEST_SERVER_ENGINE=vllm GRPO_TEST_SERVER_MODEL_DIR=$M \
  GRPO_TEST_SERVER_OVERRIDES='{"gpuMemoryUtilization": 0.5, "maxModelLen": 2048, "maxLoraRank": 64, "dtype": "bfloat16", "enablePrefixCaching": false, "enforceEager": true}' \
    timeout ${TESTS_TIMEOUT:-480} $PY -m pytest tests/server/test_endpoints.py tests/server/test_adapters.py \
      tests/server/test_swap_under_load.py -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
      -o addopts="" --timeout 300 -rfE --junitxml="$OUT/server_tests.xml" > "$OUT/server_tests.log" 2>&1
  tail -5 "$OUT/server_tests.log"
}

hardening_tests() {
  # TESTS: pytest node ids or files (default: the vLLM side of the server-hardening tests)
  log "server hardening tests on the vllm engine"
  GRPO_TEST_SERVER_ENGINE=vllm GRPO_TEST_SERVER_MODEL_DIR=$M \
  GRPO_TEST_SERVER_OVERRIDES='{"gpuMemoryUtilization": 0.5, "maxModelLen": 2048, "maxLoraRank": 64, "dtype": "bfloat16", "enablePrefixCaching": false, "enforceEager": true}' \
    timeout ${TESTS_TIMEOUT:-540} $PY -m pytest ${TESTS:-tests/server/test_openai_fields.py} -q -p no:cacheprovider \
      ${TESTS_K:+-k "$TESTS_K"} -o addopts="" --timeout 300 -rfEs --junitxml="$OUT/hardening_tests.xml" \
      > "$OUT/hardening_tests.log" 2>&1
  tail -15 "$OUT/hardening_tests.log"
}

grpo() {
  # COMPLETION / BATCH / STEPS shape the workload (default: grpo_step.py's learning workload, 64 completions of
  # 64 tokens, 20 steps, lr 2e-2); NAME names the outputs ($OUT/$NAME.json, $OUT/$NAME-*.log) so runs can share $OUT
  local name=${NAME:-grpo_step${REPLICAS:+_r$REPLICAS}}
  local work=/tmp/grpo-step-$name
  log "GRPO $name: ours (server mode) vs TRL colocate, completions of ${COMPLETION:-64} tokens"
  timeout ${GRPO_TIMEOUT:-560} $PY bench/grpo_step.py --model $M --dataset $D ${STEPS:+--steps $STEPS} \
    --out "$OUT/$name.json" --deadline-s $(( ${GRPO_TIMEOUT:-560} - 30 )) ${REPLICAS:+--replicas $REPLICAS} \
    ${ONLY:+--only $ONLY} --logprobs-source "${LOGPROBS:-sampler}" ${COMPLETION:+--completion-length $COMPLETION} \
    ${BATCH:+--batch $BATCH} --grad-accum ${ACCUM:-1} --prefetch-depth ${PREFETCH:-1} --work $work ${LR:+--learning-rate $LR} ${TUNING:+--tuning $TUNING} ${SYNC:+--sync $SYNC} \
    ${IS:+--importance-sampling $IS} ${MAX_DRIFT:+--max-drift $MAX_DRIFT} ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} ${SERVER_ENV:+--server-env "$SERVER_ENV"}
  for f in $work/*.log; do tail -40 "$f" > "$OUT/$name-$(basename "$f")"; done
  cp $work/bench-server/logs/server-attempt-1.log "$OUT/$name-server-vllm.log" 2>/dev/null
  cp $work/bench-server/logs/trainer-attempt-1.log "$OUT/$name-trainer.log" 2>/dev/null
}

gen_offline() {
  log "generation baselines"
  timeout 540 $PY bench/gen_offline.py --model $M --adapter-dir $A --out "$OUT/gen_offline.json" \
    --profile "$OUT/profile" 2>&1 | tail -40 > "$OUT/gen_offline.log"
  tail -12 "$OUT/gen_offline.log"
}

gen_server() {
  log "engine direct, server HTTP, adapter sync"
  [ -n "${SKIP_DIRECT:-}" ] || timeout 180 $PY bench/gen_server.py direct --model $M --adapter $A --out "$OUT/gen_direct.json" 2>&1 | tail -20 > "$OUT/gen_direct.log"
  [ -n "${SKIP_DIRECT:-}" ] || free_gpu
  timeout 380 $PY bench/gen_server.py http --model $M --adapter $A --out "$OUT/gen_http.json" \
    --direct "$OUT/gen_direct.json" --offline "${OFFLINE:-$OUT/gen_offline.json}" --profile "$OUT/profile" ${SKIP_RELOAD:+--skip-reload} \
    2>&1 | tail -30 > "$OUT/gen_http.log"
  cp "$(newest_bench_dir)/server.log" "$OUT/gen_http_server.log" 2>/dev/null
  tail -n 5 "$OUT/gen_direct.log" "$OUT/gen_http.log"
}

trainer_gpu_tests() {
  log "trainer tests that need a GPU"
  timeout 540 $PY -m pytest tests/trainer/test_adapter_io.py tests/trainer/test_fsdp.py -q -p no:cacheprovider \
    -o addopts="" -k gpu -rsfE -s --basetemp=/tmp/trainer-gpu-tests \
    --junitxml="$OUT/trainer_gpu_tests.xml" > "$OUT/trainer_gpu_tests.log" 2>&1
  cp /tmp/trainer-gpu-tests/fsdp-*.log "$OUT/" 2>/dev/null
  tail -5 "$OUT/trainer_gpu_tests.log"
}

lora_decode() {
  log "LoRA decode cost per vLLM setting"
  timeout 580 $PY bench/lora_decode.py --model $M --adapter $A --out "$OUT/lora_decode.json" \
    ${SETTINGS:+--settings $SETTINGS} > "$OUT/lora_decode.log" 2>&1
  grep -v "^INFO\|^(EngineCore" "$OUT/lora_decode.log" | tail -8
}

weight_transfer_tests() {
  # vLLM's weight transfer on the vllm engine: CUDA IPC pushes from another process on the same GPU
  log "weight-transfer tests on the vllm engine (ipc)"
  GRPO_TEST_SERVER_MODEL_DIR=$M GRPO_TEST_SERVER_OVERRIDES='{"enforceEager": true, "maxModelLen": 2048, "dtype": "bfloat16"}' \
    timeout ${TESTS_TIMEOUT:-300} $PY -m pytest tests/server/test_weight_transfer_vllm.py -q -p no:cacheprovider -o addopts="" \
      --timeout 280 -rfEs --junitxml="$OUT/weight_transfer_tests.xml" > "$OUT/weight_transfer_tests.log" 2>&1
  tail -15 "$OUT/weight_transfer_tests.log"
}

weight_push() {
  log "full push of the 1.5B shape over ipc: loads ${LOADS:-layerwise,in-place}, forms ${FORMS:-packed,separate} (bench/weight_push.py)"
  timeout ${PUSH_TIMEOUT:-300} $PY bench/weight_push.py --model $M --out "$OUT/weight_push.json" \
    --weight-loads ${LOADS:-layerwise,in-place} --forms ${FORMS:-packed,separate} --reps ${REPS:-8} \
    > "$OUT/weight_push.log" 2>&1
  local i=0 f
  for f in /tmp/grpo-bench-push-*/server.log; do cp "$f" "$OUT/weight_push_server_$i.log" 2>/dev/null; i=$((i+1)); done
  tail -n 6 "$OUT/weight_push.log"
}

trl_async() {
  local server=${SERVER:-vllm}
  log "TRL AsyncGRPOTrainer against $server serve, max_staleness ${STALENESS:-2}, ${STEPS:-20} steps"
  timeout ${TRL_TIMEOUT:-560} $PY bench/trl_async.py --server "$server" --model $M --dataset $D ${STEPS:+--steps $STEPS} \
    --max-staleness ${STALENESS:-2} --timeout $(( ${TRL_TIMEOUT:-560} - 20 )) --work /tmp/trl-async-$server \
    --out "$OUT/trl_async_$server.json" ${LR:+--learning-rate $LR} ${COMPLETION:+--completion-length $COMPLETION} \
    ${BATCH:+--batch $BATCH}
  tail -4 "$OUT/trl_async_${server}_trainer.log"
}

gen_weights() {
  # item 4 of issue 19: a weight-transfer server (no LoRA) generating with logprobs vs LLM.generate plain, same run
  log "generation on pushed-weights server vs LLM.generate plain"
  local offline=()
  if [ "${OFFLINE_GEN:-1}" = 1 ]; then  # OFFLINE_GEN=0: no LLM.generate baseline (the servers' runs compared alone)
    timeout 300 $PY bench/gen_offline.py --quick --model $M --adapter-dir $A --out "$OUT/gen_offline_quick.json" \
      2>&1 | tail -20 > "$OUT/gen_offline_quick.log"
    tail -n 4 "$OUT/gen_offline_quick.log"
  fi
  # an earlier call's baseline on this machine (gen-engines) is the ratio's too
  # (OFFLINE_JSON: another of its baselines, e.g. $OUT/gen_offline_server_engine.json, which has engine steps)
  local base=${OFFLINE_JSON:-$OUT/gen_offline_quick.json}
  [ ! -f "$base" ] || offline=(--offline "$base")
  # TRANSPORTS: the server's GRPO_SERVER_LOGPROB_TRANSPORT values to run (default: vllm only); SOURCES: its
  # spec.server.logprobsSource values (default sampler, the spec's; auto scores in a prefill pass, where the
  # transport carries no logprobs), each source's file named for it unless sampler
  local t name src
  for src in ${SOURCES:-sampler}; do
  for t in ${TRANSPORTS:-vllm}; do
    name=gen_http_weights; [ "$t" = vllm ] || name=gen_http_weights_$t
    [ "$src" = sampler ] || name=${name}_$src
    free_gpu
    GRPO_SERVER_LOGPROB_TRANSPORT=$t timeout ${GEN_TIMEOUT:-300} $PY bench/gen_server.py http --weights ipc --model $M \
      --adapter $A --logprobs-source $src --out "$OUT/$name.json" ${offline[@]+"${offline[@]}"} ${PLAIN_RUN:+--plain-run} \
      ${PROFILE:+--profile "$OUT/profile_${name#gen_http_weights_}"} 2>&1 | tail -30 > "$OUT/$name.log"
    [ -z "${PROFILE:-}" ] || for f in "$OUT/profile_${name#gen_http_weights_}"/*-stacks.txt; do
      [ -f "$f" ] && $PY bench/profile_summary.py "$f" --top 25 > "${f%-stacks.txt}-summary.txt" 2>&1; done
    cp "$(newest_bench_dir)/server.log" "$OUT/${name}_server.log" 2>/dev/null
    tail -n 4 "$OUT/$name.log"
  done
  done
}

gen_async() {
  # issue 29: the pushed-weights server's engine in-process, through vLLM's AsyncLLM and through VllmEngine (plain,
  # logprobs), against LLM.generate with the server's engine arguments (gen-engines' offline_server_engine)
  # (its log written as it goes: a call cut off returns the lines of the runs that finished)
  log "one engine, several ways in: AsyncLLM, VllmEngine plain and with logprobs"
  free_gpu
  local base=$OUT/gen_offline_server_engine.json
  timeout ${GEN_TIMEOUT:-300} $PY bench/gen_async.py --model $M --out "$OUT/gen_async.json" \
    $([ ! -f "$base" ] || echo --offline "$base") > "$OUT/gen_async.log" 2>&1
  grep -h "^raw\|^ours" "$OUT/gen_async.log"
}

gen_engines() {
  # issue 29: LLM.generate with its usual engine arguments against LLM.generate with the pushed-weights server's
  # (gen_offline.py --server-engine), py-spy of both: is the server's gap to LLM.generate its engine configuration?
  log "LLM.generate: the baseline's engine arguments, then the pushed-weights server's"
  # ENGINES: which of the two (default both); PROFILE=0: no py-spy
  local v flag
  for v in ${ENGINES:-offline_quick offline_server_engine}; do
    flag=; [ $v = offline_quick ] || flag=--server-engine
    free_gpu
    timeout ${GEN_TIMEOUT:-240} $PY bench/gen_offline.py --quick $flag --model $M --adapter-dir $A \
      --out "$OUT/gen_$v.json" $([ "${PROFILE:-1}" = 0 ] || echo --profile "$OUT/profile_$v") 2>&1 |
      grep -v "it/s\]" | tail -40 > "$OUT/gen_$v.log"
    tail -n 3 "$OUT/gen_$v.log"
    for f in "$OUT/profile_$v"/offline-*.txt; do
      [ -f "$f" ] && $PY bench/profile_summary.py "$f" --top 25 > "${f%.txt}-summary.txt" 2>&1; done
  done
}

lora_load() {
  log "add_lora profile: stock, unpinned, gpu-resident (the server's default), stock again"
  timeout ${LORA_TIMEOUT:-400} $PY bench/lora_load_profile.py --model $M --adapter $A --out "$OUT/lora_load.json" \
    > "$OUT/lora_load.log" 2>&1
  grep -E "add_lora p50|Error|error" "$OUT/lora_load.log" | grep -v "^INFO" | head -12
}

gpu_share() {
  log "one GPU, two processes (time slices${MPS:+, and MPS})"
  timeout 300 $PY bench/gpu_share.py --out "$OUT/gpu_share.json" ${MPS:+--mps} > "$OUT/gpu_share.log" 2>&1
  grep -E "slowdown|skipped" "$OUT/gpu_share.log"
}

for phase in "$@"; do
  free_gpu
  case $phase in
    prep) prep ;; weight-transfer-tests) weight_transfer_tests ;; server-tests) server_tests ;; hardening-tests) hardening_tests ;; grpo) grpo ;; gen-offline) gen_offline ;; gen-server) gen_server ;;
    lora-decode) lora_decode ;; trainer-gpu-tests) trainer_gpu_tests ;; weight-push) weight_push ;;
    trl-async) trl_async ;; gpu-share) gpu_share ;; lora-load) lora_load ;; gen-weights) gen_weights ;;
    gen-engines) gen_engines ;; gen-async) gen_async ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
log done
