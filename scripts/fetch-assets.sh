#!/usr/bin/env bash
# Fetches the runtime assets Sluice needs from PyPI into a cache outside the clone, once per
# machine, and verifies their checksums:
#   - libonnxruntime.so from the pinned `onnxruntime` wheel (ort's own download step needs a CDN
#     that is not reachable here, so the library comes from the registry instead);
#   - the pretrained one-step consistency UNet from `adaptive-terrain-diffusion`, served as model
#     `terrain`;
#   - a Python venv with the pinned `onnx` package, used to generate the small test models;
#   - the tiny Stable Diffusion test models (unpacked from integration-tests/fixtures);
#   - with SLUICE_ORT_FLAVOUR=cuda (or `make assets-cuda`), the CUDA flavour of ONNX Runtime
#     (`onnxruntime-gpu`) and the CUDA / cuDNN 9 runtime libraries it loads, for the CUDA major
#     the node's driver supports (nvidia-smi's "CUDA Version", else its driver version: >= 580
#     is CUDA 13, >= 525 CUDA 12; no driver is an error). SLUICE_ORT_FLAVOUR=cuda12 or cuda13
#     names the major instead (no driver needed, e.g. to fetch for another machine):
#       cuda12: onnxruntime-gpu 1.24.1 and the CUDA 12 wheels, ~1.9 GB from PyPI;
#       cuda13: onnxruntime-gpu 1.31.1 and the CUDA 13 wheels, ~1.4 GB. The CUDA 13 libraries
#         are reused where a Python on the node ($SLUICE_CUDA_PYTHON, else python3) has them in
#         its `nvidia` packages (torch cu130 ships them all; then only the 256 MB ORT wheel is
#         fetched), and only the missing ones are fetched.
#     Its ORT_DYLIB_PATH replaces the CPU one, and LD_LIBRARY_PATH names the flavour's ONNX
#     Runtime directory, then the fetched CUDA libraries, then the reused ones (never a copy of
#     the driver's libcuda.so.1: the driver's own is found after them). The flavour and major
#     chosen are logged on stderr.
# Idempotent: a second run only re-checks what is there. Prints the asset paths as `export` lines.
# SLUICE_ASSETS=runtime fetches ONNX Runtime alone (the container images' build); SLUICE_ASSETS=no-terrain
# everything but the pretrained terrain model (a GPU node without network: scripts/gpu/pack.sh).
set -euo pipefail

CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
ORT_VERSION=1.31.1
ORT_WHEEL=onnxruntime-1.31.1-cp311-cp311-manylinux_2_28_x86_64.whl
ORT_WHEEL_SHA256=5752bd508126ae7c49894d3b9d2e83f0c3d487319246d04c444b393308d7ad7f
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

die() { echo "fetch-assets.sh: $*" >&2; exit 1; }

# The ONNX Runtime flavour, settled before anything is fetched: CUDA_MAJOR is empty for the CPU.
CUDA_MAJOR=
case "${SLUICE_ORT_FLAVOUR:-cpu}" in
  cpu) ;;
  cuda12 | cuda13)
    CUDA_MAJOR=${SLUICE_ORT_FLAVOUR#cuda}
    log "ONNX Runtime flavour: CUDA $CUDA_MAJOR (SLUICE_ORT_FLAVOUR=$SLUICE_ORT_FLAVOUR)"
    ;;
  cuda)
    # The newest major the driver supports: nvidia-smi's header says "CUDA Version: 13.0";
    # failing that, the driver version (CUDA 13 needs >= 580, CUDA 12 >= 525).
    command -v nvidia-smi >/dev/null 2>&1 || die "SLUICE_ORT_FLAVOUR=cuda: no NVIDIA driver found" \
      "(nvidia-smi is not on PATH). Name the CUDA major instead: SLUICE_ORT_FLAVOUR=cuda12 (driver" \
      ">= 525) or SLUICE_ORT_FLAVOUR=cuda13 (driver >= 580)."
    smi=$(nvidia-smi 2>&1) || die "SLUICE_ORT_FLAVOUR=cuda: no working NVIDIA driver found, nvidia-smi" \
      "failed: $(head -n 3 <<<"$smi" | tr '\n' ' ')"
    smi_cuda=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\(\.[0-9][0-9]*\)*\).*/\1/p' <<<"$smi" | head -n 1)
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)
    if [ -n "$smi_cuda" ]; then
      major=${smi_cuda%%.*}
      if [ "$major" -ge 13 ]; then CUDA_MAJOR=13; elif [ "$major" -eq 12 ]; then CUDA_MAJOR=12; fi
    elif [[ "$driver" =~ ^[0-9]+ ]]; then
      major=${BASH_REMATCH[0]}
      if [ "$major" -ge 580 ]; then CUDA_MAJOR=13; elif [ "$major" -ge 525 ]; then CUDA_MAJOR=12; fi
    else
      die "SLUICE_ORT_FLAVOUR=cuda: nvidia-smi shows neither a CUDA version nor a driver version;" \
        "name the CUDA major instead: SLUICE_ORT_FLAVOUR=cuda12 or cuda13"
    fi
    [ -n "$CUDA_MAJOR" ] || die "SLUICE_ORT_FLAVOUR=cuda: the NVIDIA driver (${driver:-version unknown}," \
      "CUDA ${smi_cuda:-unknown}) is too old: the CUDA flavour needs CUDA 12 (driver >= 525) or 13 (>= 580)"
    log "ONNX Runtime flavour: CUDA $CUDA_MAJOR (SLUICE_ORT_FLAVOUR=cuda; driver ${driver:-version unknown}," \
      "CUDA Version ${smi_cuda:-not shown})"
    ;;
  *) die "SLUICE_ORT_FLAVOUR=$SLUICE_ORT_FLAVOUR: expected cpu, cuda, cuda12 or cuda13" ;;
esac

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
if [ "$WHAT" = all ] && { [ ! -f "$MODEL_DIR/model.onnx" ] || ! check_sha "$MODEL_DIR/model.onnx" "$TERRAIN_ONNX_SHA256" 2>/dev/null; }; then
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
if [ "$WHAT" != runtime ] && { [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import onnx" 2>/dev/null; }; then
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
SD_SHA=$( [ "$WHAT" != runtime ] && cat "$FIXTURES/sd-tiny.tar.xz" "$FIXTURES/sdxl-tiny.tar.xz" "$FIXTURES/inpaint-tiny.tar.xz" "$FIXTURES/flow-tiny.tar.xz" | sha256sum | cut -c1-16 || echo none)
SD_DIR="$CACHE/models/sd-tiny-$SD_SHA"
if [ "$WHAT" != runtime ] && [ ! -f "$SD_DIR/sd3-tiny/transformer/model.onnx" ]; then
  rm -rf "$SD_DIR.partial" && mkdir -p "$SD_DIR.partial"
  tar -xJf "$FIXTURES/sd-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/sdxl-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/inpaint-tiny.tar.xz" -C "$SD_DIR.partial"
  tar -xJf "$FIXTURES/flow-tiny.tar.xz" -C "$SD_DIR.partial"
  rm -rf "$SD_DIR" && mv "$SD_DIR.partial" "$SD_DIR"
fi

# The CUDA flavour. One entry per wheel: requirement, file, sha256, and the sonames of it that
# the CUDA provider needs, linked (ldd sees them) or dlopen'ed (cuDNN, cuFFT, nvrtc: checked by
# presence). The CUDA 13 set is the one torch 2.11 cu130 installs (CUDA 13.0, driver >= 580).
if [ -n "$CUDA_MAJOR" ]; then
  CUDNN_SONAMES=libcudnn.so.9,libcudnn_graph.so.9,libcudnn_ops.so.9,libcudnn_cnn.so.9,libcudnn_adv.so.9,libcudnn_heuristic.so.9,libcudnn_engines_precompiled.so.9,libcudnn_engines_runtime_compiled.so.9
  if [ "$CUDA_MAJOR" = 12 ]; then
    ORT_GPU_VERSION=1.24.1
    ORT_GPU_WHEEL=onnxruntime_gpu-1.24.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
    ORT_GPU_WHEEL_SHA256=ac4bfc90c376516b13d709764ab257e4e3d78639bf6a2ccfc826e9db4a5c7ddf
    CUDA_WHEELS=(
      "nvidia-cublas-cu12==12.9.3.13 nvidia_cublas_cu12-12.9.3.13-py3-none-manylinux_2_27_x86_64.whl d7d51055f161b317c7105ddaae90e71eda059026074ffef93cf7cde2886bfe72 libcublas.so.12,libcublasLt.so.12"
      "nvidia-cuda-nvrtc-cu12==12.9.86 nvidia_cuda_nvrtc_cu12-12.9.86-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4 libnvrtc.so.12,libnvrtc-builtins.so.12.*"
      "nvidia-cuda-runtime-cu12==12.9.79 nvidia_cuda_runtime_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3 libcudart.so.12"
      "nvidia-cudnn-cu12==9.28.0.42 nvidia_cudnn_cu12-9.28.0.42-py3-none-manylinux_2_27_x86_64.whl 9ff58b7f36dacd0a93e89f8f2957b52466889217963701daa15e577317cfa375 $CUDNN_SONAMES"
      "nvidia-cufft-cu12==11.4.1.4 nvidia_cufft_cu12-11.4.1.4-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl c67884f2a7d276b4b80eb56a79322a95df592ae5e765cf1243693365ccab4e28 libcufft.so.11"
      "nvidia-curand-cu12==10.3.10.19 nvidia_curand_cu12-10.3.10.19-py3-none-manylinux_2_27_x86_64.whl 49b274db4780d421bd2ccd362e1415c13887c53c214f0d4b761752b8f9f6aa1e libcurand.so.10"
    )
  else
    ORT_GPU_VERSION=1.31.1
    ORT_GPU_WHEEL=onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_28_x86_64.whl
    ORT_GPU_WHEEL_SHA256=e26c475fe361b2015f45b4b824bd13f0bb20204e59b62814e6f0acd5f3d491a6
    CUDA_WHEELS=(
      "nvidia-cublas==13.1.0.3 nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl ee8722c1f0145ab246bccb9e452153b5e0515fd094c3678df50b2a0888b8b171 libcublas.so.13,libcublasLt.so.13"
      "nvidia-cuda-nvrtc==13.0.88 nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575 libnvrtc.so.13,libnvrtc-builtins.so.13.*"
      "nvidia-cuda-runtime==13.0.96 nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548 libcudart.so.13"
      "nvidia-cudnn-cu13==9.19.0.56 nvidia_cudnn_cu13-9.19.0.56-py3-none-manylinux_2_27_x86_64.whl d20e1734305e9d68889a96e3f35094d733ff1f83932ebe462753973e53a572bf $CUDNN_SONAMES"
      "nvidia-cufft==12.0.0.61 nvidia_cufft-12.0.0.61-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 6c44f692dce8fd5ffd3e3df134b6cdb9c2f72d99cf40b62c32dde45eea9ddad3 libcufft.so.12"
      "nvidia-curand==10.4.0.35 nvidia_curand-10.4.0.35-py3-none-manylinux_2_27_x86_64.whl 1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc libcurand.so.10"
    )
  fi
  PLATFORMS=(--python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux_2_12_x86_64)

  unpack_libs() { # wheel dest: every shared library of the wheel, flat in one directory; never
    # a libcuda.so (the driver's own must be the one loaded)
    "$PY" - "$1" "$2" <<'PYEOF'
import os, re, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if re.search(r"\.so(\.\d+)*$", base) and "pybind11" not in base and not base.startswith("libcuda.so"):
            with z.open(name) as src, open(os.path.join(sys.argv[2], base), "wb") as dst:
                shutil.copyfileobj(src, dst)
PYEOF
  }

  # ONNX Runtime's CUDA flavour, in its own directory per version and CUDA major.
  ORT_GPU_DIR="$CACHE/ort/$ORT_GPU_VERSION-cuda$CUDA_MAJOR"
  if [ ! -f "$ORT_GPU_DIR/libonnxruntime_providers_cuda.so" ]; then
    fetch_wheel "onnxruntime-gpu==$ORT_GPU_VERSION" "$ORT_GPU_WHEEL" "$ORT_GPU_WHEEL_SHA256" "${PLATFORMS[@]}"
    rm -rf "$ORT_GPU_DIR.partial" && mkdir -p "$ORT_GPU_DIR.partial"
    unpack_libs "$CACHE/wheels/$ORT_GPU_WHEEL" "$ORT_GPU_DIR.partial"
    rm -rf "$ORT_GPU_DIR" && mv "$ORT_GPU_DIR.partial" "$ORT_GPU_DIR"
  fi

  # CUDA 13: the libraries a Python on the node already has (torch cu130's nvidia-* packages,
  # laid out as nvidia/cu13/lib or nvidia/<package>/lib), found by soname. A wheel's sonames are
  # reused only all from one directory, and never from a directory that a CUDA-12 (-cu12)
  # distribution installed (libcurand.so.10 is the soname of both majors).
  declare -A REUSED=()
  if [ "$CUDA_MAJOR" = 13 ]; then
    CUDA_PY="${SLUICE_CUDA_PYTHON:-python3}"
    if [ -n "${SLUICE_CUDA_PYTHON:-}" ] && ! command -v "$CUDA_PY" >/dev/null 2>&1; then
      die "SLUICE_CUDA_PYTHON=$SLUICE_CUDA_PYTHON: no such Python"
    fi
    wanted=()
    for spec in "${CUDA_WHEELS[@]}"; do
      read -r req _ _ sonames <<<"$spec"
      wanted+=("$req=$sonames")
    done
    found=
    if command -v "$CUDA_PY" >/dev/null 2>&1; then
      found=$("$CUDA_PY" - "$CUDA_MAJOR" "${wanted[@]}" 2>/dev/null <<'PYEOF'
import fnmatch, os, re, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
major = sys.argv[1]
foreign = set()  # directories a distribution for another CUDA major installed files into
try:
    from importlib import metadata
    for dist in metadata.distributions():
        m = re.match(r"nvidia[-_].*[-_]cu(\d+)$", (dist.metadata["Name"] or "").lower())
        if m and m.group(1) != major:
            for f in dist.files or []:
                foreign.add(os.path.realpath(os.path.dirname(str(dist.locate_file(f)))))
except Exception:
    pass
dirs = []
for root in sorted(set(os.path.realpath(p) for p in nvidia.__path__)):
    for d, sub, files in os.walk(root):
        if d[len(root):].count(os.sep) >= 3:
            sub[:] = []
        if d in foreign or any(f.startswith("libcuda.so") for f in files):
            continue
        if any(".so" in f for f in files):
            dirs.append((d, files))
for spec in sys.argv[2:]:
    req, sonames = spec.rsplit("=", 1)
    for d, files in dirs:
        if all(any(fnmatch.fnmatch(f, s) for f in files) for s in sonames.split(",")):
            print(req + "\t" + d)
            break
PYEOF
      ) || found=
    fi
    while IFS=$'\t' read -r req dir; do
      [ -n "$req" ] && REUSED[$req]=$dir
    done <<<"$found"
    hint=
    [ -n "${SLUICE_CUDA_PYTHON:-}" ] || hint=" (SLUICE_CUDA_PYTHON names another Python)"
    log "CUDA 13 libraries in $CUDA_PY's nvidia packages: those of ${#REUSED[@]} of the" \
      "${#CUDA_WHEELS[@]} wheels$hint"
  fi

  # The rest from the pinned wheels, each unpacked into its own directory.
  fetched=() reused=()
  for spec in "${CUDA_WHEELS[@]}"; do
    read -r req file sha sonames <<<"$spec"
    if [ -n "${REUSED[$req]:-}" ]; then
      log "reusing ${sonames//,/ } from ${REUSED[$req]} (not fetching $req)"
      [[ " ${reused[*]} " == *" ${REUSED[$req]} "* ]] || reused+=("${REUSED[$req]}")
      continue
    fi
    dir="$CACHE/cuda/$(cut -d- -f1,2 <<<"$file")"
    if [ ! -d "$dir" ]; then
      fetch_wheel "$req" "$file" "$sha" "${PLATFORMS[@]}"
      rm -rf "$dir.partial" && mkdir -p "$dir.partial"
      unpack_libs "$CACHE/wheels/$file" "$dir.partial"
      rm -rf "$dir" && mv "$dir.partial" "$dir"
    fi
    fetched+=("$dir")
  done
  # Fetched before reused: a wheel is fetched whole where the node lacked part of it, and its
  # libraries must win over any older ones beside the reused ones.
  dirs=("$ORT_GPU_DIR" "${fetched[@]}" "${reused[@]}")
  LIB_PATH=$(IFS=:; echo "${dirs[*]}")

  # Every library the CUDA provider links resolves (but libcuda.so.1, the driver's own, found
  # through the system's library path where there is a driver), and every one it dlopens is there
  # with its own dependencies.
  unresolved() { # library: its dependencies that resolve nowhere, libcuda.so.1 aside
    LD_LIBRARY_PATH="$LIB_PATH" ldd "$1" | grep "not found" | grep -v "^[[:space:]]*libcuda\.so\.1 " \
      | sed "s|^[[:space:]]*|$(basename "$1") needs |" || true
  }
  problems=$(unresolved "$ORT_GPU_DIR/libonnxruntime_providers_cuda.so")
  for spec in "${CUDA_WHEELS[@]}"; do
    read -r req _ _ sonames <<<"$spec"
    IFS=, read -ra patterns <<<"$sonames"
    for soname in "${patterns[@]}"; do
      found=
      for d in "${dirs[@]}"; do
        for f in "$d"/$soname; do # a pattern: libnvrtc-builtins.so.13.*
          [ -f "$f" ] && found=$f && break 2
        done
      done
      if [ -z "$found" ]; then
        problems+=$'\n'"$soname (from $req) is in none of $LIB_PATH"
      else
        problems+=$'\n'$(unresolved "$found")
      fi
    done
  done
  problems=$(grep -v '^[[:space:]]*$' <<<"$problems" || true)
  if [ -n "$problems" ]; then
    die "the CUDA $CUDA_MAJOR flavour is incomplete (a directory under $CACHE/cuda or $CACHE/ort" \
      "that lost files is fetched again once removed):"$'\n'"$problems"
  fi
  log "CUDA $CUDA_MAJOR flavour: onnxruntime-gpu $ORT_GPU_VERSION, ${#reused[@]} reused and" \
    "${#fetched[@]} fetched CUDA library directories"
  ORT_LIB="$ORT_GPU_DIR/libonnxruntime.so.$ORT_GPU_VERSION"
  echo "export LD_LIBRARY_PATH=$LIB_PATH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
fi

echo "export ORT_DYLIB_PATH=$ORT_LIB"
[ "$WHAT" = runtime ] && exit 0
[ "$WHAT" = all ] && echo "export SLUICE_TERRAIN_MODEL=$MODEL_DIR/model.onnx"
echo "export SLUICE_ONNX_PYTHON=$VENV/bin/python"
echo "export SLUICE_SD_TINY=$SD_DIR"
