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
# The venv lives at ${SLUICE_CACHE:-$HOME/.cache/sluice}/venv-sd-reference and is reused: the install
# is skipped when a marker holds requirements.txt's sha256, or when `pip freeze` already has every pin.
#
# Usage: bash scripts/sd-reference/generate.sh [--no-rerun-check]
#   --no-rerun-check   skip the second, independent run that checks the outputs are reproducible
#   PYTHON=python3.11  interpreter used to create the venv (default: python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
venv="$cache/venv-sd-reference"
req="$here/requirements.txt"
marker="$venv/.sluice-requirements.sha256"

rerun=(--rerun-check)
for arg in "$@"; do
  case "$arg" in
    --no-rerun-check) rerun=() ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
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
work="$(mktemp -d "${TMPDIR:-/tmp}/sd-reference.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" "$here/generate.py" --out "$repo" --work "$work/work" "${rerun[@]}"
