#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, for the end-to-end tests (tests/e2e) and for
# trying the operator by hand: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# containerd (CRI), kubelet, kube-proxy (iptables), CoreDNS and an OCI registry (the CNCF distribution
# registry at localhost:5001, plain HTTP, which containerd pulls from), as background processes of root.
#
#   hack/cluster.sh deps          # install the Debian packages the node and hack/images.sh need
#   hack/cluster.sh up            # build/fetch what is missing, start, wait for the node and DNS
#   hack/cluster.sh images        # push the project's images (hack/images.sh build) to the node's registry as
#                                 # localhost:5001/grpo-dev/NAME:KEY (the pod sandbox image is imported)
#   hack/cluster.sh images A.tar  # import these image archives into containerd as they are
#   hack/cluster.sh push A.tar REF  # push an archive (e.g. hack/images.sh data) to the registry as REF
#   hack/cluster.sh volumes       # (re)make the pool of hostPath PersistentVolumes; Released ones are wiped
#   hack/cluster.sh env           # print `export KUBECONFIG=...` and the tool paths
#   hack/cluster.sh down          # stop everything and undo what `up` changed on the machine
#   hack/cluster.sh down --purge  # ... and delete the cluster's state (etcd, certificates, volumes), keeping
#                                 # the image store and the registry's storage; --purge-all deletes those too
#
# Kubernetes, etcd, CoreDNS and containerd 2 binaries come from hack/build-testbin.sh (Go module proxy,
# cached under ~/.cache); runc, the CNI plugins and iptables from Debian (apt-get, once). Everything the
# cluster writes lives under $GRPO_NODE_DIR (/var/lib/grpo-node) and /run/grpo-node; `down` stops
# processes by their recorded pids and removes the mounts, network namespaces, cgroups, iptables chains,
# bridge and sysctl changes they made. Storage: a default StorageClass `standard` backed by a pool of
# hostPath PersistentVolumes (no dynamic provisioner). NetworkPolicies are stored but not enforced
# (the bridge CNI plugin has no policy engine).
#
# Needs root, cgroups, and no other kubelet on the machine. Measured on 2 cores: `up` on a warm
# machine 20-40 s.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
STATE=${GRPO_NODE_DIR:-/var/lib/grpo-node}
RUN=/run/grpo-node
LOG=$STATE/logs PKI=$STATE/pki CONF=$STATE/conf
SOCK=$RUN/containerd.sock
NODE=grpo-node
SVC_CIDR=10.0.0.0/24 POD_SUBNET=10.244.0.0/24 DNS_IP=10.0.0.10 API_PORT=6443 BRIDGE=grpo0
VOLUME_COUNT=${GRPO_NODE_VOLUMES:-32} VOLUME_SIZE=20Gi
REGISTRY_PORT=${GRPO_NODE_REGISTRY_PORT:-5001} REGISTRY_NAMESPACE=grpo-dev
REGISTRY=localhost:$REGISTRY_PORT
APT_PACKAGES="runc containernetworking-plugins iptables conntrack ethtool socat kmod iproute2 curl openssl
              buildah mmdebstrap skopeo uidmap fuse-overlayfs"   # the last line: hack/images.sh

t0=$(date +%s%N)
say() { awk -v a="$t0" -v b="$(date +%s%N)" -v m="$*" 'BEGIN {printf "[cluster %5.1fs] %s\n", (b-a)/1e9, m}' >&2; }
die() { echo "[cluster] $*" >&2; exit 1; }

testbin() {
  GRPO_TESTBIN_DIR=${GRPO_TESTBIN_DIR:-$(bash "$REPO/hack/build-testbin.sh" etcd k8s coredns pause containerd registry)}
  BIN=$GRPO_TESTBIN_DIR
}
node_ip() { ip -4 route get 1.1.1.1 2>/dev/null | sed -nE 's/.* src ([0-9.]+).*/\1/p'; }   # a route lookup, no traffic
kubectl_() { "$BIN/kubectl" --kubeconfig="$STATE/admin.kubeconfig" "$@"; }

# ------------------------------------------------------------------------------------------- processes
start_process() {  # start_process NAME CMD... : its own session (so `down` can signal the group), log, pid
  local name=$1; shift
  setsid "$@" > "$LOG/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pids/$name.pid"
}
running() { [ -f "$RUN/pids/$1.pid" ] && kill -0 "$(cat "$RUN/pids/$1.pid")" 2>/dev/null; }
require_running() { running "$1" || { tail -30 "$LOG/$1.log" >&2; die "$1 exited (log: $LOG/$1.log)"; }; }
wait_healthy() {  # wait_healthy NAME URL [curl args]
  local name=$1 url=$2 i; shift 2
  for i in $(seq 600); do
    require_running "$name"
    [ "$(curl -sk -o /dev/null -w '%{http_code}' "$@" "$url")" = 200 ] && { say "$name healthy"; return; }
    sleep 0.2
  done
  tail -30 "$LOG/$name.log" >&2; die "$name not healthy at $url"
}
stop_process() {  # stop_process NAME : SIGTERM the group, up to 15 s, then SIGKILL
  local f=$RUN/pids/$1.pid pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 75); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    say "$1 stopped"
  fi
  rm -f "$f"
}
ctr_() { "$BIN/ctr" --address "$SOCK" -n k8s.io "$@"; }   # containerd's own client, built with it
containerd_up() { [ -S "$SOCK" ] && timeout 5 "$BIN/ctr" --address "$SOCK" version >/dev/null 2>&1; }   # ctr waits 10 s on a missing socket

# --------------------------------------------------------------------------------------------- configs
packages() {
  local missing
  # shellcheck disable=SC2086
  missing=$(dpkg-query -W -f='${Status} ${Package}\n' $APT_PACKAGES 2>&1 | grep -v '^install ok installed' || true)
  [ -z "$missing" ] && return
  say "installing Debian packages: $(echo $APT_PACKAGES)"
  # shellcheck disable=SC2086
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $APT_PACKAGES; } >"$LOG/apt.log" 2>&1 \
    || { tail -20 "$LOG/apt.log" >&2; die "apt-get failed"; }
}

# Running components watch their config files (kube-proxy exits when its file changes): a second `up`
# rewrites a file only when its content differs.
write_file() {  # write_file FILE [MODE] < content
  local tmp; tmp=$(mktemp "$1.XXXX")
  cat > "$tmp"
  chmod "${2:-644}" "$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}

write_kubeconfig() {  # write_kubeconfig FILE USER
  local token; token=$(awk -F, -v u="$2" '$2==u {print $1}' "$CONF/tokens.csv")
  write_file "$1" 600 <<YAML
apiVersion: v1
kind: Config
clusters: [{name: grpo-node, cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$PKI/apiserver.crt"}}]
users: [{name: $2, user: {token: "$token"}}]
contexts: [{name: grpo-node, context: {cluster: grpo-node, user: $2, namespace: default}}]
current-context: grpo-node
YAML
}

write_configs() {
  [ -f "$PKI/sa.key" ] || openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  if [ ! -f "$CONF/tokens.csv" ]; then  # one identity per component; Node,RBAC authorization
    local tok; tok() { openssl rand -hex 24; }
    {
      echo "$(tok),admin,admin-uid,system:masters"
      echo "$(tok),system:node:$NODE,kubelet-uid,system:nodes"
      echo "$(tok),system:kube-proxy,kube-proxy-uid"
      echo "$(tok),system:kube-scheduler,scheduler-uid"
      echo "$(tok),system:kube-controller-manager,kcm-uid"
      echo "$(tok),system:coredns,coredns-uid"
    } > "$CONF/tokens.csv"
    chmod 600 "$CONF/tokens.csv"
  fi
  write_kubeconfig "$STATE/admin.kubeconfig" admin
  write_kubeconfig "$CONF/kubelet.kubeconfig" "system:node:$NODE"
  write_kubeconfig "$CONF/proxy.kubeconfig" system:kube-proxy
  write_kubeconfig "$CONF/scheduler.kubeconfig" system:kube-scheduler
  write_kubeconfig "$CONF/kcm.kubeconfig" system:kube-controller-manager
  write_kubeconfig "$CONF/coredns.kubeconfig" system:coredns

  write_file "$CONF/containerd.toml" <<TOML
# containerd 2 (built by hack/build-testbin.sh): 2.1+ mounts OCI images as volumes (image volumes).
version = 3
root = "$STATE/containerd"
state = "$RUN/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$SOCK"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "$CONF/certs.d"   # hosts.toml per registry: the node's own speaks plain HTTP
[plugins."io.containerd.cri.v1.runtime"]
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  # Root here may lack CAP_SYS_RESOURCE: the kubelet's oom_score_adj of -998 for sandboxes would make runc
  # fail ("can't get final child's PID from pipe"). Cap every requested score at containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$CONF/cni"
TOML
  mkdir -p "$CONF/certs.d/$REGISTRY"
  write_file "$CONF/certs.d/$REGISTRY/hosts.toml" <<TOML
server = "http://$REGISTRY"
[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
TOML
  write_file "$CONF/registry.yml" <<YAML
version: 0.1
log: {level: warn, accesslog: {disabled: false}}
storage: {filesystem: {rootdirectory: "$STATE/registry"}}
http: {addr: "127.0.0.1:$REGISTRY_PORT"}
YAML
  mkdir -p "$CONF/cni"
  write_file "$CONF/cni/10-grpo-bridge.conflist" <<JSON
{"cniVersion": "1.0.0", "name": "grpo-node", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$STATE/cni"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
  write_file "$CONF/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$SOCK
cgroupDriver: cgroupfs          # systemd is not PID 1 here
failCgroupV1: false             # kubelet 1.35+ refuses cgroup v1 hosts unless told
failSwapOn: false
address: 0.0.0.0
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
# A test node: the kubelet API trusts whoever reaches it (the API server for logs/exec/port-forward).
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
resolvConf: /etc/resolv.conf
hairpinMode: hairpin-veth
protectKernelDefaults: false
serializeImagePulls: false
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%, nodefs.inodesFree: 2%}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
YAML
  write_file "$CONF/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$CONF/proxy.kubeconfig"}
mode: iptables
clusterCIDR: $POD_SUBNET
hostnameOverride: $NODE
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0}      # leave nf_conntrack_max alone
YAML
  write_file "$CONF/Corefile" <<COREFILE
.:1053 {
    errors
    health 127.0.0.1:8181
    ready 127.0.0.1:8182
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $CONF/coredns.kubeconfig grpo-node
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    forward . $(awk '/^nameserver/ {print $2; exit}' /etc/resolv.conf)
    cache 30
    loop
    loadbalance
}
COREFILE
}

# ------------------------------------------------------------------------------------------------- up
up() {
  [ "$(id -u)" = 0 ] || die "needs root (kubelet, containerd, iptables)"
  mkdir -p "$STATE"/{kubelet,cni,etcd,volumes,registry} "$LOG" "$PKI" "$CONF" "$RUN/pids"
  packages
  testbin
  PAUSE_IMAGE=$(bash "$REPO/hack/images.sh" build pause | awk '$1 ~ /^localhost\/pause:/ {print $1}')
  NODE_IP=$(node_ip); [ -n "$NODE_IP" ] || die "no IPv4 address with a default route"
  write_configs
  # what `down` restores: sysctls (the kubelet changes some too) and the network namespaces present now
  [ -f "$RUN/sysctl.saved" ] || sysctl -e net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables vm.overcommit_memory \
    kernel.panic kernel.panic_on_oops vm.panic_on_oom kernel.keys.root_maxkeys kernel.keys.root_maxbytes \
    > "$RUN/sysctl.saved" 2>/dev/null
  [ -f "$RUN/netns.before" ] || { ls /run/netns 2>/dev/null || true; } > "$RUN/netns.before"
  modprobe br_netfilter 2>/dev/null || true
  sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1

  local admin_token; admin_token=$(awk -F, '$2=="admin" {print $1}' "$CONF/tokens.csv")
  running etcd || start_process etcd "$BIN/etcd" --data-dir="$STATE/etcd" \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=default=http://127.0.0.1:2380 --unsafe-no-fsync=true --log-level=warn
  wait_healthy etcd http://127.0.0.1:2379/health
  # Pods reach the API through the kubernetes Service (10.0.0.1) and the node IP: bind all addresses,
  # advertise the node IP (the serving certificate the apiserver makes names both).
  running kube-apiserver || start_process kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --cert-dir="$PKI" --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=$API_PORT \
    --service-cluster-ip-range=$SVC_CIDR --service-node-port-range=30000-32767 \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.key" --service-account-signing-key-file="$PKI/sa.key" \
    --token-auth-file="$CONF/tokens.csv" --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --allow-privileged=true --kubelet-preferred-address-types=InternalIP --profiling=false
  wait_healthy kube-apiserver "https://127.0.0.1:$API_PORT/readyz" -H "Authorization: Bearer $admin_token"
  running kube-controller-manager || start_process kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$CONF/kcm.kubeconfig" --authentication-kubeconfig="$CONF/kcm.kubeconfig" \
    --authorization-kubeconfig="$CONF/kcm.kubeconfig" --leader-elect=false --bind-address=127.0.0.1 \
    --secure-port=10257 --cert-dir="$STATE/kcm-pki" --service-account-private-key-file="$PKI/sa.key" \
    --root-ca-file="$PKI/apiserver.crt" --use-service-account-credentials=true \
    --cluster-cidr=$POD_SUBNET --service-cluster-ip-range=$SVC_CIDR --allocate-node-cidrs=false --profiling=false
  running kube-scheduler || start_process kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$CONF/scheduler.kubeconfig" \
    --authentication-kubeconfig="$CONF/scheduler.kubeconfig" --authorization-kubeconfig="$CONF/scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=10259 --profiling=false
  if ! containerd_up; then
    # containerd finds its runc shim on PATH
    start_process containerd env PATH="$BIN:$PATH" "$BIN/containerd" --config "$CONF/containerd.toml"
    local i; for i in $(seq 150); do containerd_up && break; require_running containerd; sleep 0.2; done
    containerd_up || die "containerd did not open $SOCK"
    say "containerd up"
  fi
  # the registry logs each request (tests read which manifests were pulled); no OpenTelemetry export
  running registry || start_process registry env OTEL_TRACES_EXPORTER=none "$BIN/registry" serve "$CONF/registry.yml"
  wait_healthy registry "http://127.0.0.1:$REGISTRY_PORT/v2/"
  import_images
  running kubelet || start_process kubelet "$BIN/kubelet" --config="$CONF/kubelet.yaml" \
    --kubeconfig="$CONF/kubelet.kubeconfig" --root-dir="$STATE/kubelet" --cert-dir="$STATE/kubelet/pki" \
    --hostname-override=$NODE --node-ip="$NODE_IP" --v=1
  running kube-proxy || start_process kube-proxy "$BIN/kube-proxy" --config="$CONF/kube-proxy.yaml"
  wait_healthy kube-controller-manager https://127.0.0.1:10257/healthz
  wait_healthy kube-scheduler https://127.0.0.1:10259/healthz
  wait_healthy kubelet http://127.0.0.1:10248/healthz
  wait_healthy kube-proxy http://127.0.0.1:10256/healthz
  kubectl_ wait --for=condition=Ready "node/$NODE" --timeout=120s >/dev/null
  say "node $NODE Ready"
  cluster_objects
  running coredns || start_process coredns "$BIN/coredns" -conf "$CONF/Corefile"
  wait_healthy coredns http://127.0.0.1:8182/ready
  volumes
  say "cluster up: export KUBECONFIG=$STATE/admin.kubeconfig"
}

cluster_objects() {  # cluster DNS and the default StorageClass
  kubectl_ apply -f - >/dev/null <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: User, name: "system:coredns"}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $DNS_IP
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 1053}, {name: dns-tcp, port: 53, protocol: TCP, targetPort: 1053}]
---
# CoreDNS runs as a host process: the Service's endpoint is the node itself.
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-host, namespace: kube-system, labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: grpo-node}}
addressType: IPv4
endpoints: [{addresses: ["$NODE_IP"], conditions: {ready: true}}]
ports: [{name: dns, port: 1053, protocol: UDP}, {name: dns-tcp, port: 1053, protocol: TCP}]
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: standard, annotations: {storageclass.kubernetes.io/is-default-class: "true"}}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
reclaimPolicy: Retain
YAML
}

# ---------------------------------------------------------------------------------------------- volumes
volumes() {  # a pool of hostPath PVs in class `standard`; a Released one is wiped and offered again
  local i name phase dir
  for i in $(seq 1 "$VOLUME_COUNT"); do
    name=grpo-node-pv-$i dir=$STATE/volumes/pv-$i
    phase=$(kubectl_ get pv "$name" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    case $phase in
      Available|Bound|Pending) continue ;;
      Released|Failed) kubectl_ delete pv "$name" --wait=true >/dev/null ;;
    esac
    rm -rf "$dir"; mkdir -p "$dir"; chmod 0777 "$dir"   # any pod UID may write (hostPath has no fsGroup)
    kubectl_ apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: $name, labels: {grpo.dev/node-volume: "true"}}
spec:
  capacity: {storage: $VOLUME_SIZE}
  accessModes: [ReadWriteOnce, ReadWriteMany, ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: standard
  hostPath: {path: $dir, type: Directory}
YAML
  done
}

# ----------------------------------------------------------------------------------------------- images
import_images() {  # import_images : the pod sandbox image (pinned by containerd) from its archive
  local ref archive present keep stale
  present=$(ctr_ images ls -q 2>/dev/null)   # (a cgroup v1 host makes ctr warn on every call)
  # The project's images come from the registry; what containerd holds of older builds goes first (it
  # then collects their layers), so the node's store holds one build of each, not one per change.
  keep=$(bash "$REPO/hack/images.sh" list | awk -v r="$REGISTRY/$REGISTRY_NAMESPACE/" '
    $1 ~ /^localhost\/pause:/ {print $1} $1 ~ /^localhost\/grpo-(operator|server|trainer):/ {print r substr($1, 11)}')
  stale=$(grep -E "^(localhost/(pause|grpo-(base|operator|server|trainer))|$REGISTRY/$REGISTRY_NAMESPACE/grpo-[a-z]+):" \
    <<<"$present" | grep -vxFf <(echo "$keep") || true)
  if [ -n "$stale" ]; then
    # shellcheck disable=SC2086
    ctr_ images rm --sync $stale >/dev/null 2>&1 || true
    present=$(ctr_ images ls -q 2>/dev/null)
  fi
  read -r ref archive < <(bash "$REPO/hack/images.sh" list | grep '^localhost/pause:')
  grep -qxF "$ref" <<<"$present" && return
  [ -s "$archive" ] || die "no archive for $ref: run hack/images.sh build pause"
  ctr_ images import "$archive" >/dev/null
  say "imported $ref"
}

push_images() {  # the project's images from hack/images.sh to the registry, skipping what it holds
  local ref archive name
  while read -r ref archive; do
    case $ref in localhost/grpo-operator:*|localhost/grpo-server:*|localhost/grpo-trainer:*) ;; *) continue ;; esac
    name=${ref#localhost/}
    [ -s "$archive" ] || die "no archive for $ref: run hack/images.sh build"
    push_archive "$archive" "$REGISTRY/$REGISTRY_NAMESPACE/$name" --if-absent   # tagged by input hash
  done <<<"$(bash "$REPO/hack/images.sh" list)"
}

push_archive() {  # push_archive ARCHIVE REF [--if-absent] : a docker-archive to the node's registry
  local repo=${2#"$REGISTRY"/} tag=${2##*:} s
  repo=${repo%:*}
  if [ "${3:-}" = --if-absent ] && [ "$(curl -s -o /dev/null -w '%{http_code}' -I -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
      -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
      "http://$REGISTRY/v2/$repo/manifests/$tag")" = 200 ]; then return; fi
  s=$(date +%s)
  skopeo copy --quiet --dest-tls-verify=false "docker-archive:$1" "docker://$2" >/dev/null
  say "pushed $2 ($(( $(date +%s) - s ))s)"
}

import_archives() {  # import_archives ARCHIVE... : other images (hack/images.sh data), as they are
  local archive
  for archive in "$@"; do
    [ -s "$archive" ] || die "no archive $archive"
    ctr_ images import "$archive" >/dev/null
    say "imported $archive"
  done
}

# ------------------------------------------------------------------------------------------------- down
down() {
  set +e +o pipefail   # cleanup goes on past whatever is already gone
  testbin_quiet
  for n in coredns kube-proxy kubelet; do stop_process $n; done   # nothing may restart pods while they go
  if containerd_up; then
    local c
    for c in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -a -s SIGKILL "$c" >/dev/null 2>&1 || true; done
    sleep 1
    for c in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$c" >/dev/null 2>&1 || true; done
    for c in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$c" >/dev/null 2>&1 || true; done
  fi
  stop_process containerd
  for n in kube-scheduler kube-controller-manager kube-apiserver etcd registry; do stop_process $n; done
  local f m ns
  for f in $(find "$RUN/containerd" -name shim.pid 2>/dev/null); do kill -KILL "$(cat "$f")" 2>/dev/null || true; done
  # mounts under our directories (pod volumes, overlays, sandbox shm), deepest first
  awk '{print $2}' /proc/mounts | grep -E "^($STATE|$RUN)/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  # network namespaces the CRI made (containerd 1.6 pins them under /run/netns/cni-*)
  for ns in $(ls /run/netns 2>/dev/null | grep '^cni-' | grep -vxFf "$RUN/netns.before" 2>/dev/null || true); do
    umount -l "/run/netns/$ns" 2>/dev/null || true; rm -f "/run/netns/$ns"
  done
  # cgroups of pods (kubepods) and of containerd's own namespace, deepest first
  find /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/k8s.io \
    -depth -type d 2>/dev/null | while read -r m; do rmdir "$m" 2>/dev/null || true; done
  # iptables: kube-proxy's chains, the kubelet's KUBE-FIREWALL/KUBE-KUBELET-CANARY, the bridge plugin's CNI-*
  [ -n "${BIN:-}" ] && [ -x "$BIN/kube-proxy" ] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  local ipt tbl chains c r
  for ipt in iptables ip6tables; do
    command -v $ipt >/dev/null || continue
    for tbl in nat filter mangle; do
      $ipt -t $tbl -S 2>/dev/null | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE|CNI)-' \
        | sed 's/^-A/-D/' | while read -r r; do eval "$ipt -t $tbl $r" 2>/dev/null || true; done
      chains=$($ipt -t $tbl -S 2>/dev/null | sed -nE 's/^-N ((KUBE|CNI)-[^ ]+)/\1/p')
      for c in $chains; do $ipt -t $tbl -F "$c" 2>/dev/null || true; done
      for c in $chains; do $ipt -t $tbl -X "$c" 2>/dev/null || true; done
    done
  done
  ip link del "$BRIDGE" 2>/dev/null && say "bridge $BRIDGE deleted" || true
  rm -rf "$STATE/cni"
  if [ -f "$RUN/sysctl.saved" ]; then
    sed 's/ = /=/' "$RUN/sysctl.saved" | while read -r kv; do sysctl -qw "$kv" 2>/dev/null || true; done
    rm -f "$RUN/sysctl.saved"
  fi
  rm -f "$RUN/netns.before"
  case ${1:-} in
    --purge)   # the cluster's state goes; the image store and the registry (caches, keyed by content) stay
      find "$STATE" -mindepth 1 -maxdepth 1 ! -name containerd ! -name registry -exec rm -rf {} +
      rm -rf "$RUN"
      say "state purged (images kept)" ;;
    --purge-all) rm -rf "$STATE" "$RUN"; say "state and images purged" ;;
  esac
  say "down"
}
testbin_quiet() { BIN=${GRPO_TESTBIN_DIR:-$(ls -d "$HOME"/.cache/grpo-testbin/k8s-* 2>/dev/null | head -1)}; }

env_() {
  testbin_quiet
  echo "export KUBECONFIG=$STATE/admin.kubeconfig"
  echo "export PATH=$BIN:\$PATH   # kubectl, helm"
  echo "export GRPO_NODE_REGISTRY=$REGISTRY   # the node's registry: plain HTTP (helm --plain-http)"
}

case ${1:-} in
  deps) mkdir -p "$LOG"; packages ;;
  up) up ;;
  images) shift; mkdir -p "$LOG"; testbin_quiet; containerd_up || die "the cluster is not up"
          if [ $# -gt 0 ]; then import_archives "$@"; else import_images; push_images; fi ;;
  push) shift; [ $# -eq 2 ] || die "usage: hack/cluster.sh push ARCHIVE REF"; mkdir -p "$LOG"; testbin_quiet
        running registry || die "the node's registry is not running (hack/cluster.sh up)"
        case $2 in "$REGISTRY"/*) push_archive "$1" "$2" ;; *) die "$2 is not in the node's registry $REGISTRY" ;; esac ;;
  volumes) testbin_quiet; volumes ;;
  env) env_ ;;
  down) shift; down "${1:-}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
