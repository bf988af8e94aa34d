#!/usr/bin/env bash
# The memory planner against one GPU (docs/performance.md, "On a GPU"): each paper backbone at its
# real size (random weights from the shipped config.json, bf16) runs one step through the trainer's
# own code (generation, reference scoring, the update with and without gradient checkpointing), and
# `omgrpo bench memory --device cuda --shrink 1` compares CUDA's peak allocated memory per stage
# with the plan and reports rollout tokens/s. Each backbone has its own time limit, so one that
# fails or hangs does not stop the others.
#   scripts/gpu_memory_check.sh [OUT_DIR]          (PYTHON=... picks the interpreter)
set -uo pipefail
out=${1:-gpu-memory-check}
py=${PYTHON:-python}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"

check() {  # NAME SECONDS bench-memory-args...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    local t0=$SECONDS
    timeout "$limit" $py -m omgrpo bench memory --device cuda --shrink 1 --json \
        --out "$out/$name.json" "$@" > /dev/null 2> "$out/$name.log"
    echo "$name: exit $? after $(( SECONDS - t0 )) s"
    tail -n 4 "$out/$name.log"
}
# small rows and 1024 decoded tokens: the resident state and the transients at real widths
check llama-3.2-3b 120 --configs llama-3.2-3b-instruct --prompts 2 --rollouts 4 --micro 1 --gen-tokens 1024
# the paper preset's own sizes on one 80 GiB card: a generation chunk of 160 rows (20 prompts x 8)
# decoding all 3072 tokens, scoring and the update in micro-batches of 4 rows of 512 + 3072 tokens
check qwen3-1.7b-paper-chunk 240 --configs qwen3-1.7b-base --prompts 20 --rollouts 8 --micro 4
check qwen2.5-7b 150 --configs qwen2.5-7b --prompts 2 --rollouts 4 --micro 1 --gen-tokens 1024
