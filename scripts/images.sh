#!/usr/bin/env bash
# Builds the container images from deploy/docker/*.Dockerfile with buildah, then runs each once.
#
# The Dockerfiles' default bases (Docker Hub's rust, python and debian images) cannot be pulled
# from here, so this makes equivalent local bases first (once, cached in ~/.cache/sluice/images):
#   localhost/sluice-base/debian:bookworm-slim   debootstrap --variant=minbase bookworm
#   localhost/sluice-base/python:3.11-bookworm   + Debian's python3.11 and pip
#   localhost/sluice-base/rust:<ver>-bookworm    + this machine's Rust toolchain (rustc --print sysroot)
# and passes them as the Dockerfiles' RUST_IMAGE / PYTHON_IMAGE / RUNTIME_IMAGE build args. With
# registry access, `podman build -f deploy/docker/…` uses the official images instead.
#
# This machine's extra CA certificates (/usr/local/share/ca-certificates, e.g. a TLS-intercepting
# egress proxy's) are added to the two *build* bases only, so that cargo and pip reach crates.io and
# PyPI from inside a build; the runtime base and the images get Debian's bundle alone.
#
# Builds run with chroot isolation (no container runtime is needed: crun cannot set rlimits in
# this sandbox). The smoke runs: the producer's and the worker's --version, and the worker image
# generating an image from the tiny Stable Diffusion model, byte-compared with the same run here.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
DIR="$CACHE/images"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)"
RUST_VERSION="$(rustc --version | cut -d' ' -f2)"
BASE=localhost/sluice-base/debian:$SUITE-slim
PYTHON=localhost/sluice-base/python:3.11-$SUITE
RUST=localhost/sluice-base/rust:$RUST_VERSION-$SUITE
export BUILDAH_ISOLATION=chroot

need() {
  if ! command -v "$1" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah debootstrap >/dev/null
    else
      echo "error: $1 is missing (Debian: apt-get install buildah debootstrap)" >&2
      exit 1
    fi
  fi
}
need buildah
need debootstrap

exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# Debian's CA bundle plus this machine's extra CAs, in container $1.
trust_this_network() {
  buildah run "$1" -- sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*' >/dev/null
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    buildah copy -q "$1" /usr/local/share/ca-certificates/ /usr/local/share/ca-certificates/ >/dev/null
    buildah run "$1" -- update-ca-certificates >/dev/null
  fi
}

mkdir -p "$DIR"
if ! exists "$BASE"; then
  if [ ! -f "$DIR/rootfs-$SUITE/etc/debian_version" ]; then
    echo "==> debootstrap $SUITE (minbase) into $DIR/rootfs-$SUITE (once per machine)" >&2
    rm -rf "$DIR/rootfs-$SUITE.partial"
    debootstrap --variant=minbase "$SUITE" "$DIR/rootfs-$SUITE.partial" "$MIRROR" >"$DIR/debootstrap.log"
    rm -rf "$DIR/rootfs-$SUITE.partial/var/cache/apt/archives/"*.deb
    mv "$DIR/rootfs-$SUITE.partial" "$DIR/rootfs-$SUITE"
  fi
  echo "==> $BASE" >&2
  c=$(buildah from scratch)
  cp -a "$DIR/rootfs-$SUITE/." "$(buildah mount "$c")/"
  buildah umount "$c" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$c"
  buildah commit -q --rm "$c" "$BASE" >/dev/null
fi
if ! exists "$PYTHON"; then
  echo "==> $PYTHON" >&2
  c=$(buildah from "$BASE")
  trust_this_network "$c"
  buildah run "$c" -- sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends python3 python3-pip python3-venv && rm -rf /var/lib/apt/lists/*' >/dev/null
  buildah commit -q --rm "$c" "$PYTHON" >/dev/null
fi
if ! exists "$RUST"; then
  echo "==> $RUST (this machine's toolchain)" >&2
  sysroot="$(rustc --print sysroot)"
  c=$(buildah from "$BASE")
  trust_this_network "$c"
  mnt=$(buildah mount "$c")
  mkdir -p "$mnt/usr/local/rust"
  (cd "$sysroot" && tar -c --exclude=share/doc --exclude='lib/rustlib/src' . ) | tar -x -C "$mnt/usr/local/rust"
  buildah umount "$c" >/dev/null
  buildah config --env PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env CARGO_HOME=/usr/local/cargo "$c"
  buildah commit -q --rm "$c" "$RUST" >/dev/null
fi

cd "$root"
args=(--build-arg "RUST_IMAGE=$RUST" --build-arg "PYTHON_IMAGE=$PYTHON" --build-arg "RUNTIME_IMAGE=$BASE" --layers)
echo "==> sluice-producer:$VERSION" >&2
buildah bud "${args[@]}" -f deploy/docker/producer.Dockerfile -t "localhost/sluice-producer:$VERSION" . >"$DIR/producer-build.log" 2>&1 \
  || { tail -30 "$DIR/producer-build.log" >&2; exit 1; }
for flavour in ${SLUICE_IMAGE_FLAVOURS:-cpu}; do
  echo "==> sluice-worker:$VERSION-$flavour" >&2
  buildah bud "${args[@]}" --build-arg "ORT_FLAVOUR=$flavour" -f deploy/docker/worker.Dockerfile \
    -t "localhost/sluice-worker:$VERSION-$flavour" . >"$DIR/worker-$flavour-build.log" 2>&1 \
    || { tail -30 "$DIR/worker-$flavour-build.log" >&2; exit 1; }
done

# Smoke runs, as the images' own user (65532).
run() { # image [buildah-run options...] -- command...
  local image=$1 c status=0
  shift
  local options=()
  while [ "$1" != "--" ]; do
    options+=("$1")
    shift
  done
  shift
  c=$(buildah from "$image")
  buildah run --user 65532:65532 "${options[@]}" "$c" -- "$@" 2>&1 || status=$?
  buildah rm "$c" >/dev/null
  return "$status"
}
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'sluice-(producer|worker)'
run "localhost/sluice-producer:$VERSION" -- /usr/local/bin/sluice-producer --version
run "localhost/sluice-worker:$VERSION-cpu" -- /usr/local/bin/sluice-worker --version
eval "$("$root/scripts/fetch-assets.sh" | grep -E '^export (SLUICE_SD_TINY|ORT_DYLIB_PATH)=')"
out="$(mktemp -d)"
chmod 777 "$out"
trap 'rm -rf "$out"' EXIT
gen=(generate --model-path /models/sd-tiny --prompt "a lighthouse" --seed 7 --steps 4 --width 64 --height 64)
run "localhost/sluice-worker:$VERSION-cpu" -v "$SLUICE_SD_TINY:/models:ro" -v "$out:/out" -- \
  /usr/local/bin/sluice-worker "${gen[@]}" --out /out/in-image.png >/dev/null
target="${CARGO_TARGET_DIR:-$CACHE/target}/release/sluice-worker"
ORT_DYLIB_PATH="$ORT_DYLIB_PATH" "$target" "${gen[@]/\/models/$SLUICE_SD_TINY}" --out "$out/here.png" >/dev/null 2>&1
if cmp -s "$out/in-image.png" "$out/here.png"; then
  echo "worker image: sluice-worker generate in the image = the same run here, byte for byte ($(stat -c %s "$out/here.png") bytes)"
else
  echo "error: the image's PNG differs from this machine's" >&2
  exit 1
fi
