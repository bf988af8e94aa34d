#!/usr/bin/env bash
# The one-GPU check of issue 38, sized for a 15-minute lease: one call of at most 495 s plus
# setup (about 9 minutes with the machine's start), its outputs in 7 files. In order of need:
# the decoder's CUDA graphs against eager decoding, `bench generate` on the paper chunk
# (Qwen3-1.7B, 160 rows, 512 + 3072 tokens; this tree only) and at 8 rows (Llama-3.2-3B, new vs
# the baseline tree), one LoRA update of Qwen2.5-7B's shape against its plan, and `bench memory`
# for Qwen2.5-7B. Each part has its own time limit, so one that fails or hangs does not stop
# the others. How it ran on leases of 2026-11-27 and 2026-11-28: docs/performance.md.
#   scripts/gpu_check.sh OUT_DIR [BASELINE_TREE]      (PYTHON=... picks the interpreter)
# BASELINE_TREE: a directory holding an older omgrpo/ (e.g. .baseline/14a048d, carried), made
# with `mkdir -p .baseline/REV && git archive REV omgrpo | tar -x -C .baseline/REV`; b478ec7 is
# the last decoder the leases validated (before the fused projections of 34334ff).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [BASELINE_TREE]}
baseline=${2:-}
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import omgrpo from this tree
log="$out/gpu_check.log"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
    git rev-parse HEAD 2>/dev/null || echo "commit: not a git checkout"
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

part() {  # NAME SECONDS command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(( SECONDS - t0 )) s" | tee -a "$log"
    return $rc
}
compare=()
[ -n "$baseline" ] && compare=(--compare "$baseline")

# 1. graphs replay = eager decoding (same widths), bit for bit; if not, time eager decoding.
#    Judged by the check's JSON, not its exit: on 2026-11-28 it wrote "ok": true and was then
#    stopped by its time limit on the way out (58 s on 2026-11-27, over 60 s on a colder machine)
part decode-check 90 $py scripts/gpu_decode_check.py --device cuda
grep '^{"' "$log" | tail -n 1 > "$out/decode_check.json"
if ! grep -q '"ok": true' "$out/decode_check.json"; then
    echo "decode check failed: the timings below run without CUDA graphs" | tee -a "$log"
    export OMGRPO_CUDA_GRAPHS=0
fi
# 2. the paper chunk: 20 prompts x 8 rows, 512 prompt tokens, all 3072 new tokens per row. This
#    tree only: the old decoder needs ~150 s here (137.8 s on 2026-11-26), more than the lease
#    leaves (2026-11-27: both sides in one call ran out of time)
part generate-paper-chunk 110 $py -m omgrpo bench generate --json --device cuda \
    --configs qwen3-1.7b-base --prompts 20 --rollouts 8 --prompt-len 512 --gen-tokens 3072 \
    --rounds 1 --out "$out/generate_qwen3_paper_chunk.json"
# 3. 8 rows of Llama-3.2-3B, the fixed per-step cost, new vs the baseline in the same call
part generate-8-rows 150 $py -m omgrpo bench generate --json --device cuda \
    --configs llama-3.2-3b-instruct --prompts 1 --rollouts 8 --prompt-len 512 --gen-tokens 1024 \
    --rounds 1 --out "$out/generate_llama_8_rows.json" "${compare[@]}"
# 4. one LoRA update of Qwen2.5-7B's shape against its plan
part lora-step 40 $py scripts/lora_step_check.py --device cuda
grep '^{"' "$log" | tail -n 1 > "$out/lora_step.json"
# 5. the memory plan for Qwen2.5-7B (the update after the logits fix; two micro-batches)
part memory-qwen2.5-7b 65 $py -m omgrpo bench memory --device cuda --shrink 1 --json \
    --configs qwen2.5-7b --prompts 2 --rollouts 4 --micro 1 --gen-tokens 1024 \
    --out "$out/memory_qwen2.5_7b.json"
ls -la "$out"
