#!/usr/bin/env bash
# Build the test control plane (etcd, kube-apiserver, kube-controller-manager,
# kubectl) and the chart tools (helm, promtool) from the Go module proxy, once,
# into a cache directory keyed by version. No Docker, no download sites.
#
#   hack/build-testbin.sh            # build what is missing, print the bin dir
#   GRPO_TESTBIN=/some/dir hack/...  # use another cache root
#   hack/build-testbin.sh etcd k8s   # only these (targets: etcd k8s helm promtool prometheus coredns pause actionlint
#                                    #   containerd registry s3 kueue)
#
# k8s is kube-apiserver, kube-controller-manager, kubectl (the integration tests' control plane) and
# kube-scheduler, kubelet, kube-proxy (the real node of hack/cluster.sh), in one go build.
#
# Cold build times measured on 2 shared (busy) cores, empty module and build caches: etcd 1m50s,
# kube-apiserver + kube-controller-manager + kubectl 12m15s, helm 11m, promtool 10m; a warm cache
# returns at once. Concurrent callers wait for each other per tool (flock) instead of building twice.
#
# Each tool is built in its own throw-away wrapper module so that Go's minimal
# version selection never bumps one tool's dependencies for another's sake.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.36.3}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
HELM_VERSION=${HELM_VERSION:-3.22.0}
PROM_VERSION=${PROM_VERSION:-0.316.0}     # Prometheus 3.16.0
COREDNS_VERSION=${COREDNS_VERSION:-1.15.0}
# containerd 2.1+ mounts OCI images as volumes (Kubernetes image volumes); Debian's 1.6 cannot.
CONTAINERD_VERSION=${CONTAINERD_VERSION:-2.4.2}
# The linter of the release workflow (.github/workflows/release.yml).
ACTIONLINT_VERSION=${ACTIONLINT_VERSION:-1.7.12}
# The real node's image and chart registry (the CNCF distribution registry; hack/cluster.sh).
REGISTRY_VERSION=${REGISTRY_VERSION:-3.1.2}
# The S3 service of the export tests (spec.output s3://): the Versity S3 gateway on its posix backend, which
# checks SigV4 signatures against its root credentials (44 MB). Cold build (empty module and build caches) on 2
# shared busy cores: 5m34s; 78 s when the Go build cache already holds the other tools' packages.
VERSITYGW_VERSION=${VERSITYGW_VERSION:-1.8.0}
# Kueue's manager, which admits the Kueue tests' runs (tests/fixtures/kueue.py), and its CRDs from the same module
# source (config/components/crd) in kueue-crds/ (87 MB and 1.7 MB). Cold build (empty module and build caches, 2
# idle cores): 3m24s, 550 MB of modules and 1.9 GB of build cache; cached: returns at once.
KUEUE_VERSION=${KUEUE_VERSION:-0.17.0}
# The control plane for the integration tests and the node agents for the real-node tests share most
# packages: one go build of all six pays for them once.
K8S_BINARIES="kube-apiserver kube-controller-manager kubectl kube-scheduler kubelet kube-proxy"
ROOT=${GRPO_TESTBIN:-$HOME/.cache/grpo-testbin}
BIN="$ROOT/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION-prom-$PROM_VERSION-coredns-$COREDNS_VERSION"
mkdir -p "$BIN"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
export GOCACHE=${GOCACHE:-$HOME/.cache/go-build}

log() { echo "[build-testbin] $*" >&2; }

wrapper() {  # wrapper NAME -> prints a fresh module dir
  local d; d=$(mktemp -d "${TMPDIR:-/tmp}/grpo-$1-XXXX")
  (cd "$d" && go mod init "local.invalid/$1" >/dev/null 2>&1 && go mod edit -go=1.26.0)
  echo "$d"
}

build_k8s() {
  local b missing=""
  for b in $K8S_BINARIES; do [ -x "$BIN/$b" ] || missing="$missing $b"; done
  [ -z "$missing" ] && return
  log "building$missing v$K8S_VERSION in one go build (cold: 20-35 min)"
  local minor stg d gomod m
  minor=$(echo "$K8S_VERSION" | cut -d. -f2); stg="0.${K8S_VERSION#1.}"
  d=$(wrapper k8s); cd "$d"
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  # k8s.io/kubernetes requires its staging modules at v0.0.0 with ./staging
  # replaces; route each one to its published v0.X.Y instead.
  for m in $(sed -nE 's#^[[:space:]]*(k8s\.io/[A-Za-z0-9._-]+) => \./staging/.*#\1#p' "$gomod" | sort -u); do
    go mod edit -replace="$m=$m@v$stg"
  done
  go mod edit -require="k8s.io/kubernetes@v$K8S_VERSION"
  cat > tools.go <<GO
//go:build tools
package tools
import (
$(for b in $K8S_BINARIES; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$b"; done)
)
GO
  local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local ldf="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  # shellcheck disable=SC2046
  go build -trimpath -tags selinux,notest -ldflags "$ldf" -o "$BIN/" \
    $(for b in $K8S_BINARIES; do echo "k8s.io/kubernetes/cmd/$b"; done)
  cd /; rm -rf "$d"
}

build_etcd() {
  [ -x "$BIN/etcd" ] && return
  log "building etcd v$ETCD_VERSION"
  local d; d=$(wrapper etcd); cd "$d"
  go mod edit -require="go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  printf '//go:build tools\npackage tools\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  cd /; rm -rf "$d"
}

build_helm() {
  [ -x "$BIN/helm" ] && return
  log "building helm v$HELM_VERSION"
  local minor; minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor \
    -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
    "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
}

build_actionlint() {
  [ -x "$BIN/actionlint" ] && [ "$(cat "$BIN/actionlint.version" 2>/dev/null)" = "$ACTIONLINT_VERSION" ] && return
  log "building actionlint v$ACTIONLINT_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X github.com/rhysd/actionlint.version=v$ACTIONLINT_VERSION" \
    "github.com/rhysd/actionlint/cmd/actionlint@v$ACTIONLINT_VERSION"
  echo "$ACTIONLINT_VERSION" > "$BIN/actionlint.version"
}

build_promtool() {
  [ -x "$BIN/promtool" ] && return
  log "building promtool (prometheus module v$PROM_VERSION)"
  local p=${PROM_VERSION#0.}; local release="${p:0:1}.${p:1}"   # module v0.316.0 is Prometheus 3.16.0
  if ! GOBIN="$BIN" go install -trimpath -tags remove_all_sd \
      -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
      "github.com/prometheus/prometheus/cmd/promtool@v$PROM_VERSION"; then
    log "go install refused promtool; building it from a wrapper module"
    local d; d=$(wrapper promtool); cd "$d"
    go mod edit -require="github.com/prometheus/prometheus@v$PROM_VERSION"
    printf '//go:build tools\npackage tools\nimport _ "github.com/prometheus/prometheus/cmd/promtool"\n' > tools.go
    go build -trimpath -tags remove_all_sd -ldflags "-s -w" -o "$BIN/promtool" github.com/prometheus/prometheus/cmd/promtool
    cd /; rm -rf "$d"
  fi
}

build_prometheus() {
  [ -x "$BIN/prometheus" ] && return
  log "building the prometheus server (module v$PROM_VERSION) with Kubernetes service discovery only"
  local p=${PROM_VERSION#0.}; local release="${p:0:1}.${p:1}"
  local d; d=$(wrapper prometheus); cd "$d"
  go mod edit -require="github.com/prometheus/prometheus@v$PROM_VERSION"
  printf '//go:build tools\npackage tools\nimport _ "github.com/prometheus/prometheus/cmd/prometheus"\n' > tools.go
  go mod tidy >/dev/null 2>&1 || true
  # remove_all_sd drops every service discovery; enable_kubernetes_sd brings back the one the tests use
  go build -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
    -o "$BIN/prometheus" github.com/prometheus/prometheus/cmd/prometheus
  cd /; rm -rf "$d"
}

build_coredns() {
  [ -x "$BIN/coredns" ] && return
  log "building coredns v$COREDNS_VERSION with the cluster-DNS plugins only"
  local d; d=$(wrapper coredns); cd "$d"
  go mod edit -require="github.com/coredns/coredns@v$COREDNS_VERSION"
  # The full plugin set pulls in every cloud SDK; cluster DNS needs these, in plugin.cfg's order.
  local plugins="reload ready health errors log loadbalance cache kubernetes loop forward" p
  {
    echo 'package main'
    echo 'import ('
    echo '	"github.com/coredns/coredns/core/dnsserver"'
    echo '	"github.com/coredns/coredns/coremain"'
    for p in $plugins; do echo "	_ \"github.com/coredns/coredns/plugin/$p\""; done
    echo ')'
    printf 'func init() { dnsserver.Directives = []string{'
    for p in $plugins; do printf '"%s", ' "$p"; done
    echo '} }'
    echo 'func main() { coremain.Run() }'
  } > main.go
  go mod tidy
  go build -trimpath -ldflags "-s -w" -o "$BIN/coredns" .
  cd /; rm -rf "$d"
}

build_pause() {
  [ -x "$BIN/pause" ] && return
  log "building the pod sandbox (pause) binary"
  local d; d=$(wrapper pause)
  cp "$(dirname "$0")/node/pause.go" "$d/main.go"
  (cd "$d" && go build -trimpath -ldflags "-s -w" -o "$BIN/pause" .)
  rm -rf "$d"
}

build_containerd() {  # containerd, its runc shim and ctr; containerd.version says which (a bump rebuilds)
  local b missing=""
  for b in containerd containerd-shim-runc-v2 ctr; do [ -x "$BIN/$b" ] || missing="$missing $b"; done
  [ -z "$missing" ] && [ "$(cat "$BIN/containerd.version" 2>/dev/null)" = "$CONTAINERD_VERSION" ] && return
  log "building containerd, containerd-shim-runc-v2, ctr v$CONTAINERD_VERSION (static, no btrfs/devmapper/zfs)"
  local d; d=$(wrapper containerd); cd "$d"
  go mod edit -require="github.com/containerd/containerd/v2@v$CONTAINERD_VERSION"
  printf '//go:build tools\npackage tools\nimport (\n\t_ "github.com/containerd/containerd/v2/cmd/containerd"\n\t_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"\n\t_ "github.com/containerd/containerd/v2/cmd/ctr"\n)\n' > tools.go
  go mod tidy >/dev/null 2>&1 || true
  go build -trimpath -tags "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION" \
    -o "$BIN/" github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr
  echo "$CONTAINERD_VERSION" > "$BIN/containerd.version"
  cd /; rm -rf "$d"
}

build_registry() {  # the distribution registry with the filesystem storage driver only (no cloud SDKs)
  [ -x "$BIN/registry" ] && [ "$(cat "$BIN/registry.version" 2>/dev/null)" = "$REGISTRY_VERSION" ] && return
  log "building the distribution registry v$REGISTRY_VERSION (filesystem storage only)"
  local d; d=$(wrapper registry); cd "$d"
  go mod edit -require="github.com/distribution/distribution/v3@v$REGISTRY_VERSION"
  # cmd/registry also links the azure, gcs and s3 drivers and the pull-through proxy; the node needs none
  printf 'package main\nimport (\n\t"github.com/distribution/distribution/v3/registry"\n\t_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"\n)\nfunc main() { _ = registry.RootCmd.Execute() }\n' > main.go
  go mod tidy >/dev/null 2>&1 || true
  go build -trimpath -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=v$REGISTRY_VERSION" \
    -o "$BIN/registry" .
  echo "$REGISTRY_VERSION" > "$BIN/registry.version"
  cd /; rm -rf "$d"
}

build_s3() {  # versitygw, the export tests' S3 service; versitygw.version says which (a bump rebuilds)
  [ -x "$BIN/versitygw" ] && [ "$(cat "$BIN/versitygw.version" 2>/dev/null)" = "$VERSITYGW_VERSION" ] && return
  log "building the Versity S3 gateway v$VERSITYGW_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "github.com/versity/versitygw/cmd/versitygw@v$VERSITYGW_VERSION"
  echo "$VERSITYGW_VERSION" > "$BIN/versitygw.version"
}

build_kueue() {  # kueue and kueue-crds/; kueue.version says which (a bump rebuilds)
  [ -x "$BIN/kueue" ] && [ -d "$BIN/kueue-crds" ] && [ "$(cat "$BIN/kueue.version" 2>/dev/null)" = "$KUEUE_VERSION" ] \
    && return
  log "building kueue v$KUEUE_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=v$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
  local d src; d=$(wrapper kueue)
  src=$(cd "$d" && go mod download -json "sigs.k8s.io/kueue@v$KUEUE_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  rm -rf "$BIN/kueue-crds" "$d"
  mkdir -p "$BIN/kueue-crds"
  # The CRDs as Kueue's release installs them: the bases, the conversion-webhook patches and the kustomization that
  # says which patches apply (the test fixture applies them, with kustomize's namePrefix and namespace).
  cp "$src"/config/components/crd/bases/*.yaml "$src"/config/components/crd/patches/webhook_in_*.yaml \
    "$src"/config/components/crd/kustomization.yaml "$BIN/kueue-crds/"
  chmod u+w "$BIN"/kueue-crds/*.yaml
  echo "$KUEUE_VERSION" > "$BIN/kueue.version"
}

targets=${*:-etcd k8s helm promtool prometheus coredns pause containerd actionlint registry s3 kueue}
for t in $targets; do
  # One builder per tool at a time: a second caller (another test session) waits, then finds it built.
  ( flock 9; "build_$t" ) 9>"$BIN/.build-$t.lock"
done
echo "$BIN"
