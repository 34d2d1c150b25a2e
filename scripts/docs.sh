#!/usr/bin/env bash
# Builds the book (docs/) into docs/book/ with mdBook, pinned to one version: the `mdbook` on
# PATH when it is that version, otherwise exactly that version installed with
# `cargo install --locked` (into ~/.cargo/bin; about 2.5 minutes on 2 cores, once). Fails when
# mdBook warns (a broken HTML tag, an unused footnote, ...). The links are checked by
# `cargo test -p merak-launch --test docs_links`.
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4

mdbook_version() { "$1" --version 2>/dev/null | awk '{print $2}'; }

MDBOOK=""
for candidate in "$(command -v mdbook || true)" "${CARGO_HOME:-$HOME/.cargo}/bin/mdbook"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && [ "$(mdbook_version "$candidate")" = "v$MDBOOK_VERSION" ]; then
    MDBOOK="$candidate"
    break
  fi
done
if [ -z "$MDBOOK" ]; then
  command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
  echo "installing mdbook $MDBOOK_VERSION (cargo install --locked)"
  cargo install mdbook --version "$MDBOOK_VERSION" --locked
  MDBOOK="${CARGO_HOME:-$HOME/.cargo}/bin/mdbook"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# mdBook logs to stderr; keep its output and fail on any warning or error it reports.
if ! "$MDBOOK" build docs >"$log" 2>&1; then
  cat "$log" >&2
  echo "error: mdbook build failed" >&2
  exit 1
fi
cat "$log"
if grep -E '(WARN|ERROR)' "$log" >/dev/null; then
  echo "error: mdbook reported warnings (above); fix them" >&2
  exit 1
fi
echo "book: docs/book/index.html"
