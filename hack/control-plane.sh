#!/usr/bin/env bash
# Builds a local Kubernetes control plane from the Go module proxy, once per machine, into a
# cache outside the repo (research/operator-testing-and-kopf.md, sections 1.3-1.4):
#   hack/control-plane.sh build    kube-apiserver, kube-controller-manager, kube-scheduler,
#                                  kubectl (k8s.io/kubernetes v$K8S_VERSION), etcd and helm
#   hack/control-plane.sh node     kubelet and kube-proxy (same module) and CoreDNS, for the
#                                  one-node cluster of the e2e tier (hack/node.py)
#   hack/control-plane.sh kubeflow Kubeflow's training-operator (the TFJob controller) and its
#                                  TFJob CRD, the baseline of bench/operator.py --baseline kubeflow
#   hack/control-plane.sh bin      prints the directory holding the binaries
# Idempotent: a finished build (stamp file) is reused. Needs Go >= 1.24 and the module proxy.
# Stay on Kubernetes 1.34 for the node: newer kubelets leave cgroup v1 and containerd 1.x behind.
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-1.34.1}
ETCD_VERSION=${ETCD_VERSION:-3.6.4}
HELM_VERSION=${HELM_VERSION:-3.19.5}
COREDNS_VERSION=${COREDNS_VERSION:-1.13.1}
KUEUE_VERSION=${KUEUE_VERSION:-0.17.0}
KUBEFLOW_VERSION=${KUBEFLOW_VERSION:-1.9.3}
CACHE=${JAXPS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxps}
ROOT="$CACHE/k8s-v$K8S_VERSION"
BIN="$ROOT/bin"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
# the usual place of an installed Go, when it is not on PATH (a non-login CI shell)
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then export PATH=/usr/local/go/bin:$PATH; fi
export GOPATH=${GOPATH:-$CACHE/gopath} GOCACHE=${GOCACHE:-$CACHE/gocache}

k8s_build() {
  mkdir -p "$BIN" "$ROOT/k8sbins"
  (
    cd "$ROOT/k8sbins"
    [ -f go.mod ] || go mod init local.test/k8sbins
    gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    for m in $(grep -oP '^\s+\Kk8s\.io/[a-z0-9-]+(?= v0\.0\.0$)' "$gomod"); do
      go mod edit -replace="$m=$m@v0.${K8S_VERSION#1.}"
    done
    go mod edit -require="k8s.io/kubernetes@v$K8S_VERSION" -godebug=default=go1.24
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
    [ -f go.sum ] && grep -q kube-proxy tools.go.done 2>/dev/null || { go mod tidy && cp tools.go tools.go.done; }
    minor=$(echo "$K8S_VERSION" | cut -d. -f2)
    ldflags="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldflags="$ldflags -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
      ldflags="$ldflags -X $p.gitTreeState=clean -X $p.gitCommit=0000000"
      ldflags="$ldflags -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$BIN/" "$@"
  )
}

helm() {
  if [ -x "$BIN/helm" ]; then return; fi
  echo "building helm v$HELM_VERSION into $BIN (once)"
  mkdir -p "$BIN"
  # helm's go.mod has no replace directives, so plain `go install` works
  GOBIN="$BIN" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
  "$BIN/helm" version --short
}

build() {
  command -v go >/dev/null || { echo "need the Go toolchain (>= 1.24)"; exit 1; }
  helm
  if [ -f "$ROOT/.built" ]; then echo "control plane v$K8S_VERSION already built in $BIN"; return; fi
  command -v go >/dev/null || { echo "need the Go toolchain (>= 1.24)"; exit 1; }
  mkdir -p "$BIN" "$ROOT/k8sbins" "$ROOT/etcdbin"
  echo "building Kubernetes v$K8S_VERSION and etcd v$ETCD_VERSION into $BIN (once; 10-40 min)"
  k8s_build k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
  (
    cd "$ROOT/etcdbin"
    [ -f go.mod ] || go mod init local.test/etcdbin
    go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
    go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  )
  "$BIN/kube-apiserver" --version
  "$BIN/etcd" --version | head -1
  touch "$ROOT/.built"
}

# kubelet and kube-proxy come from the same module as the control plane (+35 s on its cache);
# CoreDNS has no replace directives in its go.mod, so plain `go install` works.
node() {
  command -v go >/dev/null || { echo "need the Go toolchain (>= 1.24)"; exit 1; }
  if [ ! -x "$BIN/kubelet" ] || [ ! -x "$BIN/kube-proxy" ]; then
    echo "building kubelet and kube-proxy v$K8S_VERSION into $BIN (once)"
    k8s_build k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
  fi
  if [ ! -x "$BIN/coredns" ]; then
    echo "building CoreDNS v$COREDNS_VERSION into $BIN (once)"
    GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@v$COREDNS_VERSION"
  fi
  "$BIN/kubelet" --version
}

# Kueue's manager from its Go module (no replace directives: plain `go install`), and its Helm
# chart from the same module, copied next to the binary (research/kueue.md, section 4).
kueue() {
  command -v go >/dev/null || { echo "need the Go toolchain (>= 1.25)"; exit 1; }
  local dir="$CACHE/kueue-v$KUEUE_VERSION"
  if [ -x "$dir/manager" ] && [ -f "$dir/chart/Chart.yaml" ]; then return; fi
  echo "building Kueue v$KUEUE_VERSION into $dir (once; 10-20 min)"
  mkdir -p "$dir"
  GOBIN="$dir" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=v$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
  mv "$dir/kueue" "$dir/manager"
  local src
  src=$(go mod download -json "sigs.k8s.io/kueue@v$KUEUE_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  rm -rf "$dir/chart" && cp -r "$src/charts/kueue" "$dir/chart" && chmod -R u+w "$dir/chart"
  "$dir/manager" --help >/dev/null 2>&1 || true
  echo "Kueue v$KUEUE_VERSION: $dir/manager and $dir/chart"
}

# Kubeflow's training-operator from its Go module (no replace directives: plain `go install`),
# with the TFJob CRD of the same module next to it: the operator bench/operator.py measures
# ours against.
kubeflow() {
  command -v go >/dev/null || { echo "need the Go toolchain (>= 1.23)"; exit 1; }
  local dir="$CACHE/kubeflow-training-operator-v$KUBEFLOW_VERSION"
  if [ -x "$dir/training-operator" ] && [ -f "$dir/tfjobs.yaml" ]; then return; fi
  echo "building Kubeflow's training-operator v$KUBEFLOW_VERSION into $dir (once; 5-10 min)"
  mkdir -p "$dir"
  GOBIN="$dir" go install -trimpath -ldflags "-s -w" \
    "github.com/kubeflow/training-operator/cmd/training-operator.v1@v$KUBEFLOW_VERSION"
  mv "$dir/training-operator.v1" "$dir/training-operator"
  local src
  src=$(go mod download -json "github.com/kubeflow/training-operator@v$KUBEFLOW_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  cp "$src/manifests/base/crds/kubeflow.org_tfjobs.yaml" "$dir/tfjobs.yaml"
  chmod u+w "$dir/tfjobs.yaml"
  echo "Kubeflow training-operator v$KUBEFLOW_VERSION: $dir/training-operator and $dir/tfjobs.yaml"
}

case "${1:-}" in
  build) build ;;
  node) build && node ;;
  kueue) kueue ;;
  kueue-dir) echo "$CACHE/kueue-v$KUEUE_VERSION" ;;
  kubeflow) kubeflow ;;
  kubeflow-dir) echo "$CACHE/kubeflow-training-operator-v$KUBEFLOW_VERSION" ;;
  bin) echo "$BIN" ;;
  *) echo "usage: $0 build|node|kueue|kueue-dir|kubeflow|kubeflow-dir|bin"; exit 2 ;;
esac
