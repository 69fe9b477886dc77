#!/usr/bin/env bash
# The alert rules' unit tests on Prometheus's own rule engine: `promtool check rules` and
# `promtool test rules` (promtool from Debian's prometheus package, fetched by install-tools.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/install-tools.sh" prometheus
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
promtool="$(find "$CACHE/tools" -mindepth 4 -maxdepth 4 -path "$CACHE/tools/prometheus-*/usr/bin/promtool" | sort | head -1)"
cd "$here/../helm/sluice"
"$promtool" check rules files/alerts.yaml
"$promtool" test rules tests/alerts.test.yaml
