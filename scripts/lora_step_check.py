"""One LoRA training update of Qwen2.5-7B's shape: the memory planner's peak against the
memory the step really allocates.

    python scripts/lora_step_check.py                             # a GPU: real widths, bf16
    python scripts/lora_step_check.py --device cpu --shrink 16    # anywhere: widths / 16, fp32

It builds the model from a shipped `config.json` (default
tests/fixtures/model_configs/qwen2.5-7b) with random weights on the device (widths divided by
`--shrink` as `omgrpo bench memory` does, `omgrpo.tools.memory_bench.shrunk_config`), wraps it
with the trainer's LoRA code (`omgrpo.models.lora.apply_lora`, `model.lora.rank`), turns on
gradient checkpointing as `experiment=paper` does, and runs, through the trainer's own code:

1. a warm-up update of 1 row x 2 + 2 tokens, so the adapters' gradients and AdamW state exist
   (the plan's steady state);
2. the reference log-probs of the rows with the adapters off (`adapters_off`, what the KL term
   reads: the frozen base), as the `scoring` stage;
3. ONE training update (`ppo_update`: forward, backward, gradient clipping, the AdamW step) of
   `--rows` rows of `--prompt-len` + `--response-len` random tokens in micro-batches of
   `--micro` rows, as the `update` stage.

It prints one JSON line: per stage the planned peak (`omgrpo.models.memory.build_plan` for the
same shape, LoRA settings and sizes: resident + the stage's transient; the update stage the
larger of the update and optimizer-step peaks) and the measured peak (CUDA: what was allocated
before the stage plus `torch.cuda.max_memory_allocated` above it; CPU: the process's RSS
high-water mark, `VmHWM`, in a process started with glibc's mmap threshold at 16 KiB so that
freed tensors leave the RSS, as `omgrpo bench memory` measures; the script restarts itself so),
their
ratio, the resident state planned and measured, and checks that only the adapters moved.
Needs no GPU to import or to run with `--device cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "model_configs" / "qwen2.5-7b"
GIB = 2**30
MMAP_THRESHOLD = 16384  # as omgrpo.tools.memory_bench


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a folder with config.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shrink", type=int, default=1, help="divide the widths by this")
    p.add_argument("--rows", type=int, default=4, help="rows in the update")
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--rank", type=int, default=64, help="model.lora.rank")
    p.add_argument("--alpha", type=float, default=32.0, help="model.lora.alpha")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _rss_kib(key: str) -> int:
    """A /proc/self/status figure in KiB (`omgrpo bench memory`'s reader)."""
    from omgrpo.tools.memory_bench import _status_kib

    return _status_kib(key)


class Peak:
    """The peak memory of a block: CUDA's allocated peak, or on the CPU the RSS high-water
    mark (reset at the start through /proc/self/clear_refs; Linux)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self) -> Peak:
        import gc

        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.start = _rss_kib("VmRSS") * 1024
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()
        else:
            self.peak = _rss_kib("VmHWM") * 1024
            self.reserved = None
        self.seconds = time.perf_counter() - self.t0


def allocated(cuda: bool) -> int:
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return _rss_kib("VmRSS") * 1024


def plan_for(model_dir: str, args: argparse.Namespace):
    """The planner's figures for this check's shape, LoRA settings and sizes."""
    from omgrpo.config import compose
    from omgrpo.models.memory import plan_memory

    cfg = compose(
        [
            "experiment=paper",
            f"model.path={model_dir}",
            f"model.lora.rank={args.rank}",
            f"model.lora.alpha={args.alpha}",
            f"rollout.max_prompt_len={args.prompt_len}",
            f"rollout.max_new_tokens={args.response_len}",
            f"algorithm.micro_batch_size={args.micro}",
            f"trainer.prompts_per_step={args.rows}",
            "rollout.n=2",
            "car.enable=false",
            "eval.every=0",
        ]
    )
    return cfg, plan_memory(cfg, model_dir, 1 << 50, args.device)


def run(args: argparse.Namespace, model_dir: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from omgrpo.backends.native.update import ppo_update
    from omgrpo.generation.rollout import Sequences, response_logprobs
    from omgrpo.models.lora import adapters_off, apply_lora, trainable_parameters
    from omgrpo.tools.memory_bench import update_batch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("lora_step_check: --device cuda, but torch sees no CUDA device")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32  # the plan's dtype on each
    if not cuda:
        torch.set_num_threads(1)  # a shared CPU: threads only contend
    cfg, plan = plan_for(model_dir, args)
    config = AutoConfig.from_pretrained(model_dir)
    baseline = allocated(cuda)
    torch.manual_seed(args.seed)
    with device:  # built on the device: a 7B model's random init on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    peft_model = apply_lora(model, cfg.model.lora, seed=args.seed)
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    algo = cfg.algorithm

    def update(seqs, ref_logprobs) -> dict:
        model.train()
        return ppo_update(
            model,
            optimizer,
            seqs,
            None,
            ref_logprobs,
            update_batch(seqs),
            algo,
            cfg.optim.grad_clip,
        )

    def rows(n: int, prompt: int, response: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        p = torch.randint(2, config.vocab_size, (n, prompt), generator=g)
        r = torch.randint(2, config.vocab_size, (n, response), generator=g)
        return Sequences(p, torch.ones_like(p), r, torch.ones_like(r))

    def reference(seqs):
        model.eval()
        with torch.no_grad(), adapters_off(peft_model) as base:
            return response_logprobs(base, seqs, args.micro)["logprobs"]

    warm = rows(1, 2, 2, args.seed + 1)
    update(warm, reference(warm))  # the adapters' gradients and AdamW state now exist
    resident = allocated(cuda) - baseline
    seqs = rows(args.rows, args.prompt_len, args.response_len, args.seed + 2)
    frozen_name, frozen = next((n, p) for n, p in model.named_parameters() if "base_layer" in n)
    frozen_before = frozen.detach().float().sum().item()
    adapters_before = sum(
        p.detach().float().abs().sum().item() for p in trainable_parameters(model)
    )
    with Peak(cuda) as scoring:
        ref_logprobs = reference(seqs)
    with Peak(cuda) as upd:
        out = update(seqs, ref_logprobs)
    adapters_after = sum(p.detach().float().abs().sum().item() for p in trainable_parameters(model))
    stages = {st.name: st for st in plan.stages}
    plan_resident = sum(plan.resident.values())
    planned = {
        "scoring": stages["scoring"].peak,
        "update": max(stages["update"].peak, stages["optimizer_step"].peak),
    }
    measured = {"scoring": scoring, "update": upd}
    figures = {}
    for name, got in measured.items():
        peak = got.peak - baseline  # above what the process held before the model existed
        figures[name] = {
            "planned_peak_gib": round(planned[name] / GIB, 4),
            "measured_peak_gib": round(peak / GIB, 4),
            "peak_ratio": round(peak / planned[name], 3),
            "seconds": round(got.seconds, 2),
        }
        if got.reserved is not None:
            figures[name]["measured_reserved_peak_gib"] = round((got.reserved) / GIB, 4)
    return {
        "check": "lora_step",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "measure": "torch.cuda.max_memory_allocated" if cuda else "RSS high-water mark (VmHWM)",
        "config": str(args.config),
        "shrink": args.shrink,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": plan.shape.params,
        "lora": {
            "rank": args.rank,
            "alpha": args.alpha,
            "adapter_parameters": plan.sizes.lora.params,
        },
        "rows": args.rows,
        "micro_batch_rows": args.micro,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "gradient_checkpointing": True,
        "planned_resident_gib": round(plan_resident / GIB, 4),
        "measured_resident_gib": round(resident / GIB, 4),
        "stages": figures,
        "grad_norm": out.get("grad/norm"),
        "skipped": out["skipped"],
        "adapters_moved": adapters_after != adapters_before,
        "base_unchanged": frozen.detach().float().sum().item() == frozen_before,
        "base_checked": frozen_name,
        "versions": _versions(),
    }


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "peft", "omgrpo"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
        # glibc reads it at start: every buffer over 16 KiB its own mapping, returned when
        # freed, so the RSS follows the live tensors (`omgrpo bench memory` does the same)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)
    from omgrpo.models.hf_import import hide_sklearn_from_transformers
    from omgrpo.tools.memory_bench import shrunk_config

    hide_sklearn_from_transformers()

    with tempfile.TemporaryDirectory() as tmp:
        if args.shrink == 1:
            model_dir = str(args.config)
        else:
            (Path(tmp) / "config.json").write_text(
                json.dumps(shrunk_config(args.config, args.shrink))
            )
            model_dir = tmp
        result = run(args, model_dir)
    print(json.dumps(result))
    return (
        0 if not result["skipped"] and result["adapters_moved"] and result["base_unchanged"] else 1
    )


if __name__ == "__main__":
    sys.exit(main())
