#!/usr/bin/env bash
# `make demo` as it runs on a new machine: a fresh clone of this repository at REV (default HEAD),
# with HOME and CARGO_HOME new, empty directories, so nothing is cached (crates.io's index and
# crates, pip's and Maven's downloads, ~/.cache/sluice). Prints the total and when each phase
# ended, and keeps Cargo's timing report of Sluice's build (`cargo build --timings`).
#   scripts/bench/cold-demo.sh [REV]      needs ~8 GB free under ${TMPDIR:-/tmp}
# Figures it made: docs/benchmarks.md, "Cold `make demo`". Run it on an idle machine; the cold
# build is what it measures, and anything else on the cores shows in it.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
rev="${1:-HEAD}"
work="$(mktemp -d "${TMPDIR:-/tmp}/sluice-cold-demo.XXXXXX")"
# The toolchains stay where they are installed; only the caches move to the new HOME.
export RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}" PYENV_ROOT="${PYENV_ROOT:-$HOME/.pyenv}"
export HOME="$work/home" CARGO_HOME="$work/home/.cargo"
unset CARGO_TARGET_DIR PIP_CACHE_DIR SLUICE_CACHE
mkdir -p "$HOME"

git clone -q "$repo" "$work/src"
git -C "$work/src" checkout -q "$rev"

# A cargo that adds --timings to `cargo build` (the S3 server's `cargo install` goes to the real one).
cat >"$work/cargo" <<'EOF'
#!/usr/bin/env bash
if [ "$1" = build ]; then shift; exec cargo build --timings "$@"; fi
exec cargo "$@"
EOF
chmod +x "$work/cargo"

log="$work/demo.log"
start=$(date +%s)
set +e
(cd "$work/src" && make demo CARGO="$work/cargo") 2>&1 |
  perl -MTime::HiRes=time -ne 'BEGIN { $s = time; $| = 1 } printf "%7.1f %s", time - $s, $_' >"$log"
rc=${PIPESTATUS[0]}
set -e
total=$(($(date +%s) - start))
(cd "$work/src" && make stack-down >/dev/null 2>&1) || true

echo "cold make demo at $(git -C "$work/src" rev-parse --short HEAD): rc $rc, $total s (log: $log)"
grep -E 'Finished .release.|Installed package|==> (fetching|stack up)|tasks done' "$log" || true
for report in "$HOME"/.cache/sluice/target/cargo-timings/cargo-timing-2*.html; do
  [ -f "$report" ] || continue
  # Sluice's build: its wall time and the sum of its units' times (sum ≈ 2 × wall: both cores busy).
  python3 - "$report" <<'PY'
import json, re, sys
page = open(sys.argv[1]).read()
units = json.loads(re.search(r"const UNIT_DATA = (\[.*?\]);\n", page, re.S).group(1))
wall = max(u["start"] + u["duration"] for u in units)
print(f"Sluice's build: {wall:.0f} s wall, {sum(u['duration'] for u in units):.0f} s of units ({sys.argv[1]})")
for u in sorted(units, key=lambda u: -u["duration"])[:5]:
    print(f"  {u['duration']:6.1f} s  {u['name']} {u['target'].strip()}")
PY
done
echo "remove $work when done with it"
exit "$rc"
