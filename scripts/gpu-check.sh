#!/usr/bin/env bash
# `make gpu-check`: the CUDA path on a GPU node, in one call. Needs only the NVIDIA driver: the
# CUDA flavour of ONNX Runtime and its CUDA/cuDNN libraries come from PyPI (fetch-assets.sh).
#   1. the tiny SD model on the CUDA execution provider (required, no CPU fallback) reproduces
#      the diffusers reference case `euler` within 1e-2 (GPU kernels round differently);
#   2. the end-to-end suites (terrain and SD over Kafka and S3) with every worker on CUDA, and
#      the SD memory suite with the cap as `gpu_mem_limit`: a batch that does not fit halves
#      and completes on a real CUDA OOM, what fits alone completes (the clean-arena retry
#      rebuilds the sessions, and with them their CUDA arenas), a restarted worker starts from
#      the ceilings it kept (device class `cuda:memory=…:gpu_mem_limit=…`), 20 reloads bring
#      free device memory back to baseline;
#   3. `sluice-bench adaptive-sd` on the CUDA arena (the cap as `gpu_mem_limit`): adaptive
#      batching against each fixed batch size, tasks failed, OOMs handled, restarted.
# Written without a GPU to run it on (none was lent to the session that wrote it): treat a
# failure here as this script's bug until proven otherwise.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
eval "$(SLUICE_ORT_FLAVOUR=cuda "$here/fetch-assets.sh")"
export ORT_DYLIB_PATH LD_LIBRARY_PATH
BIN="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}/release"
case_dir="$root/integration-tests/fixtures/sd-reference/euler"
out="$(mktemp -d)"
"$BIN/sluice-worker" generate --model-path "$SLUICE_SD_TINY/sd-tiny" \
  --prompt "a photo of an astronaut riding a horse on mars" --negative-prompt "blurry, low quality" \
  --steps 4 --guidance-scale 7.5 --sampler euler --latents-in "$case_dir/latents_in.npy" \
  --out "$out/x.png" --latents-out "$out/x.npy" --device cuda --require-gpu
"$SLUICE_ONNX_PYTHON" - "$out/x.npy" "$case_dir/expected_latents.npy" <<'PYEOF'
import sys, numpy as np
got, want = np.load(sys.argv[1]), np.load(sys.argv[2])
err = float(np.abs(got - want).max())
print(f"CUDA vs diffusers (CPU) final latents: max |d| {err:.2e}")
sys.exit(0 if err <= 1e-2 else 1)
PYEOF
SLUICE_DEVICE=cuda SLUICE_REQUIRE_GPU=true cargo test --release --locked -p sluice-integration-tests --test e2e --test sd --test sd_memory
SLUICE_DEVICE=cuda "$BIN/sluice-bench" adaptive-sd
