#!/usr/bin/env bash
# GPU check for the CUDA backend, on a machine with an NVIDIA GPU and only
# the built binaries (no Rust toolchain, no CUDA toolkit: the driver's
# libcuda and cuBLAS are loaded dynamically; NVRTC comes from .tools/cuda/lib
# or the system). Build on a CPU machine first:
#
#   scripts/tools.sh && cargo build --workspace --all-targets
#   kernels/gpu-check.sh --pack /tmp/gpu-check      # binaries + NVRTC + this script
#
# then copy /tmp/gpu-check to the GPU machine and run `./gpu-check.sh` there.
# It runs the CUDA parity tests (required to find a device) and the
# similarity benchmark in f32 and f16, and prints the figures (< 5 minutes).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

if [ "${1:-}" = "--pack" ]; then
  out="${2:?usage: kernels/gpu-check.sh --pack DIR}"
  target="${CARGO_TARGET_DIR:-$HOME/.cache/steamrf/target}/debug"
  mkdir -p "$out/lib"
  cp "$target/steamrf" "$out/"
  test_bin=$(ls -t "$target"/deps/steamrf_kernels-* | grep -v '\.d$' | head -n1)
  cp "$test_bin" "$out/kernels-tests"
  cp "$here/../.tools/cuda/lib/"* "$out/lib/"
  cp "$0" "$out/gpu-check.sh"
  echo "packed into $out ($(du -sh "$out" | cut -f1))"
  exit 0
fi

# cuBLAS: from the driver's CUDA installation, or a pip wheel on the machine.
for d in /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cublas/lib") for p in nvidia.__path__))' 2>/dev/null || true); do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH="$here/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== parity: CUDA backend vs the scalar reference (proptest), device required =="
STEAMRF_REQUIRE_GPU=1 STEAMRF_REQUIRE_NVRTC=1 timeout 180 "$here/kernels-tests" cuda:: --test-threads 1

echo "== bench: 1000 queries x 1,000,000 x 384, top-10 =="
for p in f32 f16; do
  timeout 120 "$here/steamrf" bench similarity --backend cuda --precision "$p" \
    --queries 1000 --corpus 1000000 --dim 384 --k 10
done
