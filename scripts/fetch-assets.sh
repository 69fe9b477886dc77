#!/usr/bin/env bash
# Fetches the runtime assets Sluice needs from PyPI into a cache outside the clone, once per
# machine, and verifies their checksums:
#   - libonnxruntime.so from the pinned `onnxruntime` wheel (ort's own download step needs a CDN
#     that is not reachable here, so the library comes from the registry instead);
#   - the pretrained one-step consistency UNet from `adaptive-terrain-diffusion`, served as model
#     `terrain`;
#   - a Python venv with the pinned `onnx` package, used to generate the small test models;
#   - the tiny Stable Diffusion test models (unpacked from integration-tests/fixtures);
#   - with SLUICE_ORT_FLAVOUR=cuda (or `make assets-cuda`), the CUDA flavour: `onnxruntime-gpu`
#     and the CUDA 12 / cuDNN 9 runtime wheels it links against, all from PyPI (~1.9 GB), so a GPU
#     node needs nothing but its driver. Its ORT_DYLIB_PATH replaces the CPU one, and
#     LD_LIBRARY_PATH names the CUDA libraries.
# Idempotent: a second run only re-checks what is there. Prints the asset paths as `export` lines.
# SLUICE_ASSETS=runtime fetches ONNX Runtime alone (the container images' build).
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
WHAT="${SLUICE_ASSETS:-all}"
MODEL_DIR="$CACHE/models/terrain-$TERRAIN_VERSION"
if [ "$WHAT" = all ] && [ ! -f "$MODEL_DIR/model.onnx" ] || ! check_sha "$MODEL_DIR/model.onnx" "$TERRAIN_ONNX_SHA256" 2>/dev/null; then
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
if [ "$WHAT" = all ] && { [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import onnx" 2>/dev/null; }; then
  log "creating $VENV with onnx==$ONNX_PY_VERSION"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet "onnx==$ONNX_PY_VERSION" "numpy==2.2.6"
fi

# The tiny random-weight Stable Diffusion models, made by scripts/sd-reference/generate.sh:
# integration-tests/fixtures/sd-tiny.tar.xz (sd-tiny, sd-tiny-lcm, sd-tiny-external) and
# sdxl-tiny.tar.xz (sdxl-tiny; generate.sh --sdxl) and inpaint-tiny.tar.xz (sd-tiny-inpaint, a
# 9-channel inpainting UNet; generate.sh --images) and flow-tiny.tar.xz (flux-schnell-tiny,
# flux-dev-tiny, sd3-tiny; generate.sh --flow), unpacked side by side into one directory (one
# SLUICE_MODEL_DIR serves them all) once per version of the four fixtures.
FIXTURES="$(cd "$(dirname "$0")/.." && pwd)/integration-tests/fixtures"
SD_SHA=$( [ "$WHAT" = all ] && cat "$FIXTURES/sd-tiny.tar.xz" "$FIXTURES/sdxl-tiny.tar.xz" "$FIXTURES/inpaint-tiny.tar.xz" "$FIXTURES/flow-tiny.tar.xz" | sha256sum | cut -c1-16 || echo none)
SD_DIR="$CACHE/models/sd-tiny-$SD_SHA"
if [ "$WHAT" = all ] && [ ! -f "$SD_DIR/sd3-tiny/transformer/model.onnx" ]; then
  rm -rf "$SD_DIR.partial" && mkdir -p "$SD_DIR.partial"
  tar -xJf "$FIXTURES/sd-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/sdxl-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/inpaint-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/flow-tiny.tar.xz" -C "$SD_DIR.partial"
  rm -rf "$SD_DIR" && mv "$SD_DIR.partial" "$SD_DIR"
fi

# The CUDA flavour.
if [ "${SLUICE_ORT_FLAVOUR:-cpu}" = cuda ]; then
  CUDA_DIR="$CACHE/ort/$ORT_VERSION-cuda"
  CUDA_WHEELS=(
    "onnxruntime-gpu==$ORT_VERSION onnxruntime_gpu-1.24.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl ac4bfc90c376516b13d709764ab257e4e3d78639bf6a2ccfc826e9db4a5c7ddf"
    "nvidia-cublas-cu12==12.9.3.13 nvidia_cublas_cu12-12.9.3.13-py3-none-manylinux_2_27_x86_64.whl d7d51055f161b317c7105ddaae90e71eda059026074ffef93cf7cde2886bfe72"
    "nvidia-cuda-nvrtc-cu12==12.9.86 nvidia_cuda_nvrtc_cu12-12.9.86-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4"
    "nvidia-cuda-runtime-cu12==12.9.79 nvidia_cuda_runtime_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3"
    "nvidia-cudnn-cu12==9.28.0.42 nvidia_cudnn_cu12-9.28.0.42-py3-none-manylinux_2_27_x86_64.whl 9ff58b7f36dacd0a93e89f8f2957b52466889217963701daa15e577317cfa375"
    "nvidia-cufft-cu12==11.4.1.4 nvidia_cufft_cu12-11.4.1.4-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl c67884f2a7d276b4b80eb56a79322a95df592ae5e765cf1243693365ccab4e28"
    "nvidia-curand-cu12==10.3.10.19 nvidia_curand_cu12-10.3.10.19-py3-none-manylinux_2_27_x86_64.whl 49b274db4780d421bd2ccd362e1415c13887c53c214f0d4b761752b8f9f6aa1e"
  )
  if [ ! -f "$CUDA_DIR/lib/libonnxruntime_providers_cuda.so" ]; then
    rm -rf "$CUDA_DIR.partial" && mkdir -p "$CUDA_DIR.partial/lib"
    for spec in "${CUDA_WHEELS[@]}"; do
      read -r req file sha <<<"$spec"
      fetch_wheel "$req" "$file" "$sha" --python-version 3.11 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_12_x86_64
      # Every shared library of the wheel, flat in one directory.
      "$PY" - "$CACHE/wheels/$file" "$CUDA_DIR.partial/lib" <<'PYEOF'
import os, re, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if re.search(r"\.so(\.\d+)*$", base) and "pybind11" not in base:
            with z.open(name) as src, open(os.path.join(sys.argv[2], base), "wb") as dst:
                shutil.copyfileobj(src, dst)
PYEOF
    done
    # Every library the CUDA provider needs resolves inside the flavour (the driver's
    # libcuda.so.1 is loaded at run time by the CUDA runtime, not linked).
    missing=$(LD_LIBRARY_PATH="$CUDA_DIR.partial/lib" ldd "$CUDA_DIR.partial/lib/libonnxruntime_providers_cuda.so" | grep "not found" || true)
    if [ -n "$missing" ]; then
      echo "the CUDA flavour is incomplete: $missing" >&2
      exit 1
    fi
    rm -rf "$CUDA_DIR" && mv "$CUDA_DIR.partial" "$CUDA_DIR"
  fi
  ORT_LIB="$CUDA_DIR/lib/libonnxruntime.so.$ORT_VERSION"
  echo "export LD_LIBRARY_PATH=$CUDA_DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
fi

echo "export ORT_DYLIB_PATH=$ORT_LIB"
[ "$WHAT" = all ] || exit 0
echo "export SLUICE_TERRAIN_MODEL=$MODEL_DIR/model.onnx"
echo "export SLUICE_ONNX_PYTHON=$VENV/bin/python"
echo "export SLUICE_SD_TINY=$SD_DIR"
