#!/usr/bin/env bash
# Lints and renders the Helm chart offline (no helm binary is installable here: the Helm SDK comes
# from PyPI), then validates the rendered manifests against the Kubernetes schemas.
set -euo pipefail
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
VENV="$CACHE/venv-helm-0.2.2"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import helm_python" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet helm-python-sdk==0.2.2
fi
chart="$(cd "$(dirname "$0")/../helm/sluice" && pwd)"
"$VENV/bin/python" - "$chart" <<'PY'
import sys, helm_python
chart = sys.argv[1]
report = helm_python.lint(chart, strict=True, kube_version="v1.30.0")
bad = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report.get("errors", [])]
for m in report["messages"]:
    print(f"lint: {m}")
if bad:
    sys.exit(f"helm lint found {len(bad)} problem(s)")
rendered = helm_python.Chart.load(chart).render(name="sluice", namespace="sluice", is_install=True)
print(f"rendered {len(rendered)} template(s): {sorted(rendered)}")
PY
