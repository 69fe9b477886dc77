#!/usr/bin/env bash
# `make gpu-bench`: Sluice on a real-size model on a GPU node, in one call of under ten minutes.
#   1. The SD-1.5-shaped random-weight model: its graphs (text encoder, UNet, VAE decoder in the
#      Optimum layout, committed as integration-tests/fixtures/sd15-skeleton.tar.xz by
#      scripts/gpu/sd15_skeleton.py) get seeded random weights of the exported statistics
#      (scripts/gpu/materialize.py, numpy only: ~4 GB written in seconds).
#   2. `sluice-bench pipeline model`: for each size and batch, raw in-process ONNX Runtime images/s
#      on the workers' device and settings, against the same tasks end to end through Kafka and S3
#      (one worker), with the GPU's busy share during each.
#   3. The share of the physical limit: images/s × FLOPs per image (computed from the graphs,
#      scripts/gpu/flops.json) against the GPU's peak.
#   4. `sluice-bench reloads`: free device memory after each of five reloads of the 3.4 GB UNet
#      model, and a worker whose loads leak a copy stopped by the reload bound.
#   5. sched (not a default step): `sluice-bench sched` with the SD-1.5-shaped model's 512²,
#      20-step tasks (its UNet given a timestep per row) as the long background and sd-tiny's short and interactive tasks between
#      them: step-level against request-level scheduling where a step is tens of milliseconds of
#      the device's, with one engine slot, two, and two and an interactive one
#      (SLUICE_BENCH_SCHED_* apply; one round by default).
# Settings: SLUICE_GPU_BENCH_ROWS (size:steps:batch, comma-separated; default
# 512:20:1,512:20:4,512:50:1,1024:20:1,1024:20:4), _TASKS (tasks per row at 512², fewer for larger
# images; default 16), _RELOADS (5), _STEPS ("pipeline reloads", or with "sched"). The worker's CUDA settings
# (SLUICE_CUDA_TF32, …) apply to both columns.
# SLUICE_GPU_BENCH_DEVICE=cpu rehearses the whole script on the CPU (use small sizes and steps).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
device="${SLUICE_GPU_BENCH_DEVICE:-cuda}"
work="${SLUICE_GPU_BENCH_WORK:-/tmp/sluice-gpu-bench}"
out="${SLUICE_GPU_BENCH_OUT:-$work/out}"
mkdir -p "$work/models" "$out"
case "$device" in
  cuda)
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    export SLUICE_ORT_FLAVOUR="${SLUICE_ORT_FLAVOUR:-cuda}" SLUICE_REQUIRE_GPU=true
    ;;
  cpu) export SLUICE_ORT_FLAVOUR=cpu ;;
  *) echo "SLUICE_GPU_BENCH_DEVICE: cuda or cpu, not $device" >&2; exit 2 ;;
esac
eval "$("$root/scripts/fetch-assets.sh")"
export ORT_DYLIB_PATH SLUICE_ONNX_PYTHON SLUICE_DEVICE="$device"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" SLUICE_SD_TINY
BIN="${SLUICE_BIN_DIR:-${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}/release}"
PY="${SLUICE_GPU_BENCH_PYTHON:-$SLUICE_ONNX_PYTHON}"

if [ ! -f "$work/models/sd15/.complete" ]; then
  rm -rf "$work/models/sd15"
  "$PY" "$here/materialize.py" "$root/integration-tests/fixtures/sd15-skeleton.tar.xz" "$work/models/sd15"
  touch "$work/models/sd15/.complete"
fi
cat >"$work/catalog.toml" <<'TOML'
[[model]]
name = "sd15"
kind = "stable-diffusion"
width = { min = 64, max = 1024, default = 512 }
height = { min = 64, max = 1024, default = 512 }
size_multiple = 64
steps = { min = 1, max = 50, default = 20 }
guidance_scale = { min = 0.0, max = 20.0, default = 7.5 }
samplers = ["euler"]
default_sampler = "euler"
max_num_images = 4
max_prompt_chars = 2000
max_ttl_seconds = 86400
TOML

export SLUICE_BENCH_MODEL=sd15 SLUICE_BENCH_MODEL_DIR="$work/models" SLUICE_BENCH_CATALOG="$work/catalog.toml"
export SLUICE_BENCH_ROWS="${SLUICE_GPU_BENCH_ROWS:-512:20:1,512:20:4,512:50:1,1024:20:1,1024:20:4}"
export SLUICE_BENCH_TASKS="${SLUICE_GPU_BENCH_TASKS:-16}" SLUICE_BENCH_RELOADS="${SLUICE_GPU_BENCH_RELOADS:-5}"
steps="${SLUICE_GPU_BENCH_STEPS:-pipeline reloads}"
if [[ " $steps " == *" pipeline "* ]]; then
  (cd "$root" && "$BIN/sluice-bench" pipeline model) | tee "$out/pipeline.md"
  "$PY" "$here/limits.py" "$here/flops.json" "$out/pipeline.md" | tee "$out/limits.md"
fi
if [[ " $steps " == *" reloads "* ]]; then
  (cd "$root" && "$BIN/sluice-bench" reloads) | tee "$out/reloads.md"
fi
if [[ " $steps " == *" sched "* ]]; then
  # Rows at different steps in one UNet call (numerically the same model: integration-tests/tests/reference/sd.rs).
  "$PY" "$root/scripts/unet_timestep_rows.py" "$work/models/sd15"
  # The demo catalog's sd-tiny beside sd15, which the sched catalog names by its absolute path.
  sed "s|^name = \"sd15\"|&\npath = \"$work/models/sd15\"|" "$work/catalog.toml" >"$work/sched-catalog.toml"
  (cd "$root" && SLUICE_BENCH_SCHED_CATALOG="$work/sched-catalog.toml" SLUICE_BENCH_SCHED_LONG=sd15 \
    SLUICE_BENCH_SCHED_LONG_SIZE="${SLUICE_BENCH_SCHED_LONG_SIZE:-512}" \
    SLUICE_BENCH_SCHED_MODES="${SLUICE_BENCH_SCHED_MODES:-request,step,step-2,step-2-kept}" \
    SLUICE_BENCH_SCHED_ROUNDS="${SLUICE_BENCH_SCHED_ROUNDS:-1}" "$BIN/sluice-bench" sched) | tee "$out/sched.md"
fi
