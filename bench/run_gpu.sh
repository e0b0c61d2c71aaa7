#!/usr/bin/env bash
# The README table's GPU rows and their targets on one GPU, in parts that each fit one device
# call (under 10 minutes; the figures in brackets are run C's H200 timings: 12-05, commit
# 095c59f, PART=1 303 s, PART=2 373 s); run from the repo root, results under $OUT (default bench/results). PART=1 and
# PART=2 make the README's table, PART=3 runs the GPU tests, PART=4 the profiles, PART=5 the
# in-flight, adapter and digest rows, PART=6 full fine-tuning of the 7B shape (Adafactor), PART=7..9 float8 training.
# No row is timed after a profile in its process (the profiler leaves every later launch slower:
# bench/common.mark_profiled), so the table's parts profile nothing; PART=4 holds the profiles.
#   PART=1  train_step.json     packed train step, default config (fusion: auto) vs fusion: none,
#                               the default config with LoRA dim 16 (LoRA vs full fine-tuning),
#                               and fusion: none with Liger's RMSNorm/SwiGLU/RoPE kernels (our
#                               compile vs the field's kernel library); the log is train_step.log
#                               [203 s]
#           logprobs.json       get_logprobs at 16k and 32k tokens vs plain and Liger [54 s]
#           lora.json           LoRA (compute_dtype float32 and auto) vs full fine-tuning, plain
#                               loop [30 s]
#           refit.json          refit 1.5B and 7B shapes vs NeMo-RL's sender path and the ceiling
#                               [15 s]
#   PART=2  train_step_8b.json  Qwen2.5-7B shape with LoRA dim 16 on every linear (8B-class row)
#                               [170 s]
#           checkpoint.json     async saves (blocked / total), a sync save after them (staging
#                               kept) and without staging (and its weights-only and
#                               optimizer-only parts, the latter also with DCP's own copies as
#                               the baseline), raw write, cold load, raw read [203 s]
#   PART=3  pytest_gpu.xml      pytest -q tests/gpu [256 s; 390 s on 12-05: the fused-worker
#                               tests compile]
#   PART=5  inflight.json       refits while the HF inference process decodes: stall, throughput
#                               and wrong-version tokens vs pause/resume (about 2 min)
#           lora_adapters.json  adapter-only vs full refit (1.5B, 7B, rank 16), N adapters vs one
#                               (about 3 min)
#           checkpoint_digests.json  the digests' share of a sync save, hashed while writing vs a
#                               second pass (about 2 min)
#   PART=6  train_step_7b_full.json  Qwen2.5-7B shape trained in full on one GPU with
#                               torch.optim.Adafactor (factored state), 8192-token microbatches;
#                               AdamW beside it is refused by the pre-flight check (does not fit);
#                               needs an H200 (planned peak 111 GiB) (about 3 min: ~2 min of
#                               worker start)
#           train_step_adafactor.json  1.5B shape: AdamW (everything on the GPU) vs Adafactor,
#                               the same step in one process (about 2 min)
#   PART=7  train_step_fp8.json  1.5B default config vs the same plus dtensor_cfg.fp8 (tensorwise
#                               float8 linears), tokens/s and loss side by side
#           fp8_loss.json       50 steps bf16 vs fp8 on the same batches, 1.5B: largest loss gap
#                               vs the bf16 step-to-step noise
#   PART=8  train_step_8b_fp8.json  the same tokens/s row at the 7B shape with LoRA dim 16 (the
#                               bf16 7B LoRA worker peaks at 120 GiB: an H200, as PART=2)
#   PART=9  fp8_loss_8b.json    the 50-step loss check at the 7B shape with LoRA dim 16
#   PART=4  train_step_lora.json  the 1.5B default config with LoRA dim 16 alone, --profile (where
#                               a LoRA step's time goes: kernels, GPU idle, host; and its speed
#                               after the profile); the log is train_step_lora.log [132 s]
#           logprobs_profile.json  get_logprobs at 16k tokens with --profile: one call of ours and
#                               of the plain path (kernels, GPU idle by launching op, host); the
#                               log is logprobs_profile.log (about 1 minute)
# The targets are the H200's, and PART=1/2 do not fit an 80 GB H100 (the 7B LoRA row peaks at
# 120 GiB, the fusion: none worker at 79 GiB, the plain logprobs path at 32k tokens adds 65 GiB).
# SMALL=1 runs the CPU smoke shapes (checks the flags; the figures mean nothing).
# Afterwards, with PART=1 and PART=2's JSON files in one folder: `python -m policyworker bench
# --report FOLDER` prints every row with its settings and its verdict (each target is a
# row's rule).
set -u
OUT=${OUT:-bench/results}
PART=${PART:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
small=${SMALL:+--small}
start=$(date +%s)
stamp() { echo "== $1 done at $(($(date +%s) - start)) s"; }
if [ "$PART" = 1 ]; then
  timeout 300 python -m bench.train_step $small --also-fuse none --also-lora-dim 16 --also-liger \
    --skip-padded --skip-baseline --steps 3 --out "$OUT/train_step.json" \
    > "$OUT/train_step.log" 2>&1
  grep -E "^gpu gaps|^idle ms|^ +[0-9.]+  [a-zA-Z]|^metric|^packed|^peak|fusion \(|^after the" \
    "$OUT/train_step.log"
  stamp train_step
  timeout 120 python -m bench.logprobs $small --tokens 16384 32768 --out "$OUT/logprobs.json" \
    2>&1 | tail -12
  stamp logprobs
  timeout 60 python -m bench.lora $small --steps 4 --warmup 1 --repeats 2 \
    --json "$OUT/lora.json" 2>&1 | tail -9
  stamp lora
  timeout 150 python -m bench.refit $small --out "$OUT/refit.json" 2>&1 | tail -30
  stamp refit
elif [ "$PART" = 2 ]; then
  # 7B: ~117 s of worker start (random model written, loaded, compiled) before the steps
  timeout 330 python -m bench.train_step $small --shape 7b --lora-dim 16 --skip-padded \
    --skip-baseline --steps 3 --out "$OUT/train_step_8b.json" 2>&1 | tail -6
  stamp train_step_8b
  timeout 255 python -m bench.checkpoint $small --json "$OUT/checkpoint.json" 2>&1 | tail -20
  stamp checkpoint
elif [ "$PART" = 5 ]; then
  timeout 150 python -m bench.inflight $small --json "$OUT/inflight.json" 2>&1 | tail -22
  stamp inflight
  timeout 200 python -m bench.lora_adapters $small --json "$OUT/lora_adapters.json" 2>&1 | tail -14
  stamp lora_adapters
  timeout 150 python -m bench.checkpoint_digests $small --repeats 2 \
    --json "$OUT/checkpoint_digests.json" 2>&1 | tail -10
  stamp checkpoint_digests
elif [ "$PART" = 6 ]; then
  # 7B first: the target row lands even if the call is cut short. Planned peak 111 GiB (H200).
  timeout 210 python -m bench.train_step $small --shape 7b --optimizer torch.optim.Adafactor \
    --also-optimizer torch.optim.AdamW --mb-tokens 8192 --skip-padded --skip-baseline --steps 3 \
    --out "$OUT/train_step_7b_full.json" 2>&1 | tail -14
  stamp train_step_7b_full
  timeout 150 python -m bench.train_step $small --optimizer torch.optim.AdamW \
    --also-optimizer torch.optim.Adafactor --skip-padded --skip-baseline --steps 3 \
    --out "$OUT/train_step_adafactor.json" 2>&1 | tail -14
  stamp train_step_adafactor
elif [ "$PART" = 7 ]; then
  rows="^fusion \(|^fp8 |worker: |^metric|^packed|^peak|^loss|^max|^mean|^last|step 49"
  timeout 300 python -m bench.train_step $small --also-fp8 --skip-padded --skip-baseline \
    --steps 3 --out "$OUT/train_step_fp8.json" > "$OUT/train_step_fp8.log" 2>&1
  grep -E "$rows" "$OUT/train_step_fp8.log"
  stamp train_step_fp8
  timeout 280 python -m bench.fp8_loss $small --out "$OUT/fp8_loss.json" \
    > "$OUT/fp8_loss.log" 2>&1
  grep -E "$rows" "$OUT/fp8_loss.log"
  stamp fp8_loss
elif [ "$PART" = 8 ]; then
  timeout 560 python -m bench.train_step $small --shape 7b --lora-dim 16 --also-fp8 --skip-padded \
    --skip-baseline --steps 2 --out "$OUT/train_step_8b_fp8.json" \
    > "$OUT/train_step_8b_fp8.log" 2>&1
  grep -E "^fusion \(|^fp8 |worker: |^metric|^packed|^peak|^loss" "$OUT/train_step_8b_fp8.log"
  stamp train_step_8b_fp8
elif [ "$PART" = 9 ]; then
  timeout 560 python -m bench.fp8_loss $small --shape 7b --lora-dim 16 --batch 2 --max-len 1024 \
    --out "$OUT/fp8_loss_8b.json" > "$OUT/fp8_loss_8b.log" 2>&1
  grep -E "worker: |^metric|^max|^mean|^last|step 49" "$OUT/fp8_loss_8b.log"
  stamp fp8_loss_8b
elif [ "$PART" = 4 ]; then
  timeout 240 python -m bench.train_step $small --lora-dim 16 --skip-padded --skip-baseline \
    --steps 3 --profile --out "$OUT/train_step_lora.json" > "$OUT/train_step_lora.log" 2>&1
  grep -E "^gpu gaps|^idle ms|^ +[0-9.]+  [a-zA-Z]|^metric|^packed|^peak|fusion \(|^after the" \
    "$OUT/train_step_lora.log"
  stamp train_step_lora
  timeout 150 python -m bench.logprobs $small --tokens 16384 --profile \
    --out "$OUT/logprobs_profile.json" > "$OUT/logprobs_profile.log" 2>&1
  grep -E "^== profile|^gpu gaps|^idle ms|^call |^host ms|^ +[0-9.]+  [a-zA-Z(]" \
    "$OUT/logprobs_profile.log"
  stamp logprobs_profile
else
  timeout 560 python -m pytest -q tests/gpu -rs --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tail -8
  stamp pytest_gpu
fi
