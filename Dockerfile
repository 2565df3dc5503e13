# One image for every spotrl service; docker-compose.yml picks the service by its command.
# GPU hosts: the default torch wheel from PyPI is the CUDA build. CPU-only hosts can pass
# --build-arg PIP_EXTRA_ARGS="--index-url <your CPU wheel index>" to get a smaller image.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_ARGS=""
# "cuda" or "cpu" adds vLLM for the rollout workers' vllm engine (SPOTRL_ENGINE=vllm).
ARG VLLM=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SPOTRL_HOST=0.0.0.0 \
    OMP_NUM_THREADS=4 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
RUN pip install $PIP_EXTRA_ARGS "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY services ./services
COPY tools ./tools
RUN pip install -e .
RUN if [ -n "$VLLM" ]; then bash tools/install-vllm.sh python "$VLLM"; fi

# Every service answers /healthz on $SPOTRL_PORT.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=10 \
  CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['SPOTRL_PORT'], timeout=2)"

CMD ["python", "-m", "services.coordinator.main"]
