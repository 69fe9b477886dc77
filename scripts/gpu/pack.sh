#!/usr/bin/env bash
# Packs what `make gpu-check` and `make gpu-bench` need on a GPU node that has the NVIDIA driver
# and a Python with numpy (and, for CUDA 13, the CUDA libraries its torch installed), but no Rust
# toolchain, no Java and no network: the release binaries, the integration-test executables the
# checks run, a Java 17 runtime (jlink) with Kafka's jars, the S3 server, and ONNX Runtime's CUDA
# flavour without the CUDA libraries (fetch-assets.sh reuses the node's). Built and tested here,
# where the registries are reachable; the checkout itself travels separately (it holds the
# fixtures and the scripts).
#
#   scripts/gpu/pack.sh [OUT_DIR] [PART_MB]
#
# Writes OUT_DIR (default .gpu-pack) /pack.tar.xz split into parts of PART_MB MiB (default 32)
# named pack.tar.xz.00, .01, …, and prints their names. On the node:
#   cat pack.tar.xz.* | tar -xJ -C /tmp/sluice-gpu && . /tmp/sluice-gpu/env.sh
# env.sh points SLUICE_CACHE, PATH, SLUICE_BIN_DIR and SLUICE_TEST_BIN_DIR at the unpacked tree.
# SLUICE_PACK_FLAVOUR (default cuda13) picks the ONNX Runtime CUDA flavour packed, SLUICE_PACK_SM
# (default 90: H100, H200) the GPU architecture whose kernels it keeps.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/.gpu-pack}"
part_mb="${2:-32}"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
target="${CARGO_TARGET_DIR:-$CACHE/target}"
tests=(memory)  # its diffusion:: tests are what a node without the terrain model runs (scripts/gpu/check.sh)
log() { echo "==> $*" >&2; }

cd "$root"
log "building the release binaries and the test executables"
cargo build --release --locked --bins >&2
executables=$(cargo test --release --locked -p sluice-integration-tests --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
wanted = set(sys.argv[1:])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] and m["target"]["name"] in wanted:
        print(m["target"]["name"], m["executable"])
' "${tests[@]}")

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/cache/tools" "$stage/cache/ort"
for b in sluice-worker sluice-bench; do
  strip -o "$stage/bin/$b" "$target/release/$b"
done
while read -r name exe; do
  strip -o "$stage/bin/$name" "$exe"
done <<<"$executables"

log "ONNX Runtime, the ${SLUICE_PACK_FLAVOUR:-cuda13} flavour (without CUDA libraries)"
ort_dylib=$(SLUICE_ASSETS=runtime SLUICE_ORT_FLAVOUR="${SLUICE_PACK_FLAVOUR:-cuda13}" "$root/scripts/fetch-assets.sh" |
  sed -n 's/^export ORT_DYLIB_PATH=//p')
ort_dir=$(dirname "$ort_dylib")
cp -a "$ort_dir" "$stage/cache/ort/"
# Only the node's GPU architecture's kernels survive in the CUDA provider (scripts/gpu/fatbin_keep.py).
provider="$stage/cache/ort/$(basename "$ort_dir")/libonnxruntime_providers_cuda.so"
python3 "$here/fatbin_keep.py" "$provider" "${SLUICE_PACK_SM:-90}" "$provider.kept"
mv "$provider.kept" "$provider"
cpu_dylib=$(SLUICE_ASSETS=runtime "$root/scripts/fetch-assets.sh" | sed -n 's/^export ORT_DYLIB_PATH=//p')
cp -a "$(dirname "$cpu_dylib")" "$stage/cache/ort/"

log "the stack: Kafka's jars, the S3 server, a Java runtime"
"$root/scripts/install-tools.sh" stack >&2
cp -a "$CACHE"/tools/kafka-* "$CACHE"/tools/s3s-fs-* "$stage/cache/tools/"
rm -rf "$stage"/cache/tools/*.partial
# Kafka's broker and its admin tool (run from source: jdk.compiler) need these modules.
jlink --add-modules java.base,java.compiler,java.desktop,java.instrument,java.logging,java.management,java.management.rmi,java.naming,java.net.http,java.rmi,java.scripting,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.compiler,jdk.crypto.ec,jdk.jfr,jdk.management,jdk.naming.dns,jdk.net,jdk.unsupported,jdk.zipfs \
  --strip-debug --no-header-files --no-man-pages --output "$stage/jre" >&2

cat >"$stage/env.sh" <<'ENV'
# Sourced on the GPU node after unpacking (see scripts/gpu/pack.sh).
pack="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export SLUICE_CACHE="$pack/cache" SLUICE_BIN_DIR="$pack/bin" SLUICE_TEST_BIN_DIR="$pack/bin"
export PATH="$pack/jre/bin:$pack/bin:$PATH" JAVA_HOME="$pack/jre"
# The pretrained terrain model is not packed (38 MB of xz): the checks that serve it need network.
export SLUICE_ASSETS=no-terrain
# fetch-assets.sh's model venv: the node's own Python has onnx and numpy.
if [ ! -x "$SLUICE_CACHE/venv-onnx-1.23.2/bin/python" ]; then
  mkdir -p "$SLUICE_CACHE/venv-onnx-1.23.2/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$SLUICE_CACHE/venv-onnx-1.23.2/bin/python"
  chmod +x "$SLUICE_CACHE/venv-onnx-1.23.2/bin/python"
fi
ENV

mkdir -p "$out"
rm -f "$out"/pack.tar.xz.*
log "compressing"
tar -C "$stage" -cf - . | xz -T0 -6 | split -b "${part_mb}M" -d - "$out/pack.tar.xz."
du -b "$out"/pack.tar.xz.* >&2
ls "$out"/pack.tar.xz.*
