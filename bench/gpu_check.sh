#!/usr/bin/env bash
# Every GPU check in one run, for a lent CUDA machine that has torch and transformers but not this project's
# install: wheels for deepspeed and its missing dependencies travel in .whl/ (see docs/cluster.md, GPU install).
#   tests/gpu                     bf16 agrees with fp32; an MLM step trains in bf16
#   bench.model                   ours vs transformers, bf16, 1.5B width, 8 layers, seq 512 (forward + backward)
#   bench.train_step              the 1.5B model's full pretraining step: DeepSpeed ZeRO-2/3 engine vs torch AMP
# Results land in $OUT (or /tmp/gpu_check).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
O=${OUT:-/tmp/gpu_check}; mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$O/nvidia_smi.txt"
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1
if [ -z "${SKIP_TESTS:-}" ]; then echo "== tests/gpu"
timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu 2>&1 | tail -4 | tee "$O/tests_gpu.txt"; fi
echo "== bench.model"
timeout 240 python3 -m bench.model --device cuda --dtype bf16 --like 1.5b --layers 8 --seq 512 --tokens 16384 \
  --steps 6 --warmup 2 --json "$O/model_bf16.json" 2>"$O/model_bf16.err" | tail -4
echo "== bench.train_step"
timeout 300 python3 -m bench.train_step --like 1.5b --micro 8 --zero ${ZERO:-2 3} --json "$O/train_step.json" --profile "$O" \
  2>"$O/train_step.err" | tail -7
