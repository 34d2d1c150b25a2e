#!/usr/bin/env bash
# Repeated code: jscpd (pinned in tools/jscpd/package.json, installed there with npm the first
# time) over the workspace's Rust sources and tests. A clone is a run of at least 6 lines and 70 tokens
# found again elsewhere; the check fails when cloned lines exceed THRESHOLD percent of all lines.
# The threshold is today's level after merging the real repetitions: lower it when you merge
# more, never raise it to let a copy in. `--list` prints every clone.
set -euo pipefail
cd "$(dirname "$0")/.."

THRESHOLD=0.45

command -v npm >/dev/null || { echo "error: npm not found (Debian: apt-get install nodejs npm)" >&2; exit 1; }
jscpd=tools/jscpd/node_modules/.bin/jscpd
if [ ! -x "$jscpd" ]; then
  echo "installing jscpd (tools/jscpd)"
  npm install --prefix tools/jscpd --no-audit --no-fund --silent >/dev/null
fi
reporters=consoleFull
[ "${1:-}" = "--list" ] || reporters=console
"$jscpd" --format rust --min-lines 6 --min-tokens 70 --threshold "$THRESHOLD" \
  --reporters "$reporters" --ignore "**/target/**" \
  merak-burn launch models examples benches tests
