#!/usr/bin/env bash
# Fetches the runtime assets Sluice needs from PyPI into a cache outside the clone, once per
# machine, and verifies their checksums:
#   - libonnxruntime.so from the pinned `onnxruntime` wheel (ort's own download step needs a CDN
#     that is not reachable here, so the library comes from the registry instead);
#   - the pretrained one-step consistency UNet from `adaptive-terrain-diffusion`, served as model
#     `terrain`;
#   - a Python venv with the pinned `onnx` package, used to generate the small test models.
# Idempotent: a second run only re-checks what is there. Prints the asset paths as `export` lines.
set -euo pipefail

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
ORT_VERSION=1.24.1
ORT_WHEEL=onnxruntime-1.24.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
ORT_WHEEL_SHA256=1cabe71ca14dcfbf812d312aab0a704507ac909c137ee6e89e4908755d0fc60e
TERRAIN_VERSION=0.4.2
TERRAIN_WHEEL=adaptive_terrain_diffusion-0.4.2-py3-none-any.whl
TERRAIN_WHEEL_SHA256=dd803be2c98d764e4e64db18c631eef46c210282b398c4dd080f4cda3fa7c84d
TERRAIN_ONNX=terrain_diffusion/weights/terrain_consistency_unet_difficulty100.onnx
TERRAIN_ONNX_SHA256=95be54b4a39d58320e187a7ec533351c957f16a00be58773c86074828ee67887
ONNX_PY_VERSION=1.23.2

PY="${PYTHON:-python3}"
mkdir -p "$CACHE/wheels" "$CACHE/ort" "$CACHE/models"

log() { echo "==> $*" >&2; }

check_sha() { # file expected
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "checksum mismatch for $1: expected $2, got $got" >&2
    return 1
  fi
}

fetch_wheel() { # requirement wheel-file sha256 [extra pip args]
  local req=$1 file=$2 sha=$3; shift 3
  if [ -f "$CACHE/wheels/$file" ] && check_sha "$CACHE/wheels/$file" "$sha" 2>/dev/null; then
    return 0
  fi
  log "downloading $req from PyPI"
  rm -f "$CACHE/wheels/$file"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: "$@" -d "$CACHE/wheels" "$req"
  check_sha "$CACHE/wheels/$file" "$sha"
}

# ONNX Runtime shared library.
ORT_DIR="$CACHE/ort/$ORT_VERSION"
ORT_LIB="$ORT_DIR/libonnxruntime.so.$ORT_VERSION"
if [ ! -f "$ORT_LIB" ]; then
  fetch_wheel "onnxruntime==$ORT_VERSION" "$ORT_WHEEL" "$ORT_WHEEL_SHA256" \
    --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  rm -rf "$ORT_DIR.partial" && mkdir -p "$ORT_DIR.partial"
  (cd "$ORT_DIR.partial" && "$PY" -m zipfile -e "$CACHE/wheels/$ORT_WHEEL" wheel >/dev/null)
  cp "$ORT_DIR.partial/wheel/onnxruntime/capi/libonnxruntime.so.$ORT_VERSION" "$ORT_DIR.partial/"
  rm -rf "$ORT_DIR.partial/wheel" "$ORT_DIR"
  mv "$ORT_DIR.partial" "$ORT_DIR"
fi

# Pretrained terrain model.
MODEL_DIR="$CACHE/models/terrain-$TERRAIN_VERSION"
if [ ! -f "$MODEL_DIR/model.onnx" ] || ! check_sha "$MODEL_DIR/model.onnx" "$TERRAIN_ONNX_SHA256" 2>/dev/null; then
  fetch_wheel "adaptive-terrain-diffusion==$TERRAIN_VERSION" "$TERRAIN_WHEEL" "$TERRAIN_WHEEL_SHA256"
  rm -rf "$MODEL_DIR.partial" && mkdir -p "$MODEL_DIR.partial"
  "$PY" - "$CACHE/wheels/$TERRAIN_WHEEL" "$TERRAIN_ONNX" "$MODEL_DIR.partial/model.onnx" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
  check_sha "$MODEL_DIR.partial/model.onnx" "$TERRAIN_ONNX_SHA256"
  rm -rf "$MODEL_DIR" && mv "$MODEL_DIR.partial" "$MODEL_DIR"
fi

# Python venv with `onnx`, for generating the test models (scripts/gen-models.py).
VENV="$CACHE/venv-onnx-$ONNX_PY_VERSION"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import onnx" 2>/dev/null; then
  log "creating $VENV with onnx==$ONNX_PY_VERSION"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet "onnx==$ONNX_PY_VERSION" "numpy==2.2.6"
fi

# The tiny random-weight Stable Diffusion models (integration-tests/fixtures/sd-tiny.tar.xz, made
# by scripts/sd-reference/generate.sh): sd-tiny, sd-tiny-lcm, sd-tiny-external. Unpacked once per
# version of the fixture.
SD_FIXTURE="$(cd "$(dirname "$0")/.." && pwd)/integration-tests/fixtures/sd-tiny.tar.xz"
SD_SHA=$(sha256sum "$SD_FIXTURE" | cut -c1-16)
SD_DIR="$CACHE/models/sd-tiny-$SD_SHA"
if [ ! -f "$SD_DIR/sd-tiny/unet/model.onnx" ]; then
  rm -rf "$SD_DIR.partial" && mkdir -p "$SD_DIR.partial"
  tar -xJf "$SD_FIXTURE" -C "$SD_DIR.partial"
  rm -rf "$SD_DIR" && mv "$SD_DIR.partial" "$SD_DIR"
fi

echo "export ORT_DYLIB_PATH=$ORT_LIB"
echo "export SLUICE_TERRAIN_MODEL=$MODEL_DIR/model.onnx"
echo "export SLUICE_ONNX_PYTHON=$VENV/bin/python"
echo "export SLUICE_SD_TINY=$SD_DIR"
