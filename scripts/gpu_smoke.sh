#!/usr/bin/env bash
# verl smoke test on one GPU (docs/verl.md, "Smoke test on a GPU"): OM-GRPO with CAR for 2 steps
# (collapse stop forced at step 2) and 1 step of majority voting on toy problems, with vLLM and a
# real model, then checks what verl logged (omgrpo.backends.verl.smoke.check_run).
#   scripts/gpu_smoke.sh /models/Qwen3-0.6B [out_dir] [extra overrides...]
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 MODEL_PATH [OUT_DIR] [overrides...]" >&2
    exit 2
fi
model=$1
out=${2:-verl-smoke}
shift $(( $# >= 2 ? 2 : 1 ))
exec python -m omgrpo.backends.verl.smoke --model "$model" --out "$out" "$@"
