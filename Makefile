# Sluice. Two commands matter on a fresh machine:
#   make demo   sets everything up and runs the main job end to end on the local stack
#   make test   passes the test suite (what CI runs)
# Slow builds (the broker, the S3 server, Cargo's target directory) live in ~/.cache/sluice, so a
# fresh clone on the same machine reuses them.

SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/sluice
export CARGO_TARGET_DIR ?= $(CACHE)/target
CARGO ?= cargo
BIN := $(CARGO_TARGET_DIR)/release
STACK ?= .stack


.PHONY: assets-cuda gpu-check gpu-bench gpu-pack alerts-test images python-client
.PHONY: help setup tools stack-tools assets build demo demo-bins test unit-test integration-test chaos fuzz bench stack-up stack-down stack-status lint fmt helm-lint clean

help:
	@echo "make demo        set up and run the pipeline end to end on the local stack"
	@echo "make test        unit and end-to-end tests (CI runs this)"
	@echo "make fuzz        the fuzz targets, 5,000,000 executions each (make test runs 100,000)"
	@echo "make bench       benchmarks, printed as tables"
	@echo "make chaos       the full chaos suite (longer than the variant in make test)"
	@echo "make stack-up    start the broker and the S3 server; settings in $(STACK)/env"
	@echo "make stack-down  stop them"
	@echo "make lint        rustfmt, clippy, hadolint, ruff and shellcheck"
	@echo "make assets-cuda ONNX Runtime's CUDA flavour for the driver's CUDA 12 or 13, with its libraries (PyPI)"
	@echo "make gpu-check   the CUDA path on a GPU node (SLUICE_GPU_CHECK_DEVICE=cpu rehearses it here)"
	@echo "make gpu-bench   an SD-1.5-shaped model on a GPU node: raw vs end to end, GPU busy, share of peak"
	@echo "make gpu-pack    what a GPU node without Rust, Java or network needs for the two above"
	@echo "make images      build the container images (buildah; local Debian bases) and run them once"

# The tools' builds and downloads run beside the build of Sluice, as for the demo below.
setup:
	@$(MAKE) --no-print-directory -j3 tools assets build

tools:
	scripts/install-tools.sh all

# The broker and the S3 server only: what the demo and the local stack need.
stack-tools:
	scripts/install-tools.sh stack

assets:
	@scripts/fetch-assets.sh >/dev/null

# ONNX Runtime's CUDA flavour and the CUDA/cuDNN libraries it needs, from PyPI, for the CUDA major
# the driver supports (driver >= 580: CUDA 13, ~1.4 GB, or only the 256 MB ONNX Runtime wheel
# where the node's Python (SLUICE_CUDA_PYTHON) has torch's CUDA 13 libraries; >= 525: CUDA 12,
# ~1.9 GB). SLUICE_ORT_FLAVOUR=cuda12 / cuda13 names the major instead (no driver needed); it
# passes through: `make assets-cuda SLUICE_ORT_FLAVOUR=cuda13`.
assets-cuda:
	@SLUICE_ORT_FLAVOUR=$(or $(filter cuda12 cuda13,$(SLUICE_ORT_FLAVOUR)),cuda) scripts/fetch-assets.sh >/dev/null

# The CUDA path on a GPU node (see scripts/gpu/check.sh); SLUICE_GPU_CHECK_DEVICE=cpu rehearses
# the same steps on the CPU.
gpu-check: setup
	scripts/gpu/check.sh

# A real-size benchmark on a GPU node (see scripts/gpu/bench.sh): the SD-1.5-shaped model.
gpu-bench: setup
	scripts/gpu/bench.sh

# Binaries, test executables, a Java runtime, Kafka, the S3 server and ONNX Runtime's CUDA
# flavour for a GPU node with no Rust, Java or network, in parts (see scripts/gpu/pack.sh).
gpu-pack: setup
	scripts/gpu/pack.sh

build:
	$(CARGO) build --release --locked --bins

stack-up: stack-tools assets
	scripts/stack.sh up $(STACK)

stack-down:
	scripts/stack.sh down $(STACK)

stack-status:
	scripts/stack.sh status $(STACK)

# The binaries the demo runs, and only those (not sluice-bench).
demo-bins:
	$(CARGO) build --release --locked --bin sluice-worker --bin sluice-producer --bin sluice-demo

# The S3 server's build and the downloads run beside the build of Sluice (-j3 here, whatever make
# was given): on 2 cores a cargo build leaves a core idle through much of its serial tail.
demo:
	@$(MAKE) --no-print-directory -j3 stack-tools assets demo-bins
	@$(MAKE) --no-print-directory stack-up
	$(BIN)/sluice-demo

unit-test: assets build
	$(CARGO) test --release --locked --workspace --exclude sluice-integration-tests

integration-test: setup alerts-test helm-lint python-client
	rm -rf .stack-test
	$(CARGO) test --release --locked -p sluice-integration-tests

test: setup alerts-test helm-lint python-client
	rm -rf .stack-test
	$(CARGO) test --release --locked --workspace

chaos: setup
	rm -rf .stack-test
	SLUICE_CHAOS=full $(CARGO) test --release --locked -p sluice-integration-tests --test chaos -- --nocapture --test-threads 1

fuzz:
	SLUICE_FUZZ_EXECS=$${SLUICE_FUZZ_EXECS:-5000000} $(CARGO) test --release --locked -p sluice-integration-tests --test fuzz -- --nocapture

bench: setup
	$(BIN)/sluice-bench

# Rust (rustfmt, clippy), the Dockerfiles (hadolint), the Python scripts and client (ruff, rules in
# ruff.toml) and the shell scripts (shellcheck); the tools pinned in scripts/install-tools.sh.
lint:
	scripts/install-tools.sh lint-tools
	$(CACHE)/tools/hadolint-2.15.1/bin/hadolint deploy/docker/*.Dockerfile
	$(CACHE)/tools/ruff-0.17.6/bin/ruff check --no-cache scripts clients/python
	$(CACHE)/tools/shellcheck-0.11.0.1/bin/shellcheck $$(git ls-files '*.sh') .ci/run
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --locked --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

helm-lint:
	scripts/helm-lint.sh

# The container images, built from deploy/docker/*.Dockerfile on local bases (scripts/images.sh).
images: build
	scripts/images.sh

# The Python client (clients/python): its wheel, mypy --strict and its unit tests; its stack
# suite runs in the integration tests (python_client).
python-client:
	scripts/python-client.sh check

# The alert rules' unit tests (promtool).
alerts-test:
	scripts/alerts-test.sh

clean:
	-scripts/stack.sh down $(STACK)
	rm -rf $(STACK) .stack-test
