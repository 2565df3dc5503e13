# One image for every spotrl service; docker-compose.yml builds it once and picks the service by
# its command. Every Python package is installed at its version in requirements.lock (`make lock`).
#
# Build arguments (nothing changes without them):
#   BASE_IMAGE      the Python 3.11 image to start from (default python:3.11-slim); offline:
#                   the Debian base that tools/offline-image.sh builds with debootstrap
#   PIP_NO_INDEX, PIP_FIND_LINKS
#                   pip reads them from the environment: install from a wheelhouse instead of
#                   an index (tools/offline-image.sh serves one on loopback for the build)
#   TORCH_SPEC      GPU hosts: the default torch wheel from PyPI is the CUDA build. CPU-only
#                   hosts get a smaller image with TORCH_SPEC="torch==2.13.0+cpu" and
#                   PIP_EXTRA_ARGS="--extra-index-url <your CPU wheel index>"
#   VLLM            "cuda" or "cpu" adds vLLM for the rollout workers' vllm engine
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_ARGS=""
ARG VLLM=""
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
# Threads: each service sets OMP_NUM_THREADS and torch's from SPOTRL_TORCH_THREADS (compose
# sets it per service); nothing here overrides it.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPOTRL_HOST=0.0.0.0 \
    TOKENIZERS_PARALLELISM=false \
    HOME=/home/spotrl

# The services run as spotrl (uid 10001), never as root. It owns /app and every folder that
# docker-compose.yml mounts a named volume on (a new volume takes its folder's owner).
RUN groupadd --gid 10001 spotrl \
    && useradd --uid 10001 --gid spotrl --create-home --home-dir /home/spotrl \
        --shell /usr/sbin/nologin spotrl \
    && mkdir -p /app /data/weights /data/trainer /tmp/spotrl-rollout \
    && chown spotrl:spotrl /app /data /data/weights /data/trainer /tmp/spotrl-rollout

WORKDIR /app
COPY requirements.lock ./
RUN pip install $PIP_EXTRA_ARGS -c requirements.lock "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY services ./services
COPY tools ./tools
RUN pip install -c requirements.lock -e . \
    && if [ -n "$VLLM" ]; then \
        VLLM_CONSTRAINTS=requirements.lock bash tools/install-vllm.sh python "$VLLM"; \
    fi \
    && chown -R spotrl:spotrl /app

USER spotrl

# Every service answers /healthz; the check probes the port this container's own process bound
# (SPOTRL_PORT_FILE where set, else SPOTRL_PORT) and accepts only that process's answer.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=10 \
  CMD ["python", "-m", "services.infra.healthcheck"]

CMD ["python", "-m", "services.coordinator.main"]
