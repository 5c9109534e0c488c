#!/usr/bin/env bash
# docs/results.md's dev-vs-release table: runs the ingest, embed, retrieve and
# similarity benches with the dev binary and the release binary (the one the
# Dockerfile ships), alternating them, each ingest run on a freshly restarted
# broker (Tansu keeps every topic in memory). Prints every RESULT line and
# keeps the full output in results/bench-profiles.log.
#   scripts/bench-profiles.sh                 build both profiles first
#   scripts/bench-profiles.sh DEV RELEASE     use these two binaries
# Needs the sentence-transformers reference venv for `bench embed`
# (scripts/st-reference.sh creates it on first use, about 6 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${HOME:-/root}/.cache/steamrf/target}"
scripts/tools.sh
if [ $# -eq 2 ]; then
  dev=$1; release=$2
else
  cargo build --locked --bin steamrf
  cargo build --release --locked --bin steamrf
  dev="$CARGO_TARGET_DIR/debug/steamrf"; release="$CARGO_TARGET_DIR/release/steamrf"
fi
mkdir -p results
log=results/bench-profiles.log
: > "$log"
benches=("bench ingest --events 1000000" "bench embed" "bench retrieve --memories 10000" "bench similarity")
for b in "${benches[@]}"; do
  for bin in "$dev" "$release"; do
    if [[ $b == "bench ingest"* ]]; then
      scripts/broker.sh stop >/dev/null 2>&1 || true
      scripts/broker.sh start >/dev/null
    fi
    echo "== $bin $b" | tee -a "$log"
    # shellcheck disable=SC2086 # the bench's words
    "$bin" $b 2>&1 | tee -a "$log" | tail -n 1
  done
done
