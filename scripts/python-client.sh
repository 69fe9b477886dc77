#!/usr/bin/env bash
# The Python client (clients/python): a venv with its pinned build and test tools, the wheel
# built with the standard build tool and installed into that venv, mypy --strict and the unit
# tests. Idempotent: the venv is cached in ~/.cache/sluice/ under a hash of the pins.
#
#   scripts/python-client.sh check   build the wheel, type-check, run the unit tests (make test)
#   scripts/python-client.sh venv    build and install the wheel; print the venv's python
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${CACHE:-$HOME/.cache/sluice}
PKG=$ROOT/clients/python
PINS=$PKG/requirements-dev.txt
VENV=$CACHE/venv-client-$(sha256sum "$PINS" | cut -c1-12)

if [ ! -f "$VENV/.complete" ]; then
  echo "==> installing the Python client's build and test tools into $VENV (once per machine)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet -r "$PINS"
  touch "$VENV/.complete"
fi

# The wheel, from the sources as they are now (no build isolation: flit_core is pinned above).
rm -rf "$PKG/dist"
if ! out=$("$VENV/bin/python" -m build --wheel --no-isolation --outdir "$PKG/dist" "$PKG" 2>&1); then
  echo "$out" >&2
  exit 1
fi
WHEEL=$(ls "$PKG"/dist/sluice_client-*.whl)
"$VENV/bin/pip" install --quiet --force-reinstall --no-deps "$WHEEL"

case "${1:-check}" in
  venv)
    echo "$VENV/bin/python"
    ;;
  check)
    cd "$PKG"
    "$VENV/bin/mypy" --strict src examples tests
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not stack" tests
    # The oldest Python the package supports, where this machine has it.
    OLDEST=
    for candidate in "$HOME"/.pyenv/versions/3.10.*/bin/python3.10 /usr/bin/python3.10 /usr/local/bin/python3.10; do
      if [ -x "$candidate" ] && "$candidate" -c 'import venv' 2>/dev/null; then
        OLDEST=$candidate
      fi
    done
    if [ -n "$OLDEST" ]; then
      V310=$CACHE/venv-client310-$(sha256sum "$PINS" | cut -c1-12)
      if [ ! -f "$V310/.complete" ]; then
        rm -rf "$V310"
        "$OLDEST" -m venv "$V310"
        "$V310/bin/pip" install --quiet "$(grep '^httpx==' "$PINS")" "$(grep '^pytest==' "$PINS")"
        touch "$V310/.complete"
      fi
      "$V310/bin/pip" install --quiet --force-reinstall --no-deps "$WHEEL"
      "$V310/bin/python" -m pytest -q -p no:cacheprovider -m "not stack" tests
    else
      echo "python client: no python3.10 here; the unit tests ran on $("$VENV/bin/python" --version) only" >&2
    fi
    echo "python client: $(basename "$WHEEL") built, mypy --strict clean, unit tests passed" >&2
    ;;
  *)
    echo "usage: $0 check|venv" >&2
    exit 2
    ;;
esac
