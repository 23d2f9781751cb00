# syntax=docker/dockerfile:1
#
# Images of vllm-autotuner, from one build stage:
#   operator  (default)  the kopf operator: `vllm-autotuner run`
#   vllm-sim             a GPU-free stand-in for vLLM, for clusters without GPUs (demos, CI)
#
#   docker build -t vllm-autotuner:0.1.0 .
#   docker build --target vllm-sim -t vllm-sim:0.1.0 .
#
# The base image is pinned by digest: a rebuild gets the same OS packages until the digest is
# bumped deliberately (Renovate or Dependabot can do it). The default is the multi-arch index of
# python:3.11-slim-bookworm; re-pin with `docker buildx imagetools inspect
# python:3.11-slim-bookworm`, or build from the moving tag with
# --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm (docs/operations.md#the-images).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

# ---------------------------------------------------------------------------------------------
# builder: build this repository's wheel and install it with its runtime dependencies (no
# extras: nothing the demo or `recommend` alone need) into /opt/venv. All dependencies ship
# manylinux wheels, so no compiler is needed even here.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY sim/ sim/
# The root filesystem is read-only at run time, so the bytecode is compiled here. The venv
# keeps no installer (pip, setuptools, wheel), and not the kubernetes package's asyncio client
# (kubernetes/aio, 68 MB on disk), which nothing in the operator imports.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --upgrade pip setuptools wheel \
    && /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/venv/bin/pip install /wheels/*.whl \
    && /opt/venv/bin/pip uninstall --yes setuptools wheel \
    && rm -rf /opt/venv/lib/python3.11/site-packages/kubernetes/aio \
    && /opt/venv/bin/pip freeze --all > /opt/venv/packages.txt \
    && /opt/venv/bin/python -m pip uninstall --yes pip \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

# ---------------------------------------------------------------------------------------------
# vllm-sim: serves vLLM's OpenAI API and /metrics (exact metric names) without a GPU.
FROM ${PYTHON_IMAGE} AS vllm-sim
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="vllm-sim" \
      org.opencontainers.image.description="GPU-free simulator of a vLLM server (OpenAI API and vLLM metrics)" \
      org.opencontainers.image.source="https://github.com/vllm-autotuner/vllm-autotuner" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /opt/venv /opt/venv
# The operator starts vLLM as `vllm serve MODEL ...` (the container's command). Here `vllm` is
# vllm-sim, so this image is a drop-in `spec.image` of a VLLMDeployment on clusters without GPUs.
RUN ln -s vllm-sim /opt/venv/bin/vllm
# Numeric, so that the kubelet can enforce runAsNonRoot.
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["vllm-sim", "serve"]

# ---------------------------------------------------------------------------------------------
# operator (default target, last): the kopf operator. The chart replaces CMD with its flags.
FROM ${PYTHON_IMAGE} AS operator
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="vllm-autotuner" \
      org.opencontainers.image.description="Kubernetes operator that deploys vLLM and tunes it against TTFT/ITL SLOs" \
      org.opencontainers.image.source="https://github.com/vllm-autotuner/vllm-autotuner" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /opt/venv /opt/venv
USER 65532:65532
# /healthz (liveness) and /metrics.
EXPOSE 8080 9090
# Exec form: SIGTERM reaches kopf, which finishes handlers and releases its peering.
ENTRYPOINT ["vllm-autotuner", "run"]
CMD ["--all-namespaces"]
