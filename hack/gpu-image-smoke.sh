#!/usr/bin/env bash
# The smoke test of a GPU image (ENGINE=vllm) on a machine without a GPU, in a container of the image
# (buildah run, as the image's user, no network). hack/images.sh gpu runs it after each build and keeps
# what it prints as the image's smoke log.
#
#   hack/gpu-image-smoke.sh REF server    # the server image
#   hack/gpu-image-smoke.sh REF trainer   # the trainer image (also the initializer's)
#
# Both: the entrypoint's command and its --help start; vLLM imports with its compiled extension
# (vllm._C_stable_libtorch in 0.26, built for the torch beside it) and is the version pyproject.toml pins. Server: `grpo serve
# --engine vllm` on a tiny model gets as far as asking for a GPU and fails saying so, the vLLM surface its
# GPU-resident adapter loads rely on is there, and the compact logprob transport gives vLLM's own logprobs.
# Trainer: the modules the trainer needs from vLLM (the NCCL weight transfer) and TRL import, and the
# initializer's own check (grpo_trainer.image_capabilities) finds what a run that sends weights over nccl needs.
set -euo pipefail
REF=${1:?usage: $0 REF server|trainer}
ROLE=${2:?usage: $0 REF server|trainer}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM_PIN=$(grep -o '"vllm==[^"]*"' "$REPO/pyproject.toml" | tr -d '"' | cut -d= -f3)

work=$(mktemp -d)
c=""
cleanup() { if [ -n "$c" ]; then buildah rm "$c" >/dev/null 2>&1 || true; fi; rm -rf "$work"; }
trap cleanup EXIT
chmod 755 "$work"
c=$(buildah from --pull=never "$REF")

in_image() { buildah run --user 1000:1000 --network none -v "$work:/smoke:ro" "$c" -- "$@"; }
step() { printf '== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

step "$REF ($ROLE): image size $(buildah images --format '{{.Size}}' "$REF" | head -1)"

case $ROLE in
  server) commands="serve" ;;
  trainer) commands="train prepare" ;;
  *) fail "role must be server or trainer, not '$ROLE'" ;;
esac
for cmd in $commands; do
  step "grpo $cmd --help"
  out=$(in_image grpo "$cmd" --help) || fail "grpo $cmd --help exited $?"
  grep -q "^Usage: grpo $cmd" <<<"$out" || fail "grpo $cmd --help printed no usage: $out"
  head -1 <<<"$out"
done

step "import vllm and its compiled extension (against a stub of the driver's libcuda.so.1)"
# vllm._C_stable_libtorch links the CUDA driver API (libcuda.so.1), which a GPU node's container runtime
# mounts from the driver and no image carries. A stub built here from the symbols it takes from there
# (each returns CUDA_ERROR_NO_DEVICE) lets the loader resolve everything else for real: libtorch,
# libcudart and the kernels registered with torch (torch.ops._C).
out=$(in_image sh -c '
set -e
so=$(python -c "import importlib.util as u; print(u.find_spec(\"vllm._C_stable_libtorch\").origin)")
mkdir -p /tmp/stub
nm -D --undefined-only "$so" | awk "\$2 ~ /^cu[A-Z]/ {print \"int \" \$2 \"(void) { return 100; }\"}" | sort -u > /tmp/stub/stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o /tmp/stub/libcuda.so.1 /tmp/stub/stub.c
echo "driver symbols stubbed: $(wc -l < /tmp/stub/stub.c)"
LD_LIBRARY_PATH=/tmp/stub python -c "
import torch, vllm, vllm._C_stable_libtorch
torch.ops._C.rms_norm, torch.ops._C.silu_and_mul  # kernels the dense models use, registered by the extension
print(vllm.__version__, \"torch\", torch.__version__, \"cuda\", torch.version.cuda)"
' 2>&1) || fail "vLLM's compiled extension does not load: $out"
echo "$out" | tail -2
[ "$(tail -1 <<<"$out" | cut -d' ' -f1)" = "$VLLM_PIN" ] || fail "vLLM $(tail -1 <<<"$out") is not the pinned $VLLM_PIN"

if [ "$ROLE" = trainer ]; then
  step "the trainer's side of weights over nccl, TRL, and the initializer's image check"
  in_image python -c '
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
import trl
from grpo_trainer.image_capabilities import vllm_import_error
error = vllm_import_error()
assert error is None, error
print("NCCLWeightTransferEngine", NCCLWeightTransferEngine.__name__, "trl", trl.__version__, "image check: vLLM usable")
' 2>&1 | tail -1 || fail "the trainer image cannot send weights over nccl"
  exit 0
fi

step "the vLLM surface the server's worker extension relies on (engines/vllm_lora_load.py, vllm_weights.py)"
out=$(in_image python -c '
from grpo_server.engines.vllm_lora_load import surface_problems
from grpo_server.engines.vllm_weights import in_place_surface_problems
problems = surface_problems() + in_place_surface_problems()
assert not problems, problems
print("worker_extension_cls, LoRAModel.from_local_checkpoint(device=), WorkerLoRAManager._lora_model_cls,"
      " rebuild_cuda_tensor, Worker.get_model: present")
' 2>&1) || fail "the server image's vLLM lacks what its worker extension needs: $(tail -3 <<<"$out")"
tail -1 <<<"$out"

step "the compact logprob transport against vLLM's own (engines/vllm_compact_logprobs.py), and its engine plugin"
out=$(in_image python -c '
import importlib.metadata as md
from grpo_server.engines import vllm_compact_logprobs as compact
plugins = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
assert plugins.get("grpo_compact_logprobs") == "grpo_server.engines.vllm_compact_logprobs:engine_plugin", plugins
problem = compact.self_check()
assert problem is None, problem
print("compact logprobs equal vLLM'"'"'s own through its encoder, decoder and output processor; engine plugin",
      plugins["grpo_compact_logprobs"])
' 2>&1) || fail "the compact logprob transport does not match this vLLM or its plugin is missing: $(tail -3 <<<"$out")"
tail -1 <<<"$out"

step "grpo serve --engine vllm on a tiny model: asks for a GPU and says so"
PYTHONPATH="$REPO/services" "$REPO/.venv/bin/python" -m grpo_cli.main make-model --preset tiny "$work/model" >/dev/null
chmod -R a+rX "$work"
cat > "$work/run.yaml" <<'YAML'
apiVersion: grpo.dev/v1alpha1
kind: GRPORun
metadata: {name: smoke}
spec:
  model: {name: tiny, path: /smoke/model}
  dataset: {path: /smoke/prompts.jsonl}
  rewards: [{function: exact_match}]
  server: {engine: vllm}
YAML
set +e
out=$(timeout 300 buildah run --user 1000:1000 --network none -v "$work:/smoke:ro" "$c" -- \
  grpo serve --config /smoke/run.yaml 2>&1)
rc=$?
set -e
[ "$rc" -ne 0 ] || fail "grpo serve --engine vllm started without a GPU: $out"
[ "$rc" -ne 124 ] || fail "grpo serve --engine vllm did not exit within 300 s without a GPU: $(tail -20 <<<"$out")"
grep -q "engine failed to start: EngineUnavailable: spec.server.engine vllm needs a CUDA GPU" <<<"$out" \
  || fail "grpo serve --engine vllm failed (exit $rc) without saying it needs a GPU: $(tail -20 <<<"$out")"
grep "engine failed to start" <<<"$out" | tail -1
echo "exit code $rc"
