#!/usr/bin/env bash
# Issue 17's rows on one GPU, in two parts that each fit one device call (<= 9.5 minutes);
# run from the repo root, results under $OUT (default bench/results):
#   PART=1  train_step.json     packed train step, default config (fusion: auto) vs fusion: none,
#                               and the default config with LoRA dim 16 (LoRA vs full fine-tuning);
#                               --profile: top kernels, GPU idle by launching op, host cProfile
#           train_step_8b.json  Qwen2.5-7B shape with LoRA dim 16 on every linear (8B-class row)
#   PART=2  logprobs.json       get_logprobs at 16k and 32k tokens vs plain and Liger
#           lora.json           LoRA (compute_dtype float32 and auto) vs full fine-tuning, plain loop
#           checkpoint.json     async saves (blocked / total) vs sync, raw write, cold load, raw read
#           refit.json          refit 1.5B and 7B shapes vs NeMo-RL's sender path and the ceiling
#           pytest_gpu.xml      pytest -q tests/gpu with the time left (>= 60 s)
# SMALL=1 runs the CPU smoke shapes (checks the flags; the figures mean nothing).
set -u
OUT=${OUT:-bench/results}
PART=${PART:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
small=${SMALL:+--small}
start=$(date +%s)
stamp() { echo "== $1 done at $(($(date +%s) - start)) s"; }
if [ "$PART" = 1 ]; then
  timeout 250 python bench/train_step.py $small --also-fuse none --also-lora-dim 16 \
    --skip-padded --skip-baseline --steps 3 --profile --out "$OUT/train_step.json" \
    > "$OUT/train_step.log" 2>&1
  grep -E "^gpu gaps|^idle ms|^ +[0-9.]+  |^metric|^packed|^peak|fusion \(" "$OUT/train_step.log"
  stamp train_step
  # 7B: ~116 s of worker start (random model written, loaded, compiled) before the steps
  timeout 280 python bench/train_step.py $small --shape 7b --lora-dim 16 --skip-padded \
    --skip-baseline --steps 3 --out "$OUT/train_step_8b.json" 2>&1 | tail -6
  stamp train_step_8b
else
  timeout 150 python bench/logprobs.py $small --tokens 16384 32768 --out "$OUT/logprobs.json" \
    2>&1 | tail -12
  stamp logprobs
  timeout 70 python bench/lora.py $small --steps 4 --warmup 1 --repeats 2 \
    --json "$OUT/lora.json" 2>&1 | tail -9
  stamp lora
  timeout 170 python bench/checkpoint.py $small --json "$OUT/checkpoint.json" 2>&1 | tail -16
  stamp checkpoint
  timeout 90 python bench/refit.py $small --out "$OUT/refit.json" 2>&1 | tail -10
  stamp refit
  budget=$((550 - ($(date +%s) - start)))
  [ "$budget" -lt 60 ] && budget=60
  timeout "$budget" python -m pytest -q tests/gpu -rs --junitxml="$OUT/pytest_gpu.xml" 2>&1 \
    | tail -25
  stamp pytest_gpu
fi
