#!/usr/bin/env bash
# `make gpu-check`: the CUDA path on a GPU node, in one call. Needs the NVIDIA driver; ONNX
# Runtime's CUDA flavour comes from fetch-assets.sh (SLUICE_ORT_FLAVOUR=cuda: the CUDA major from
# the driver, the CUDA libraries of the node's Python reused where they are there).
#   1. numerics: the reference cases of SD 1.x, SDXL, FLUX.1-dev and SD3 on CUDA against
#      diffusers' CPU latents, under each CUDA numerics setting (scripts/gpu/numerics.py states
#      the tolerance per family and setting, and fails past it);
#   2. tests: integration suites with every worker they start on CUDA (the device settings reach
#      each worker, which is made to require the GPU, and the harness checks every model it
#      loaded sits on the device asked for): memory under a capped CUDA arena (OOMs halve
#      batches, ceilings kept across a restart), 20 reloads of each family with free device
#      memory back to baseline (NVML), a leaking reload stopping the worker, cancellation;
#   3. adaptive: `sluice-bench adaptive-sd` on the CUDA arena;
#   4. sched: `sluice-bench sched`, step-level against request-level scheduling under the mixed
#      load (on the CPU a step of the tiny models is milliseconds and the worker's own CPU work
#      competes with the model's; on a GPU a step is the device's, which is what the goals are
#      about). Not a default step: SLUICE_GPU_CHECK_STEPS="... sched" (about 5 minutes).
# SLUICE_GPU_CHECK_DEVICE=cpu rehearses the same steps on the CPU (the check's own wiring: the
# settings reaching the workers, the harness's device check, the scripts). SLUICE_GPU_CHECK_STEPS
# picks steps ("numerics tests adaptive"); SLUICE_GPU_CHECK_TESTS the suites, as `test:filter`
# words. Without cargo (a node with no Rust toolchain) the test executables come from
# SLUICE_TEST_BIN_DIR and the binaries from SLUICE_BIN_DIR (scripts/gpu/pack.sh makes both).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
device="${SLUICE_GPU_CHECK_DEVICE:-cuda}"
out="${SLUICE_GPU_CHECK_OUT:-$(mktemp -d)}"
case "$device" in
  cuda)
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    export SLUICE_ORT_FLAVOUR="${SLUICE_ORT_FLAVOUR:-cuda}" SLUICE_REQUIRE_GPU=true
    default_tests="memory:diffusion:: memory:a_reload_that_leaks e2e:cancelled_tasks"
    ;;
  cpu)
    export SLUICE_ORT_FLAVOUR=cpu
    default_tests="memory:a_reload_that_leaks e2e:cancelled_tasks memory:twenty_reloads_of_the_sd_model"
    ;;
  *) echo "SLUICE_GPU_CHECK_DEVICE: cuda or cpu, not $device" >&2; exit 2 ;;
esac
eval "$("$root/scripts/fetch-assets.sh")"
export ORT_DYLIB_PATH SLUICE_SD_TINY SLUICE_ONNX_PYTHON SLUICE_DEVICE="$device"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
BIN="${SLUICE_BIN_DIR:-${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}/release}"
steps="${SLUICE_GPU_CHECK_STEPS:-numerics tests adaptive}"
cd "$root"

if [[ " $steps " == *" numerics "* ]]; then
  echo "== numerics ($device)"
  "${SLUICE_GPU_CHECK_PYTHON:-$SLUICE_ONNX_PYTHON}" "$here/numerics.py" "$BIN/sluice-worker" \
    "$root/integration-tests/fixtures" "$SLUICE_SD_TINY" "$out/numerics"
fi

if [[ " $steps " == *" tests "* ]]; then
  for spec in ${SLUICE_GPU_CHECK_TESTS:-$default_tests}; do
    name="${spec%%:*}" filter="${spec#*:}"
    echo "== tests: $name ${filter:+($filter)} ($device)"
    if [ -n "${SLUICE_TEST_BIN_DIR:-}" ]; then
      "$SLUICE_TEST_BIN_DIR/$name" ${filter:+"$filter"} --nocapture
    else
      cargo test --release --locked -p sluice-integration-tests --test "$name" -- ${filter:+"$filter"} --nocapture
    fi
  done
fi

if [[ " $steps " == *" adaptive "* ]]; then
  echo "== sluice-bench adaptive-sd ($device)"
  "$BIN/sluice-bench" adaptive-sd
fi

if [[ " $steps " == *" sched "* ]]; then
  echo "== sluice-bench sched ($device)"
  SLUICE_BENCH_SCHED_ROUNDS="${SLUICE_BENCH_SCHED_ROUNDS:-1}" "$BIN/sluice-bench" sched | tee "$out/sched.md"
fi
