# The worker image, CPU or CUDA flavour (build from the repository root):
#   podman build -f deploy/docker/worker.Dockerfile -t sluice-worker:cpu .
#   podman build -f deploy/docker/worker.Dockerfile --build-arg ORT_FLAVOUR=cuda -t sluice-worker:cuda .
# ONNX Runtime comes from the pinned, checksummed PyPI wheels scripts/fetch-assets.sh fetches (the
# CUDA flavour with the CUDA / cuDNN 9 runtime libraries, so a GPU node needs only its driver).
# There is no driver to detect at build time: ORT_FLAVOUR=cuda is CUDA 12 (onnxruntime-gpu 1.24.1,
# drivers >= 525); ORT_FLAVOUR=cuda13 builds the CUDA 13 one (onnxruntime-gpu 1.31.1, >= 580).
# The model catalog and the models are mounted (SLUICE_MODEL_CATALOG, SLUICE_MODEL_DIR), not baked
# in. Runs as a non-root user with nothing to write but /tmp.
ARG RUST_IMAGE=docker.io/library/rust:1.95-slim-bookworm
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

# checkov:skip=CKV_DOCKER_7: the base images are the ARGs above, each a versioned tag
# checkov:skip=CKV_DOCKER_2: Kubernetes ignores HEALTHCHECK; the chart's probes call /healthz and /readyz, and the image carries no HTTP client to run one
FROM ${RUST_IMAGE} AS build
# Debian's packages are pinned by the base image's snapshot, not one by one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake perl pkg-config python3 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin sluice-worker \
    && cp target/release/sluice-worker /sluice-worker

FROM ${PYTHON_IMAGE} AS ort
ARG ORT_FLAVOUR=cpu
WORKDIR /src
COPY scripts/fetch-assets.sh scripts/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN flavour=${ORT_FLAVOUR} && if [ "$flavour" = cuda ]; then flavour=cuda12; fi \
    && SLUICE_CACHE=/cache SLUICE_ASSETS=runtime SLUICE_ORT_FLAVOUR=$flavour scripts/fetch-assets.sh > /cache.env \
    && . /cache.env \
    && mkdir -p /opt/ort \
    && cp "$ORT_DYLIB_PATH" /opt/ort/libonnxruntime.so \
    && IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}" \
    && for d in "${dirs[@]}"; do case "$d" in /cache/*) cp -a "$d"/. /opt/ort/ ;; esac; done

FROM ${RUNTIME_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libstdc++6 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=ort /opt/ort /opt/ort
COPY --from=build /sluice-worker /usr/local/bin/sluice-worker
ENV ORT_DYLIB_PATH=/opt/ort/libonnxruntime.so \
    LD_LIBRARY_PATH=/opt/ort \
    SLUICE_LISTEN=0.0.0.0:9090 \
    SLUICE_MODEL_DIR=/models \
    SLUICE_LOG_FORMAT=json
USER 65532:65532
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/sluice-worker"]
