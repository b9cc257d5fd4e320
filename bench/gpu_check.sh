#!/usr/bin/env bash
# Every GPU check in one run, for a lent CUDA machine that has torch and transformers but not this project's
# install: wheels for deepspeed and its missing dependencies travel in .whl/ (see docs/cluster.md, GPU install).
#   tests/gpu                     bf16 agrees with fp32; an MLM step trains in bf16; the fused attention (attn_impl=fused,
#                                 disentangled-flash) computes our hidden states and gradients in fp32 and bf16
#   bench.model                   ours vs transformers, bf16, 1.5B width, 8 layers, seq 512 (forward + backward)
#   bench.train_step              the full pretraining step side by side at 512 tokens: eager, compiled and fused
#                                 attention; the DeepSpeed ZeRO-2 engine and plain torch AMP in each; the base, large
#                                 and 1.5B widths; MFU in every row (step_<width>_<variant>.json)
#                                 gathered into one gpu_check.json (a row per width, variant and engine, with MFU)
#   bench.activation_memory       the memory plan's activation figure (deberta.activations, CUDA: SDPA's memory-
#                                 efficient kernel, bf16) against torch's peak allocation at the 1.5B shape (512
#                                 tokens, micro 8), with and without activation checkpointing, and the time it costs
# Results land in $OUT (or /tmp/gpu_check). Under 10 minutes: each part has its own timeout, and the step matrix
# stops starting runs once the whole check has used 540 s (the rows it ran are kept). The fused rows need the
# disentangled-flash wheel in .whl/ beside deepspeed's.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
O=${OUT:-/tmp/gpu_check}; mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$O/nvidia_smi.txt"
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1
START=$SECONDS
if [ -z "${SKIP_TESTS:-}" ]; then echo "== tests/gpu"
timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu 2>&1 | tail -4 | tee "$O/tests_gpu.txt"; fi
echo "== bench.activation_memory 1.5b"
timeout 240 python3 -m bench.activation_memory --shapes 1.5b --device cuda --threads 1 --steps 2 --rounds 3 \
  --no-deepspeed --json "$O/activation_memory_1.5b.json" 2>"$O/activation_memory_1.5b.err" | tail -4
echo "== bench.model"
timeout 120 python3 -m bench.model --device cuda --dtype bf16 --like 1.5b --layers 8 --seq 512 --tokens 16384 \
  --steps 6 --warmup 2 --json "$O/model_bf16.json" 2>"$O/model_bf16.err" | tail -4
for LIKE in 1.5b large base; do
  for VARIANT in eager fused compiled; do
    if [ $((SECONDS - START)) -gt 540 ]; then echo "== bench.train_step $LIKE $VARIANT: skipped (time)"; continue; fi
    case $VARIANT in eager) EXTRA="";; compiled) EXTRA="--compile";; fused) EXTRA="--attn fused";; esac
    echo "== bench.train_step $LIKE $VARIANT"
    timeout 150 python3 -m bench.train_step --like $LIKE --micro 8 --zero 2 --steps 6 --warmup 3 $EXTRA \
      --json "$O/step_${LIKE}_${VARIANT}.json" 2>"$O/step_${LIKE}_${VARIANT}.err" | tail -4
  done
done
# One JSON of the step matrix: a row per (width, variant, engine) with its MFU, for bench/results/<gpu>/ and the
# dry-run plan's PLAN_MFU (stages/pretrain/estimates.py names the file and row it takes).
python3 - "$O" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out, "step_*_*.json"))):
    like, variant = os.path.basename(path)[len("step_"):-len(".json")].rsplit("_", 1)
    for r in json.load(open(path)).get("results", []):
        rows.append({"like": like, "variant": variant, "mode": r.get("mode"), "zero": r.get("zero"),
                     "precision": r.get("precision"), "tokens_per_s": r.get("tokens_per_s"), "mfu": r.get("mfu")})
json.dump({"command": "bash bench/gpu_check.sh", "seq": 512, "rows": rows}, open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
for r in rows:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    print(f"{r['like']:>5} {r['variant']:>8} {r['mode']:>9} zero={r['zero']} {mfu}")
PY
