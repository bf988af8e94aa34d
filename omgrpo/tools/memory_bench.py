"""`omgrpo bench memory`: the memory planner (`omgrpo.models.memory`) against a measurement.

For each shipped backbone config (tests/fixtures/model_configs) a model is built with the real
layer count and attention layout (heads, K/V heads) but every width divided by `--shrink`
(hidden size, head dim, intermediate size, vocabulary), so that every transient term of the
plan, each linear in one of those widths, shrinks by the same factor and keeps its real-scale
share, and the model runs on a CPU. At the paper's sequence lengths (prompt 512, response 3072;
every prompt and response at its longest, as the plan assumes) one step runs through the
trainer's own code, on random weights in fp32 (the plan's dtype on the CPU):

- warm-up: one tiny update, so gradients and AdamW's state exist (the plan's steady state);
- generation: `rollout.sample` of all prompts x rollout.n rows, no row stopping early, in
  the chunks the free memory allows as in training (`generation_chunk_rows` in the JSON: all
  rows where they fit); the plan is the generation of one such chunk;
- scoring: `rollout.response_logprobs` of the reference model over the rows, in micro-batches;
- update: the trainer's `ppo_update` on two micro-batches (fewer if there are fewer rows), as
  in training, where the second runs beside what the first leaves (its gradients) and
  accumulates into them (forward, backward, clipping, the AdamW step; `update_rows` and
  `update_micro_batch_rows` in the JSON), with gradient checkpointing as the paper preset
  sets it, then again without.

Measurement: each config runs in a fresh process with glibc's mmap threshold fixed at 16 KiB
(MALLOC_MMAP_THRESHOLD_), so every tensor buffer larger than that is its own mapping, returned
to the kernel when freed, and the resident set size follows the live tensor bytes. Before each
stage the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` 5) and the stage's
transient is its peak (`VmHWM`) minus the RSS it started from. The resident state is the RSS
after the warm-up minus the RSS before the models were built. RSS counts touched pages only,
so an allocated but unwritten buffer is not counted (all written here: no row stops early).
Linux only. The planned figures are `build_plan` for the same shrunk config and sizes.

On a GPU (`--device cuda`, usually with `--shrink 1`: the real widths) the models are bf16, the
plan's dtype there, built on the device, and each stage's transient is CUDA's peak allocated
memory (`torch.cuda.max_memory_allocated`, reset before the stage) above what was allocated when
it started; the resident state is what is allocated after the warm-up. The caching allocator's
reserved peak is reported beside it (`measured_reserved_peak_gib`), since that is what a
card's other users see. Generation's seconds give rollout tokens/s. A stage that runs out of
CUDA memory is a result, not a crash: it is marked `out_of_memory` (its figures are where it
failed, with no ratio; the config's `out_of_memory` lists such stages) and the later stages
still run where they do not need its output (generation and scoring feed the updates, so an
out-of-memory there still ends the config's worker).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from omgrpo.errors import InputError

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "model_configs"
BACKBONES = ("qwen3-1.7b-base", "llama-3.2-3b-instruct", "qwen2.5-7b")
TARGET = 0.25  # the planner's accuracy goal: measured peak within 25 % of the plan
MMAP_THRESHOLD = 16384


def shrunk_config(source: Path, shrink: int) -> dict:
    """`source`'s config.json with hidden size, head dim, intermediate size and vocabulary
    divided by `shrink`; layers, heads and K/V heads kept."""
    config = json.loads((source / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim % shrink or (head_dim // shrink) % 2:
        raise InputError(
            f"head dim {head_dim} / --shrink {shrink} is not a whole even number",
            file=source / "config.json",
            expected="a --shrink that divides the head dim into an even number",
        )
    small = head_dim // shrink
    config.update(
        hidden_size=config["hidden_size"] // shrink,
        head_dim=small,
        intermediate_size=config["intermediate_size"] // shrink,
        vocab_size=config["vocab_size"] // shrink,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    config.pop("torch_dtype", None)
    return config


def config_source(name: str, shrink: int) -> Path:
    """The folder of a `--configs` entry (a fixture name or a directory), its config.json
    checked as the planner reads it and shrinkable by `shrink` (InputError naming the file and
    field), before any measurement starts."""
    from omgrpo.models.memory import check_model_config

    source = Path(name) if Path(name).is_dir() else CONFIGS / name
    if not (source / "config.json").is_file():
        raise InputError(
            "no config.json", key="--configs", found=name, expected="a fixture name or a folder"
        )
    check_model_config(str(source))
    shrunk_config(source, shrink)
    return source


def plan_overrides(model_dir: Path, spec: dict) -> list[str]:
    """The paper preset at the benchmark's sizes, planned for the shrunk model."""
    return [
        "experiment=paper",
        f"model.path={model_dir}",
        f"model.device={spec['device']}",
        f"trainer.prompts_per_step={spec['prompts']}",
        f"rollout.n={spec['n']}",
        f"rollout.max_prompt_len={spec['prompt_len']}",
        f"rollout.max_new_tokens={spec['new_tokens']}",
        f"algorithm.micro_batch_size={spec['micro']}",
        "car.enable=false",
        "eval.every=0",
    ]


def bench_memory(
    steps: int = 1,
    overrides: list[str] | None = None,
    partial: Path | None = None,
    configs: list[str] | None = None,
    shrink: int = 16,
    prompts: int = 2,
    n: int = 4,
    micro: int = 1,
    prompt_len: int = 512,
    new_tokens: int = 3072,
    gen_tokens: int | None = None,
    device: str = "cpu",
) -> dict:
    """Planned vs measured peak memory per stage for each config (module docstring)."""
    if overrides:
        raise InputError(
            "bench memory takes no config overrides (its sizes are its options)", found=overrides
        )
    if device not in ("cpu", "cuda"):
        raise InputError(key="--device", found=device, expected="cpu or cuda")
    if device == "cuda" and not _cuda_available():
        raise InputError("torch sees no CUDA device here", key="--device", found=device)
    spec = {
        "device": device,
        "shrink": shrink,
        "prompts": prompts,
        "n": n,
        "micro": micro,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "gen_tokens": gen_tokens or new_tokens,
    }
    sources = [config_source(name, shrink) for name in configs or BACKBONES]  # all, first
    results = {}
    for source in sources:
        print(f"bench memory: {source.name}", file=sys.stderr, flush=True)
        results[source.name] = _run_worker(source, spec)
        if partial is not None:
            partial.write_text(json.dumps({"partial": True, "configs": results}, indent=2))
    ratios = [r["peak_ratio_max_dev"] for r in results.values()]
    method = (
        "CUDA peak allocated memory per stage (torch.cuda.max_memory_allocated), fresh "
        "process per config; bf16 on the GPU"
        if device == "cuda"
        else "RSS high-water mark per stage (Linux /proc), fresh process per config, "
        f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; fp32 on the CPU"
    )
    return {
        "benchmark": "memory",
        "method": method,
        "sizes": spec,
        "shortened": _shortened(spec),
        "configs": results,
        "not_measured": {
            "car": "off in the benchmark (car.enable=false, planned without it)",
            "validation": "off (eval.every=0); the generation stage is the same code",
            "optimizer_step": "inside `update` (ppo_update ends with the AdamW step): "
            "planned as the larger of the two",
            "decode row drop": "no row ends early, so the copy made when finished rows are "
            "dropped (one layer's K or V at a time) is not exercised",
        },
        "target": f"measured peak within {TARGET:.0%} of planned, every stage",
        "meets_target": all(r <= TARGET for r in ratios),
    }


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _shortened(spec: dict) -> str | None:
    notes = []
    if (spec["prompt_len"], spec["new_tokens"]) != (512, 3072):
        notes.append(
            f"scoring and update at {spec['prompt_len']} + {spec['new_tokens']} tokens "
            "instead of the paper's 512 + 3072"
        )
    if spec["gen_tokens"] != spec["new_tokens"]:
        notes.append(
            f"generation decodes {spec['gen_tokens']} new tokens, not {spec['new_tokens']} "
            "(CPU time: one decode step per token), and is planned at that length"
        )
    return "; ".join(notes) or None


def _run_worker(source: Path, spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        config = shrunk_config(source, spec["shrink"])
        (model_dir / "config.json").write_text(json.dumps(config))
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        job = json.dumps({"model_dir": str(model_dir), **spec})
        done = subprocess.run(
            [sys.executable, "-m", "omgrpo.tools.memory_bench", job],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"bench memory: the worker for {source} failed ({done.returncode}); "
                "its error is printed above"
            )
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result["source"] = str(source)
    result["shrunk_config"] = {
        k: config[k]
        for k in (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
        )
    }
    return result


# ----------------------------------------------------------------------------------------
# The worker (a fresh process per config)
# ----------------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


class PeakRSS:
    """The peak RSS of a block above the RSS it started from, in bytes (`transient`)."""

    def __enter__(self) -> PeakRSS:
        import gc

        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        self.start = _status_kib("VmRSS") * 1024
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.transient = max(0, _status_kib("VmHWM") * 1024 - self.start)


class PeakCuda:
    """CUDA's peak allocated memory in a block above what was allocated at its start, in bytes
    (`transient`), and the caching allocator's reserved peak (`reserved`)."""

    def __enter__(self) -> PeakCuda:
        import gc

        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        import torch

        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        self.transient = max(0, torch.cuda.max_memory_allocated() - self.start)
        self.reserved = torch.cuda.max_memory_reserved()
        # a stage that does not fit the card is a result (its peak is where it failed); the
        # other stages are still measured
        self.out_of_memory = exc_type is not None and issubclass(
            exc_type, torch.cuda.OutOfMemoryError
        )
        return self.out_of_memory


def _measure(spec: dict) -> dict:
    import gc

    import torch
    from transformers import AutoConfig

    from omgrpo.backends.native.update import ppo_update
    from omgrpo.config import compose
    from omgrpo.generation.rollout import Sequences, response_logprobs, sample
    from omgrpo.models.loading import resolve_dtype

    cfg = compose(plan_overrides(Path(spec["model_dir"]), spec))
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    dtype = resolve_dtype(cfg.model.dtype, device)  # the dtype the plan assumes
    Peak = PeakCuda if cuda else PeakRSS
    if not cuda:
        torch.set_num_threads(1)  # a shared CPU: threads only contend (memory is the same)
    config = AutoConfig.from_pretrained(spec["model_dir"])
    vocab = config.vocab_size

    def update(seqs, ref_logprobs) -> None:
        policy.train()
        ppo_update(
            policy, optimizer, seqs, None, ref_logprobs, update_batch(seqs), cfg.algorithm, 1.0
        )

    def warm_up() -> None:  # gradients and AdamW state exist after it (the steady state)
        seqs = sample(policy.eval(), [[2, 3]], n=1, max_new_tokens=2, **_sampling(1.0))
        update(seqs, response_logprobs(ref, seqs)["logprobs"])

    # a throwaway round first: the modeling code, kernels and thread pools load outside the
    # baseline, so the resident figure is the models' and optimizer's memory
    policy, ref, optimizer = _build(config, device, dtype)
    warm_up()
    del policy, ref, optimizer
    gc.collect()
    base = _allocated(cuda)
    torch.manual_seed(0)
    policy, ref, optimizer = _build(config, device, dtype)
    warm_up()
    gc.collect()
    resident = _allocated(cuda) - base
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab, (spec["prompts"], spec["prompt_len"]), generator=g)
    stages = {}
    generated, chunk, stages["generation"] = _generate(policy.eval(), prompts, spec, cfg, Peak)
    assert generated.response_mask.all(), "every row should run to max_new_tokens"
    # scoring and update at the full response length: random response tokens (memory does
    # not depend on their values), the generated rows' prompts
    rows = len(generated)
    response = torch.randint(2, vocab, (rows, spec["new_tokens"]), generator=g)
    seqs = Sequences(
        generated.prompt_ids, generated.prompt_mask, response, torch.ones_like(response)
    )
    with Peak() as scoring:
        ref_logprobs = response_logprobs(ref, seqs, spec["micro"])["logprobs"]
    stages["scoring"] = scoring
    # two micro-batches, as in training: the second runs beside the first's gradients and
    # accumulates into them (one micro-batch alone would miss what the first leaves alive)
    used = min(rows, 2 * spec["micro"])
    part = seqs.select(slice(0, used))
    with Peak() as upd:
        update(part, ref_logprobs[:used])
    stages["update"] = upd
    policy.gradient_checkpointing_disable()
    with Peak() as plain:
        update(part, ref_logprobs[:used])
    stages["update_no_checkpointing"] = plain
    return {
        "resident": resident,
        "generation_chunk_rows": chunk,
        "update_rows": used,
        "stages": _stage_figures(stages),
    }


def _generate(policy, prompts, spec: dict, cfg, Peak) -> tuple:
    """The generation stage: (the rows, the rows decoded at once, its measurement)."""
    from omgrpo.generation.budget import model_chunk_rows
    from omgrpo.generation.rollout import sample

    # the rows decoded at once, sized from the memory free now as in training: on a card
    # smaller than the plan assumed it can be fewer than all, and the plan then compares with
    # that chunk
    chunk = model_chunk_rows(
        policy,
        rows=spec["prompts"] * spec["n"],
        group=spec["n"],
        prompt_len=spec["prompt_len"],
        new_tokens=spec["gen_tokens"],
        top_p=cfg.rollout.top_p,
    )
    with Peak() as gen:
        generated = sample(
            policy,
            prompts.tolist(),
            n=spec["n"],
            max_new_tokens=spec["gen_tokens"],
            batch_size=chunk,
            **_sampling(cfg.rollout.top_p),
        )
    return generated, chunk, gen


def _allocated(cuda: bool) -> int:
    """Bytes in use now: CUDA's allocated memory, or the process's RSS on the CPU."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    return _status_kib("VmRSS") * 1024


def _build(config, device, dtype) -> tuple:
    """The policy (checkpointing on), the frozen reference and AdamW, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    with device:  # built on the device: a 7B model's random init on the CPU takes minutes
        policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
        ref = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    policy.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    return policy, ref.requires_grad_(False), optimizer


def _stage_figures(stages: dict) -> dict:
    return {
        k: {
            "transient": v.transient,
            "seconds": v.seconds,
            "reserved": getattr(v, "reserved", None),
            "out_of_memory": getattr(v, "out_of_memory", False),
        }
        for k, v in stages.items()
    }


def _sampling(top_p: float) -> dict:
    # eos -1 never matches a token: every row decodes to max_new_tokens (the plan's case)
    return {"temperature": 1.0, "top_p": top_p, "eos_id": [-1], "pad_id": 0}


def update_batch(seqs) -> SimpleNamespace:
    """What `ppo_update` reads of a scored step (`omgrpo.core.step.StepBatch`'s fields): the
    advantages, the token roles (the last 4 response tokens of every row play the answer span,
    masked as OM-GRPO masks it), and no generic token mask or DAPO sample mask."""
    import torch

    from omgrpo.core.step import Responses

    mask = seqs.response_mask
    none = torch.zeros_like(mask, dtype=torch.bool)
    answer = none.clone()
    answer[:, -4:] = True
    responses = Responses(seqs.response_ids, mask, answer, [], [], none, none)
    advantages = torch.linspace(-1.0, 1.0, len(seqs))
    return SimpleNamespace(
        advantages=advantages,
        responses=responses,
        format_advantages=None,
        token_mask=None,
        sample_mask=None,
    )


def compare(spec: dict, measured: dict) -> dict:
    """Planned vs measured per stage: the peak is the resident state plus the transient."""
    import dataclasses

    from omgrpo.config import compose
    from omgrpo.models.memory import (
        GIB,
        chunk_generation_bytes,
        model_shape,
        resident_bytes,
        sizes_from_config,
        stage_transients,
    )

    cfg = compose(plan_overrides(Path(spec["model_dir"]), spec))
    shape = model_shape(spec["model_dir"])
    sizes = sizes_from_config(cfg, spec["device"])
    planned = stage_transients(shape, sizes)
    chunk = measured.get("generation_chunk_rows") or sizes.rows  # the rows decoded at once
    decoded = dataclasses.replace(sizes, new_tokens=spec["gen_tokens"])
    plan_generation = chunk_generation_bytes(shape, decoded, chunk, sizes.n, sizes.top_p)
    plain = stage_transients(shape, dataclasses.replace(sizes, checkpointing=False))
    planned_update = max(planned["update"][1], planned["optimizer_step"][1])
    plain_update = max(plain["update"][1], plain["optimizer_step"][1])
    plan_transient = {
        "generation": plan_generation,
        "scoring": planned["scoring"][1],
        "update": planned_update,
        "update_no_checkpointing": plain_update,
    }
    plan_resident = sum(resident_bytes(shape, sizes).values())
    out: dict = {}
    for stage, got in measured["stages"].items():
        plan_peak = plan_resident + plan_transient[stage]
        got_peak = measured["resident"] + got["transient"]
        out[stage] = {
            "planned_transient_gib": round(plan_transient[stage] / GIB, 4),
            "measured_transient_gib": round(got["transient"] / GIB, 4),
            "transient_ratio": round(got["transient"] / plan_transient[stage], 3),
            "planned_peak_gib": round(plan_peak / GIB, 4),
            "measured_peak_gib": round(got_peak / GIB, 4),
            "peak_ratio": round(got_peak / plan_peak, 3),
            "seconds": round(got["seconds"], 1),
        }
        if got.get("reserved") is not None:
            out[stage]["measured_reserved_peak_gib"] = round(got["reserved"] / GIB, 4)
        if got.get("out_of_memory"):  # the measured figures are where it failed: no ratio
            out[stage] = {"out_of_memory": True, **out[stage]}
            for key in ("transient_ratio", "peak_ratio"):
                out[stage][key] = None
    generated = sizes.rows * spec["gen_tokens"]
    out["generation"]["rollout_tokens_per_s"] = round(
        generated / max(measured["stages"]["generation"]["seconds"], 1e-9), 1
    )
    return {
        "parameters": shape.params,
        "dtype": sizes.dtype,
        "rows_generated": sizes.rows,
        "generation_chunk_rows": chunk,
        "update_rows": measured["update_rows"],
        "update_micro_batch_rows": sizes.micro,
        "planned_resident_gib": round(plan_resident / GIB, 4),
        "measured_resident_gib": round(measured["resident"] / GIB, 4),
        "stages": out,
        "peak_ratio_max_dev": round(
            max((abs(s["peak_ratio"] - 1) for s in out.values() if s["peak_ratio"]), default=0),
            3,
        ),
        "out_of_memory": [stage for stage, s in out.items() if s.get("out_of_memory")],
    }


def worker_main(job: str) -> None:
    spec = json.loads(job)
    measured = _measure(spec)
    print(json.dumps(compare(spec, measured)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bench memory worker (one config)")
    parser.add_argument("job", help="JSON: model_dir and the sizes")
    from omgrpo.models.hf_import import hide_sklearn_from_transformers

    hide_sklearn_from_transformers()
    worker_main(parser.parse_args(argv).job)


if __name__ == "__main__":
    main()
