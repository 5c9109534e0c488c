#!/usr/bin/env bash
# The test command. On a fresh Debian 12 machine it installs what the tests
# need (scripts/tools.sh), starts the local broker and S3 store, builds the workspace once
# (one profile: dev, dependencies at opt-level 1) and runs every test with
# nextest: unit tests, and end-to-end tests against the real broker and real
# LanceDB tables in temp dirs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${HOME:-/root}/.cache/steamrf/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
start=$(date +%s)

scripts/tools.sh
# NVRTC from PyPI: the CUDA kernels are compiled in the tests (no GPU needed),
# and a kernel that fails to compile fails CI.
export LD_LIBRARY_PATH="$PWD/.tools/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STEAMRF_REQUIRE_NVRTC=1
cleanup=()
trap 'for c in "${cleanup[@]}"; do $c >/dev/null 2>&1 || true; done' EXIT
if scripts/broker.sh status >/dev/null 2>&1; then
  echo "test: using the broker already on 127.0.0.1:${STEAMRF_BROKER_PORT:-9092}"
else
  scripts/broker.sh start
  cleanup+=("scripts/broker.sh stop")
fi
# The local S3 store (SeaweedFS) for the object-storage tests.
if scripts/s3.sh status >/dev/null 2>&1; then
  echo "test: using the S3 store already on 127.0.0.1:8333"
else
  scripts/s3.sh start
  cleanup+=("scripts/s3.sh stop")
fi

cargo fmt --all --check
t0=$(date +%s)
# The e2e tests run the steamrf binary, so build every target first.
cargo build --workspace --all-targets --locked
echo "test: build took $(( $(date +%s) - t0 ))s (target dir $CARGO_TARGET_DIR)"
t0=$(date +%s)
scripts/helm-check.sh "$CARGO_TARGET_DIR/debug/steamrf"
echo "test: helm chart checks took $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
scripts/fuzz.sh
echo "test: fuzzing took $(( $(date +%s) - t0 ))s"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
echo "test: total $(( $(date +%s) - start ))s"
