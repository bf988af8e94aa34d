"""The decoder on a GPU, checked before it is timed: CUDA-graph replay gives the same rows as
eager decoding (bit for bit: the same kernels run), greedy and sampled, with rows ending at
different steps (so ended rows are dropped and the graphs re-captured) and a response longer
than one attention-width bucket. Prints one JSON line; exit 1 if any rows differ.

    python scripts/gpu_decode_check.py [--config qwen3-1.7b-base] [--device cuda]
On the CPU (`--device cpu --shrink 16`) both runs are eager: a check of the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omgrpo.models.hf_import import hide_sklearn_from_transformers

hide_sklearn_from_transformers()  # before a model class is imported (omgrpo.models.hf_import)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from omgrpo.generation import engine  # noqa: E402
from omgrpo.generation.rollout import sample  # noqa: E402
from omgrpo.tools.memory_bench import CONFIGS, shrunk_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-1.7b-base")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shrink", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=engine.WIDTH_BUCKET + 64)
    ns = parser.parse_args()
    device = torch.device(ns.device)
    source = CONFIGS / ns.config
    config = (
        shrunk_config(source, ns.shrink)
        if ns.shrink > 1
        else json.loads((source / "config.json").read_text())
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    model.eval().requires_grad_(False)
    prompts = torch.randint(
        2, config["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1)
    )
    prompts = [p[: 20 + 7 * i].tolist() for i, p in enumerate(prompts)]  # ragged prompts

    def run(graphs: bool, temperature: float, eos: list[int]):
        os.environ["OMGRPO_CUDA_GRAPHS"] = "1" if graphs else "0"
        start = time.perf_counter()
        seqs = sample(
            model,
            prompts,
            n=4,
            max_new_tokens=ns.tokens,
            temperature=temperature,
            top_p=0.95,
            eos_id=eos,
            pad_id=0,
            seed=3,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return seqs, time.perf_counter() - start

    report, ok = {"config": ns.config, "device": str(device), "tokens": ns.tokens}, True
    for temperature in (0.0, 1.0):
        # stop ids: tokens the eager run draws at staggered steps, so rows end at different steps
        free, _ = run(False, temperature, [-1])
        ids = free.response_ids
        stops = sorted({int(ids[r, (40 + 53 * r) % ns.tokens]) for r in range(0, len(ids), 3)})
        eager, t_eager = run(False, temperature, stops)
        graphed, t_graphed = run(True, temperature, stops)
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                (eager.response_ids, eager.response_mask),
                (graphed.response_ids, graphed.response_mask),
            )
        )
        lengths = eager.response_mask.sum(-1).tolist()
        report[f"t{temperature}"] = {
            "identical": same,
            "lengths": lengths,
            "stop_ids": stops,
            "seconds_eager": t_eager,
            "seconds_graphs": t_graphed,
        }
        ok &= same and len(set(lengths)) > 1
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
