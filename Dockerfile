# syntax=docker/dockerfile:1
# The mha-serve server image. CPU by default:
#   docker build -t mha-serve:0.1.0 .
# GPU (CUDA 12.8): a CUDA runtime base and the matching torch wheel index:
#   docker build -t mha-serve:0.1.0-cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# See deploy/README.md. Both stages start from BASE_IMAGE so that the virtual
# environment built in the first runs on the very same Python in the second.

ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# python:*-slim has Python; the CUDA images (Ubuntu) do not, so install the distribution's.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN if ! python3 -c "import ensurepip" >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index that matches the base (CPU or a CUDA build): a plain
# `pip install torch` from PyPI would pull a multi-GB CUDA build into the CPU image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY client/ client/
# The constraint keeps the torch installed above (2.13.0 also matches 2.13.0+cu128).
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
    && pip install --constraint /tmp/torch-constraint.txt ".[server,tracing]" \
    && python3 -c "import torch, mha_serve.transport.server; print('torch', torch.__version__)"

FROM base AS runtime
# A fixed numeric uid so that Kubernetes' runAsNonRoot can verify it (deploy/k8s uses 10001).
RUN groupadd --system --gid 10001 mha \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin mha
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
# gRPC (mha.v1.AttentionService, grpc.health.v1.Health, reflection) and Prometheus /metrics.
EXPOSE 50051 9095
# No HEALTHCHECK: Docker's needs a probe binary for gRPC; Kubernetes probes gRPC
# health natively (deploy/k8s/deployment.yaml). Flags after the image name, or
# MHA_SERVE_* variables, configure the rest: docker run mha-serve:0.1.0 --device cpu
ENTRYPOINT ["mha-serve", "--host", "0.0.0.0"]
