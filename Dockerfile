# One image for every spotrl service; docker-compose.yml picks the service by its command.
# Every Python package is installed at its version in requirements.lock (`make lock`).
# GPU hosts: the default torch wheel from PyPI is the CUDA build. CPU-only hosts get a smaller
# image with --build-arg TORCH_SPEC="torch==2.13.0+cpu" and
# --build-arg PIP_EXTRA_ARGS="--extra-index-url <your CPU wheel index>".
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_ARGS=""
# "cuda" or "cpu" adds vLLM for the rollout workers' vllm engine (SPOTRL_ENGINE=vllm).
ARG VLLM=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SPOTRL_HOST=0.0.0.0 \
    OMP_NUM_THREADS=4 \
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

# Every service answers /healthz on $SPOTRL_PORT.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=10 \
  CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['SPOTRL_PORT'], timeout=2)"

CMD ["python", "-m", "services.coordinator.main"]
