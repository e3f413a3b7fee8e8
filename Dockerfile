# kvxfer images (docs/gpu.md). CI builds the CPU image with podman on a base made
# by mmdebstrap and runs it as the chart does (tests/image); hadolint checks this file.
#
#   docker build --build-arg VARIANT=cpu  -t ghcr.io/kvxfer/kvxfer:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t ghcr.io/kvxfer/kvxfer:0.1.0-cuda .
#   docker build --target vllm-engine     -t ghcr.io/kvxfer/vllm-openai-kvxfer:v0.33.0-0.1.0 .
ARG VARIANT=cpu

# -- bases: where Python and torch come from ------------------------------------------------
# BUILD_PACKAGES leave with the sources; RUNTIME_PACKAGES stay: on a GPU, Triton compiles its
# kernels' launcher with a C compiler (and Python's headers) at run time.
FROM python:3.11-slim-bookworm AS base-cpu
# Where torch comes from (a mirror or a local index may replace it: the CI image test does).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# NIXL's CUDA 13 wheel (pyproject's peering extra) runs on CPU nodes too.
# The Mooncake Store client (the mooncake extra) has wheels for Python 3.11, this base's, and needs libibverbs1.
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL} \
    NIXL_WHEEL=nixl-cu13 \
    EXTRAS="events,object,mooncake" \
    BUILD_PACKAGES="gcc libc6-dev" \
    RUNTIME_PACKAGES="libibverbs1"

# One CUDA major for the base, torch and NIXL (a CUDA 12.8 torch beside nixl-cu13 was a mismatch).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
# (Python 3.12 here: the Mooncake Store client has no wheel for it yet, so this image has no Mooncake tier.)
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    NIXL_WHEEL=nixl-cu12 \
    EXTRAS="events,object" \
    BUILD_PACKAGES="" \
    RUNTIME_PACKAGES="gcc libc6-dev python3-dev"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

# -- the daemon: only kvxfer, its dependencies and an unprivileged user -----------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS kvxfer
ARG TORCH_VERSION=2.13.0
ARG NIXL_VERSION=1.5.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvxfer ./kvxfer
COPY service ./service
COPY setup.py ./
# gcc (and Python's headers) build the C copy loop and the bookkeeping passes (kvxfer/transfer/_fused.c,
# kvxfer/core/_fastpath.c). The package lists are lists: split on purpose.
# hadolint ignore=DL3008,SC2086
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${BUILD_PACKAGES} ${RUNTIME_PACKAGES} \
 && python3 -m venv /opt/kvxfer \
 && /opt/kvxfer/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/kvxfer/bin/pip install --no-cache-dir "/src[${EXTRAS}]" "${NIXL_WHEEL}==${NIXL_VERSION}" \
 && if [ -n "${BUILD_PACKAGES}" ]; then apt-get purge -y --auto-remove ${BUILD_PACKAGES}; fi \
 && rm -rf /src /var/lib/apt/lists/* \
 && groupadd --gid 2000 kvxfer \
 && useradd --uid 1000 --gid 2000 --no-create-home --shell /usr/sbin/nologin kvxfer \
 && install -d -o 1000 -g 2000 /var/cache/kvxfer
WORKDIR /
ENV PATH=/opt/kvxfer/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TRITON_HOME=/var/cache/kvxfer \
    TRITON_CACHE_DIR=/var/cache/kvxfer/triton
USER 1000:2000
# The config (a ConfigMap), the socket directory (an emptyDir shared with the engine) and the run-time
# cache (Triton's kernels and launcher; the root filesystem is read-only in the chart).
VOLUME ["/etc/kvxfer", "/run/kvxfer", "/var/cache/kvxfer"]
EXPOSE 9470
ENTRYPOINT ["kvxfer"]
CMD ["serve", "--config", "/etc/kvxfer/config/kvxfer.yaml"]

# -- vLLM with the kvxfer backend installed (the chart's default engine image) ---------------
FROM vllm/vllm-openai:v0.33.0 AS vllm-engine
COPY pyproject.toml setup.py README.md /tmp/kvxfer/
COPY kvxfer /tmp/kvxfer/kvxfer
COPY service /tmp/kvxfer/service
# vLLM's own torch stays: kvxfer asks only for torch>=2.4. vLLM's image runs as root, which the
# chart's runAsNonRoot refuses: the engine runs as uid 1000 (the base may already name it, as
# Ubuntu 24.04's "ubuntu" user does) in group 2000, the pod's fsGroup, with a home of its own
# for the model cache.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /tmp/kvxfer && rm -rf /tmp/kvxfer \
 && (getent group 2000 >/dev/null || groupadd --gid 2000 kvxfer) \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 2000 --no-create-home --shell /usr/sbin/nologin vllm) \
 && install -d -o 1000 -g 2000 /home/engine
ENV HOME=/home/engine \
    HF_HOME=/home/engine/.cache/huggingface
USER 1000:2000
