#!/usr/bin/env bash
# Regenerates the Stable Diffusion test fixtures from the reference implementation (diffusers +
# Optimum's ONNX Runtime pipelines) on a tiny random-weight model that generate.py builds.
#
# A developer runs this once and commits the outputs; CI does NOT run it: the Python venv it needs
# is ~5 GB (PyPI's torch is the CUDA build, with its nvidia/triton wheels). CPU only, ~3 minutes on
# 2 cores (half of that is the rerun check), no network besides PyPI for the first install, no
# model hub (HF_HUB_OFFLINE=1).
#
# Writes (creating the directories):
#   integration-tests/fixtures/sd-tiny.tar.xz               sd-tiny/, sd-tiny-lcm/, sd-tiny-external/
#   integration-tests/fixtures/sd-reference/                cases.json, per-case .npy/.png, tokens.json,
#                                                           manifest.json, README.md
#   worker/src/models/diffusion/testdata/schedulers.json    scheduler timesteps/sigmas/traces
#
# With --sdxl it runs sdxl.py instead (the SDXL fixture, ~2.5 minutes with its rerun check) and writes
# only (SD 1.x outputs untouched):
#   integration-tests/fixtures/sdxl-tiny.tar.xz             sdxl-tiny/ (two text encoders, SDXL-shaped UNet)
#   integration-tests/fixtures/sdxl-reference/              cases.json, per-case .npy/.npz/.png, tokens.json,
#                                                           manifest.json, README.md
#
# With --images it runs images.py instead (img2img and inpainting references on sd-tiny, sdxl-tiny and a
# 9-channel inpainting model; needs the committed sd-tiny.tar.xz and sdxl-tiny.tar.xz) and writes only:
#   integration-tests/fixtures/inpaint-tiny.tar.xz          sd-tiny-inpaint/ (9-channel UNet, sd-tiny's other weights)
#   integration-tests/fixtures/image-reference/             inputs/*.png, cases.json, per-case .npy/.npz/.png,
#                                                           manifest.json, README.md
#
# With --flow it runs flow.py instead (tiny FLUX.1 schnell-/dev-like and SD3.5-like models with CLIP + T5 text
# encoders, a locally trained T5 SentencePiece tokenizer; ~2.5 minutes with its rerun check) and writes only:
#   integration-tests/fixtures/flow-tiny.tar.xz             flux-schnell-tiny/, flux-dev-tiny/, sd3-tiny/
#   integration-tests/fixtures/flow-reference/              cases.json, per-case .npy/.npz/.png, tokens.json,
#                                                           manifest.json, README.md
#
# The venv lives at ${SLUICE_CACHE:-$HOME/.cache/sluice}/venv-sd-reference and is reused: the install
# is skipped when a marker holds requirements.txt's sha256, or when `pip freeze` already has every pin.
#
# Usage: bash scripts/sd-reference/generate.sh [--sdxl | --images | --flow] [--no-rerun-check] [--work DIR]
#   --sdxl             run sdxl.py (SDXL fixture) instead of generate.py (SD 1.x fixtures)
#   --images           run images.py (img2img / inpainting fixture) instead of generate.py
#   --flow             run flow.py (FLUX / SD3 fixture) instead of generate.py
#   --no-rerun-check   skip the second, independent run that checks the outputs are reproducible
#   --work DIR         scratch directory (the exported models, unpacked tarball, rerun outputs), emptied
#                      at the start and kept afterwards (default: a temporary directory, removed at exit)
#   PYTHON=python3.11  interpreter used to create the venv (default: python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
venv="$cache/venv-sd-reference"
req="$here/requirements.txt"
marker="$venv/.sluice-requirements.sha256"

rerun=(--rerun-check)
script=generate.py
keep_work=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-rerun-check) rerun=() ;;
    --sdxl) script=sdxl.py ;;
    --images) script=images.py ;;
    --flow) script=flow.py ;;
    --work) [ $# -ge 2 ] || { echo "--work needs a directory" >&2; exit 2; }; keep_work="$2"; shift ;;
    -h|--help) sed -n '2,44p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

# Every pin in requirements.txt is in `pip freeze` (names compared case- and -/_-insensitively).
satisfied() {
  local freeze line
  freeze="$("$venv/bin/python" -m pip freeze 2>/dev/null | tr 'A-Z_' 'a-z-')" || return 1
  while IFS= read -r line; do
    line="${line%%#*}"
    line="$(printf '%s' "$line" | tr -d '[:space:]' | tr 'A-Z_' 'a-z-')"
    [ -z "$line" ] && continue
    grep -qxF -- "$line" <<<"$freeze" || return 1
  done <"$req"
}

want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$cache"
  "${PYTHON:-python3}" -m venv "$venv"
fi
if [ "$(cat "$marker" 2>/dev/null || true)" != "$want" ]; then
  if ! satisfied; then
    echo "installing $req into $venv (~5 GB)" >&2
    "$venv/bin/python" -m pip install --disable-pip-version-check -r "$req"
    satisfied || { echo "pip install did not produce the pinned versions of $req" >&2; exit 1; }
  fi
  printf '%s\n' "$want" >"$marker"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
if [ -n "$keep_work" ]; then
  # the scripts delete DIR first: refuse a non-empty directory that is not an earlier work directory
  if [ -d "$keep_work" ] && [ -n "$(ls -A "$keep_work")" ] && [ ! -d "$keep_work/tokenizer" ]; then
    echo "--work $keep_work: not empty and not an earlier work directory (no tokenizer/); refusing to delete it" >&2
    exit 2
  fi
  mkdir -p "$keep_work"
  workdir="$(cd "$keep_work" && pwd)"
else
  work="$(mktemp -d "${TMPDIR:-/tmp}/sd-reference.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  workdir="$work/work"
fi
"$venv/bin/python" "$here/$script" --out "$repo" --work "$workdir" "${rerun[@]}"
