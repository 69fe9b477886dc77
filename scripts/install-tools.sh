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

what="${1:-all}"
case "$what" in
  s3s-fs) install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary ;;
  tansu) install_crate tansu "$TANSU_VERSION" tansu --features dynostore,libsql ;;
  all)
    install_crate s3s-fs "$S3S_VERSION" s3s-fs --features binary
    install_crate tansu "$TANSU_VERSION" tansu --features dynostore,libsql
    ;;
  *) echo "usage: $0 [all|tansu|s3s-fs]" >&2; exit 2 ;;
esac
