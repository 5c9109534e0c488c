#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets: the event decoder, the HTTP
# request bodies) for a bounded time each, starting from the committed seeds
# (fuzz/corpus; what a run finds stays in a temp dir). A crash fails the
# script and leaves the input under fuzz/artifacts/.
#   STEAMRF_FUZZ_SECONDS  seconds per target (default 20)
# Needs a nightly toolchain (sanitizer coverage) and cargo-fuzz (installed
# into .tools/bin from crates.io on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
SECONDS_PER_TARGET="${STEAMRF_FUZZ_SECONDS:-20}"
export PATH="$TOOLS/bin:$PATH"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzz: no nightly toolchain (rustup toolchain install nightly); fuzzing needs it" >&2
  exit 1
fi
if ! cargo-fuzz --version 2>/dev/null | grep -q "0.13.2"; then
  echo "fuzz: installing cargo-fuzz 0.13.2"
  cargo install -q cargo-fuzz --version 0.13.2 --locked --root "$TOOLS"
fi
target_dir="${HOME:-/root}/.cache/steamrf/fuzz-target"
cargo +nightly fuzz build -O --target-dir "$target_dir"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for t in $(cargo +nightly fuzz list); do
  mkdir -p "$work/$t"; cp fuzz/corpus/"$t"/* "$work/$t/"
  cargo +nightly fuzz run -O --target-dir "$target_dir" "$t" "$work/$t" -- \
    -max_total_time="$SECONDS_PER_TARGET" -max_len=8192 -print_final_stats=1 2>"$work/$t.log" \
    || { tail -40 "$work/$t.log" >&2; echo "fuzz: $t failed" >&2; exit 1; }
  runs=$(grep -o 'Done [0-9]* runs' "$work/$t.log" | grep -o '[0-9]*' || echo "?")
  echo "fuzz: $t: $runs inputs in ${SECONDS_PER_TARGET}s, no crash"
done
