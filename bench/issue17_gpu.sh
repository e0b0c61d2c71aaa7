#!/usr/bin/env bash
# Issue 17 rows on one GPU in <= 7 minutes (run from the repo root; results under $OUT):
#   train_step.json  packed train step, default config (fusion: auto) vs fusion: none
#   lora.json        LoRA (compute_dtype float32 and auto) vs full fine-tuning, plain loop
#   checkpoint.json  two consecutive async saves (blocked / total) vs a sync save, raw disk
#   pytest_gpu.xml   pytest -q tests/gpu, with whatever time is left (>= 60 s)
# SMALL=1 runs the CPU smoke shapes (checks the flags; the figures mean nothing).
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
small=${SMALL:+--small}
start=$(date +%s)
left() { echo $((420 - ($(date +%s) - start))); }
timeout 150 python bench/train_step.py $small --fuse auto --also-fuse none --skip-padded \
  --skip-baseline --steps 2 --out "$OUT/train_step.json" 2>&1 | tail -14
echo "== train_step done at $(($(date +%s) - start)) s"
timeout 60 python bench/lora.py $small --steps 4 --warmup 1 --repeats 2 \
  --json "$OUT/lora.json" 2>&1 | tail -9
echo "== lora done at $(($(date +%s) - start)) s"
timeout 120 python bench/checkpoint.py $small --skip-load --json "$OUT/checkpoint.json" 2>&1 \
  | tail -10
echo "== checkpoint done at $(($(date +%s) - start)) s"
budget=$(left)
[ "$budget" -lt 60 ] && budget=60
timeout "$budget" python -m pytest -q tests/gpu -rs --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tail -25
echo "== all done at $(($(date +%s) - start)) s"
