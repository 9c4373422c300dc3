#!/usr/bin/env bash
# Build the project's images from its own Dockerfiles without Docker or a registry, for the real-node
# tests (hack/cluster.sh) and for anyone who wants them on a machine with buildah:
#
#   hack/images.sh build        # base, pause, operator, server (CPU variant), trainer -> archives
#   hack/images.sh build pause  # only these (and the base)
#   hack/images.sh list         # print "REF ARCHIVE" for each image (what cluster.sh imports)
#   hack/images.sh gpu          # the GPU images (ENGINE=vllm: vLLM in server and trainer), built and
#                               # smoke-tested on this CPU machine (hack/gpu-image-smoke.sh); prints
#                               # "REF SIZE SMOKE-LOG" for each
#   hack/images.sh data REF DIR DEST   # an image holding only DIR at DEST (an oci:// source for the
#                                      # tests: `hack/cluster.sh push ARCHIVE REF` pushes it); prints ARCHIVE
#   hack/images.sh mlflow       # the MLflow tracking server's packages that the trainer image lacks, as a
#                               # data image (tests/e2e mounts it into a trainer-image pod); prints "REF ARCHIVE"
#
# Images are docker-archive tarballs under ~/.cache/grpo-images, each named by a hash of its inputs
# (Dockerfile, build arguments, project files, base image), so a warm machine skips every build and
# a changed input rebuilds only what depends on it. Tagged localhost/grpo-*:<hash>; `hack/cluster.sh
# images` pushes them to the real node's registry, from which the kubelet pulls them.
#
# The base is Debian bookworm made by mmdebstrap (python3 + a venv at /opt/venv first on PATH), a
# stand-in for the Dockerfiles' default python:3.12-slim that needs no registry: the Dockerfiles take
# it as `--build-arg BASE=...`. The server image is built with ENGINE=cpu (transformers engine, no
# vLLM). The pip cache of this machine (~/.cache/pip) is the build's pip cache, so a warm machine
# downloads nothing; server and trainer share their torch layer (identical first steps).
#
# The GPU images (`gpu`) are what a GPU cluster runs; no node here can run them, so they are not
# exported: they stay in buildah's storage (sharing the torch layer with the CPU images), are checked
# by hack/gpu-image-smoke.sh in a container, and the check's log, named by the image's key, is what
# makes a warm machine skip them.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GRPO_IMAGE_CACHE:-$HOME/.cache/grpo-images}
TESTBIN=${GRPO_TESTBIN_DIR:-}
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates,passwd
PIP_CACHE=${PIP_CACHE_DIR:-$HOME/.cache/pip}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
mkdir -p "$CACHE" "$PIP_CACHE"

log() { echo "[images] $*" >&2; }
sha() { sha256sum | cut -c1-16; }

# The inputs of the project images: everything a Dockerfile COPYs (the build context less caches).
project_hash() {
  (cd "$REPO" && find pyproject.toml README.md LICENSE services operator -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum) | sha
}

base_key() { printf '%s %s %s\n' "$SUITE" "$BASE_PACKAGES" "$(sed -n '/^build_base()/,/^}/p' "$0")" | sha; }
pause_key() { sha < "$REPO/hack/node/pause.go"; }
image_key() {  # image_key DOCKERFILE BUILD_ARGS...
  local dockerfile=$1; shift
  { cat "$REPO/$dockerfile"; printf '%s\n' "$@"; base_key; project_hash; } | sha
}

ref_of() {  # ref_of NAME -> localhost/NAME:KEY
  case $1 in
    grpo-base) echo "localhost/grpo-base:$SUITE-$(base_key)" ;;
    pause) echo "localhost/pause:$(pause_key)" ;;
    grpo-operator) echo "localhost/grpo-operator:$(image_key Dockerfile.operator)" ;;
    grpo-server) echo "localhost/grpo-server:cpu-$(image_key Dockerfile.server ENGINE=cpu)" ;;
    grpo-trainer) echo "localhost/grpo-trainer:cpu-$(image_key Dockerfile.trainer ENGINE=cpu)" ;;
    grpo-server-gpu) echo "localhost/grpo-server:vllm-$(image_key Dockerfile.server ENGINE=vllm)" ;;
    grpo-trainer-gpu) echo "localhost/grpo-trainer:vllm-$(image_key Dockerfile.trainer ENGINE=vllm)" ;;
    *) echo "unknown image $1" >&2; return 1 ;;
  esac
}
archive_of() { local ref; ref=$(ref_of "$1"); echo "$CACHE/${1}-${ref##*:}.tar"; }

export_archive() {  # export_archive NAME REF ARCHIVE : buildah storage -> docker-archive in the cache
  rm -f "$3.partial"
  buildah push --quiet "$2" "docker-archive:$3.partial:$2" >/dev/null
  mv "$3.partial" "$3"
}

# Older builds of an image are never used again (their key is gone): they leave the cache and buildah's
# storage before the new one is built, so a machine holds one build of each image, not one per change.
# An image's builds are the tags of its repository in the same variant: vllm-* (the GPU images) or any
# other (CPU), so building one variant never drops the other.
variant() { case $1 in vllm-*) echo vllm ;; *) echo cpu ;; esac; }
prune_stale() {  # prune_stale NAME REF ARCHIVE
  local stale repo=${2%:*} want tag name
  want=$(variant "${2##*:}")
  find "$CACHE" -maxdepth 1 \( -name "$1-*.tar" -o -name "$1-*.tar.partial" \) ! -path "$3" -delete
  stale=""
  for name in $(buildah images --format '{{.Name}}:{{.Tag}}' --filter "reference=$repo" 2>/dev/null); do
    tag=${name##*:}
    if [ "$name" != "$2" ] && [ "$(variant "$tag")" = "$want" ]; then stale="$stale $name"; fi
  done
  if [ -n "$stale" ]; then
    # shellcheck disable=SC2086
    buildah rmi $stale >/dev/null 2>&1 || true
    buildah rmi --prune >/dev/null 2>&1 || true   # their untagged layers, not the ones current images use
  fi
}

# A build that runs out of disk leaves a half-written archive and an unclear buildah error: check first.
# The need is the last archive of this image when there was one, else a fixed estimate.
need_space() {  # need_space NAME BYTES-OF-THE-PREVIOUS-ARCHIVE (0: none)
  local need avail gib=$((1024 * 1024 * 1024))
  # The GPU images are not exported: they add their vLLM layer (~4 GB, shared by both) and their own small
  # layers to buildah's storage, on top of the torch layer the CPU images already hold.
  case $1 in grpo-server|grpo-trainer) need=$((7 * gib)) ;; grpo-*-gpu) need=$((5 * gib)) ;; *) need=$gib ;; esac
  if [ "$2" -gt 0 ]; then need=$(( $2 * 11 / 10 + gib / 2 )); fi
  avail=$(df -B1 --output=avail "$CACHE" | tail -1)
  if [ "$avail" -lt "$need" ]; then
    echo "hack/images.sh: building $1 needs about $((need / gib + 1)) GiB free on the disk of $CACHE;" \
      "$((avail / gib)) GiB is free. Free some (hack/cluster.sh down --purge-all drops the node's image" \
      "store, buildah rmi --all the build cache) and run again." >&2
    exit 1
  fi
}

# Builders make the image REF (set by `ensure`, once, so that files changing during a build cannot
# change the name it is exported under).
build_base() {
  local rootfs c; rootfs=$(mktemp -d)/rootfs.tar
  mmdebstrap --variant=minbase --mode=root --format=tar --include="$BASE_PACKAGES" \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
    "$SUITE" "$rootfs" http://deb.debian.org/debian
  c=$(buildah from scratch)
  buildah add "$c" "$rootfs" / >/dev/null
  buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd '["python3"]' "$c"
  buildah commit --quiet --rm "$c" "$REF" >/dev/null
  rm -rf "$(dirname "$rootfs")"
}

build_pause() {
  local c bin
  bin=${TESTBIN:-$(bash "$REPO/hack/build-testbin.sh" pause)}/pause
  c=$(buildah from scratch)
  buildah copy "$c" "$bin" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  buildah commit --quiet --rm "$c" "$REF" >/dev/null
}

share_pip_cache() {
  # The Dockerfiles' `RUN --mount=type=cache,id=pip` is /var/tmp/buildah-cache/pip to buildah: make it
  # this machine's pip cache, so wheels the host already has are not downloaded again.
  local dir=/var/tmp/buildah-cache/pip
  [ "$(readlink "$dir" 2>/dev/null)" = "$PIP_CACHE" ] && return
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  ln -s "$PIP_CACHE" "$dir"
}

build_dockerfile() {  # build_dockerfile DOCKERFILE [BUILD_ARG...]
  local dockerfile=$1 args=() a; shift
  for a in "$@"; do args+=(--build-arg "$a"); done
  share_pip_cache
  # --pull=never: BASE is the local base image. --network=host and the host's CA bundle: pip inside
  # the build reaches PyPI as this machine does.
  buildah bud --quiet --pull=never --network=host --layers \
    --build-arg "BASE=$(ref_of grpo-base)" "${args[@]}" \
    -v "$CA_BUNDLE:$CA_BUNDLE:ro" --env "PIP_CERT=$CA_BUNDLE" \
    -f "$REPO/$dockerfile" -t "$REF" "$REPO" >/dev/null
}

ensure() {  # ensure NAME BUILDER [ARGS...] : build and export unless the archive for its key exists
  local name=$1 s archive previous; shift
  REF=$(ref_of "$name") archive=$(archive_of "$name")
  previous=$(find "$CACHE" -maxdepth 1 -name "$name-*.tar" -printf '%s\n' | sort -n | tail -1)
  prune_stale "$name" "$REF" "$archive"
  if [ -s "$archive" ]; then return; fi
  s=$(date +%s)
  need_space "$name" "${previous:-0}"
  log "building $REF"
  if ! buildah inspect --type image "$REF" >/dev/null 2>&1; then "$@"; fi
  export_archive "$name" "$REF" "$archive"
  log "$name: $(( $(date +%s) - s ))s, $(du -h "$archive" | cut -f1)"
}

build_all() {  # build_all [NAME...]
  command -v buildah >/dev/null || { echo "buildah is missing (apt-get install buildah mmdebstrap)" >&2; exit 1; }
  local names=${*:-grpo-base pause grpo-operator grpo-trainer grpo-server} n
  ensure grpo-base build_base
  for n in $names; do
    case $n in
      grpo-base) ;;
      pause) ensure pause build_pause ;;
      grpo-operator) base_in_storage; ensure grpo-operator build_dockerfile Dockerfile.operator ;;
      grpo-trainer) base_in_storage; ensure grpo-trainer build_dockerfile Dockerfile.trainer ENGINE=cpu ;;
      grpo-server) base_in_storage; ensure grpo-server build_dockerfile Dockerfile.server ENGINE=cpu ;;
      *) echo "unknown image $n" >&2; exit 2 ;;
    esac
  done
}

base_in_storage() {  # FROM needs the base in buildah's storage even when its archive came from the cache
  buildah inspect --type image "$(ref_of grpo-base)" >/dev/null 2>&1 || \
    buildah pull --quiet "docker-archive:$(archive_of grpo-base)" >/dev/null
}

# The GPU images: built into buildah's storage and smoke-tested, not exported (see the header).
smoked_of() { local ref; ref=$(ref_of "$1"); echo "$CACHE/${1}-${ref##*:}.smoke.log"; }

ensure_smoked() {  # ensure_smoked NAME DOCKERFILE ROLE
  local name=$1 dockerfile=$2 role=$3 s log
  REF=$(ref_of "$name") log=$(smoked_of "$name")
  find "$CACHE" -maxdepth 1 -name "$name-*.smoke.log" ! -path "$log" -delete
  prune_stale "$name" "$REF" "$CACHE/$name-none.tar"
  if [ -s "$log" ] && buildah inspect --type image "$REF" >/dev/null 2>&1; then return; fi
  s=$(date +%s)
  need_space "$name" 0
  log "building $REF"
  if ! buildah inspect --type image "$REF" >/dev/null 2>&1; then
    base_in_storage
    build_dockerfile "$dockerfile" ENGINE=vllm
  fi
  log "$name: built in $(( $(date +%s) - s ))s; smoke test"
  if ! bash "$REPO/hack/gpu-image-smoke.sh" "$REF" "$role" > "$log.partial" 2>&1; then
    cat "$log.partial" >&2
    echo "hack/images.sh: the smoke test of $REF failed (log above)" >&2
    exit 1
  fi
  mv "$log.partial" "$log"
  log "$name: $(( $(date +%s) - s ))s, $(image_size "$REF")"
}

image_size() { buildah images --format '{{.Size}}' "$1" 2>/dev/null | head -1; }

gpu_all() {
  command -v buildah >/dev/null || { echo "buildah is missing (apt-get install buildah mmdebstrap)" >&2; exit 1; }
  ensure grpo-base build_base
  ensure_smoked grpo-server-gpu Dockerfile.server server
  ensure_smoked grpo-trainer-gpu Dockerfile.trainer trainer
}

list_gpu() {
  local n; for n in grpo-server-gpu grpo-trainer-gpu; do
    echo "$(ref_of "$n") $(image_size "$(ref_of "$n")" | tr -d ' ') $(smoked_of "$n")"
  done
}

list_all() {
  local n; for n in pause grpo-base grpo-operator grpo-server grpo-trainer; do echo "$(ref_of "$n") $(archive_of "$n")"; done
}

data_image() {  # data_image REF DIR DEST : files only (no OS), as images mounted as volumes are
  local c archive
  archive="$CACHE/data-$(echo "$1" | tr -c 'A-Za-z0-9.\n-' '_').tar"
  c=$(buildah from scratch)
  buildah copy --chmod 0755 "$c" "$2" "$3" >/dev/null
  buildah commit --quiet --rm "$c" "$1" >/dev/null
  rm -f "$archive"
  buildah push --quiet "$1" "docker-archive:$archive:$1" >/dev/null
  buildah rmi "$1" >/dev/null 2>&1 || true
  echo "$archive"
}

# The tracking server of the end-to-end suite runs in the cluster from the trainer image, which has MLflow's
# client (mlflow-skinny, pyproject.toml's trainer extra) and the `mlflow` command; `mlflow server` needs these
# too (the versions the full mlflow==3.17.2 installs; wheels for the images' CPython 3.11). They are one data image
# of 6 MB, mounted as an image volume and put on PYTHONPATH: no image of its own (the full mlflow brings pandas,
# scipy and scikit-learn, ~850 MB), nothing added to the trainer image, built once and cached by this list.
MLFLOW_SERVER_PACKAGES="flask==3.1.3 flask-cors==6.0.5 werkzeug==3.1.9 itsdangerous==2.2.0 blinker==1.9.0
  sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 huey==3.5.4 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1"
mlflow_image() {
  local key ref archive site
  key=$( { echo "$MLFLOW_SERVER_PACKAGES"; sed -n '/^data_image()/,/^}/p' "$0"; } | sha)
  ref=localhost/grpo-mlflow-server-packages:$key
  archive="$CACHE/data-$(echo "$ref" | tr -c 'A-Za-z0-9.\n-' '_').tar"
  if [ ! -f "$archive" ]; then
    find "$CACHE" -maxdepth 1 -name 'data-localhost_grpo-mlflow-server-packages_*.tar' -delete
    site=$(mktemp -d)
    # shellcheck disable=SC2086
    "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check --cache-dir "$PIP_CACHE" --no-deps \
      --only-binary=:all: --implementation cp --python-version 3.11 --platform manylinux2014_x86_64 \
      --target "$site/site-packages" $MLFLOW_SERVER_PACKAGES >&2
    archive=$(data_image "$ref" "$site/site-packages" /site-packages)
    rm -rf "$site"
  fi
  echo "$ref $archive"
}

case ${1:-build} in
  build) shift || true; ( flock 9; build_all "$@" ) 9>"$CACHE/.lock"; list_all ;;
  list) list_all ;;
  gpu) ( flock 9; gpu_all ) 9>"$CACHE/.lock"; list_gpu ;;
  data) [ $# -eq 4 ] || { echo "usage: $0 data REF DIR DEST" >&2; exit 2; }; data_image "$2" "$3" "$4" ;;
  mlflow) ( flock 9; mlflow_image ) 9>"$CACHE/.lock" ;;
  *) echo "usage: $0 build|list|gpu|data|mlflow" >&2; exit 2 ;;
esac
