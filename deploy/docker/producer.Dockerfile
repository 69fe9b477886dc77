# The producer image (build from the repository root):
#   podman build -f deploy/docker/producer.Dockerfile -t sluice-producer .
# Runs `sluice-producer serve` as a non-root user; its only writable path is the status view's
# directory (SLUICE_STATUS_PATH, an emptyDir or a volume in Kubernetes). The model catalog is
# mounted (SLUICE_MODEL_CATALOG).
ARG RUST_IMAGE=docker.io/library/rust:1.95-slim-bookworm
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
RUN cargo build --release --locked --bin sluice-producer \
    && cp target/release/sluice-producer /sluice-producer

FROM ${RUNTIME_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/sluice/status \
    && chown 65532:65532 /var/lib/sluice/status
COPY --from=build /sluice-producer /usr/local/bin/sluice-producer
ENV SLUICE_LISTEN=0.0.0.0:8080 \
    SLUICE_STATUS_PATH=/var/lib/sluice/status/view.redb \
    SLUICE_LOG_FORMAT=json
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/sluice-producer"]
CMD ["serve"]
