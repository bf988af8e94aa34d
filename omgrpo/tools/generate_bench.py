"""`omgrpo bench generate`: the rollout decoder's speed against the memory-bandwidth limit.

For each model config (random weights from a `config.json`; on the CPU every width divided by
`--shrink`, layers and heads kept) it samples `prompts x rollouts` rows of `--gen-tokens` new
tokens after random prompts of `--prompt-len` tokens, every row decoding to full length (the
stop token is one no row draws), and reports:

- `rollout_tokens_per_s` (rows x new tokens / generation seconds) and `ms_per_decode_step`
  ((seconds for all tokens - seconds for one) / (tokens - 1): the prefill excluded);
- `limit`: the closed-form floor of a decode step when it is bound by memory traffic: every
  parameter read once per step plus the K/V cache read once, a prompt's K/V once per group (the
  decoder shares it) and each row's own K/V at the mean response length ((T + 1) / 2), over the
  device's bandwidth (`NOMINAL_BANDWIDTH` for the cards named there, else the copy bandwidth
  measured in the same process); `measured_over_limit` = limit seconds / measured seconds;
- per decode step, from profiling 4 and 36 new tokens: `ops_per_step`, the operations that
  launch a kernel (`count_kernel_ops`: PyTorch's leaf operators that compute, an operator that
  is one fused kernel on CUDA counted once), and `host_reads_per_step`, the reads of device
  values by the host (`HostReads`: each would stall the decode loop on a GPU); on CUDA also the
  CUDA runtime's kernel and graph launches and synchronisations;
- on CUDA, peak allocated and reserved memory during generation and their ratio;
- `compile`: whether the decode step traces with `torch.compile(fullgraph=True)` (graph breaks
  from `torch._dynamo.explain`), for this tree.

`--toy` instead times the toy world's generation (the shipped toy base, the toy preset's
sampling and stop tokens, its prompts) at 16 x 8 and 64 x 8, the CPU's overhead-bound case.

`--compare REF` runs every measurement again with another omgrpo tree (a directory, or a commit
checked out into a temporary git worktree), each in a fresh process right after this tree's,
and reports new-over-old ratios measured in the same run. The measuring script uses only
`omgrpo.generation.rollout.sample`, which every tree since 14a048d has.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from omgrpo.errors import InputError
from omgrpo.tools.memory_bench import CONFIGS, shrunk_config

TREE = Path(__file__).resolve().parents[2]
PAPER_CHUNK = {"configs": ["qwen3-1.7b-base"], "prompts": 20, "n": 8, "prompt_len": 512}
# bytes per second by the vendors' datasheets (the GPUs this project is checked on)
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100": 3.35e12}
TOY_SHAPES = {"16x8": 16, "64x8": 64}
PROFILE_TOKENS = (4, 36)  # decode steps per step = the difference of two profiled runs / 32

# Operators that launch no kernel: views, metadata, allocation, and the dispatch wrappers whose
# work shows up as their children.
NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::as_strided",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::expand",
    "aten::expand_as",
    "aten::slice",
    "aten::select",
    "aten::narrow",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::unflatten",
    "aten::flatten",
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::resize_",
    "aten::result_type",
    "aten::to",
    "aten::type_as",
    "aten::contiguous",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",  # a host read (counted by `HostReads`), not a kernel
    "aten::unbind",
    "aten::view_as",
    "aten::broadcast_tensors",
    "aten::set_",
    "aten::is_same_size",
}
# Composite on the CPU, one kernel on CUDA: counted once, their children not at all.
FUSED_ON_CUDA = {"aten::_fused_rms_norm", "aten::scaled_dot_product_attention"}


def count_kernel_ops(events) -> int:
    """Operations that launch a kernel among profiler `events` (module docstring)."""

    def count(event) -> int:
        if event.name in FUSED_ON_CUDA:
            return 1
        below = sum(count(c) for c in event.cpu_children if c.name.startswith("aten::"))
        if below:  # a wrapper: its work is its children's
            return below
        return int(event.name.startswith("aten::") and event.name not in NO_KERNEL)

    roots = [e for e in events if e.name.startswith("aten::") and not _aten_parent(e)]
    return sum(count(e) for e in roots)


def _aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


# The measuring script, run in a fresh process with the tree under test first on the path. It
# must keep working against every tree since 14a048d: it uses `sample` alone from omgrpo.
_MEASURE = r"""
import json, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
spec = json.loads(open(sys.argv[1]).read())
sys.path.insert(0, spec["bench_tree"])
from omgrpo.tools.generate_bench import HostReads, count_kernel_ops, cuda_counts
from omgrpo.models.hf_import import hide_sklearn_from_transformers
hide_sklearn_from_transformers()  # before any model class is imported, by either tree
sys.path.pop(0)
for name in [m for m in sys.modules if m == "omgrpo" or m.startswith("omgrpo.")]:
    del sys.modules[name]  # the bench's helpers above come from the new tree; omgrpo from the one measured
import omgrpo
from omgrpo.generation.rollout import sample
from transformers import AutoConfig, AutoModelForCausalLM

torch.manual_seed(0)
torch.set_num_threads(spec["threads"])
device = torch.device(spec["device"])
cuda = device.type == "cuda"
dtype = getattr(torch, spec["dtype"])
if spec.get("model_dir"):
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device)
else:
    config = AutoConfig.for_model(**spec["config"])
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
model.eval().requires_grad_(False)
prompts, n = spec["prompts"], spec["n"]

def run(tokens, seed=1):
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    seqs = sample(model, prompts, n=n, max_new_tokens=tokens, temperature=spec["temperature"],
                  top_p=spec["top_p"], eos_id=spec["eos"], pad_id=spec["pad"], seed=seed)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, seqs

T = spec["gen_tokens"]
run(min(8, T))  # warm-up: kernels, allocator, lazy initialisations
one = statistics.median(run(1)[0] for _ in range(3))
if cuda:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
times, generated, width = [], 0, 0
for r in range(spec["repeats"]):
    seconds, seqs = run(T, seed=1 + r)
    times.append(seconds)
    generated, width = int(seqs.response_mask.sum()), seqs.response_ids.shape[1]
full = statistics.median(times)
out = {"seconds": full, "seconds_rounds": times, "prefill_seconds": one, "tokens": generated,
       "rollout_tokens_per_s": generated / full,
       "ms_per_decode_step": 1000 * (full - one) / max(1, width - 1), "decode_steps": width}
if cuda:
    out["peak_allocated_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    out["peak_reserved_gib"] = (torch.cuda.max_memory_reserved() - base) / 2**30
    out["reserved_over_allocated"] = torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated()
if spec["profile"]:
    counts = []
    for tokens in spec["profile_tokens"]:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with HostReads() as reads, profile(activities=acts) as prof:
            run(tokens)
        events = prof.events()
        one_run = {"ops": count_kernel_ops(events), "host_reads": reads.count,
                   "nonzero": sum(e.name == "aten::nonzero" for e in events)}
        if cuda:
            one_run.update(cuda_counts(events))
        counts.append(one_run)
    steps = spec["profile_tokens"][1] - spec["profile_tokens"][0]
    per = {k: (counts[1][k] - counts[0][k]) / steps for k in counts[0]}
    out["ops_per_step"] = per.pop("ops")
    out["host_reads_per_step"] = per.pop("host_reads") + per.pop("nonzero")
    out.update({f"cuda_{k}_per_step": v for k, v in per.items()})
out["source"] = omgrpo.__file__
print("BENCH-RESULT " + json.dumps(out))
"""


class HostReads:
    """Counts, while active, the calls that read a tensor's values on the host (`item`,
    `tolist`, `cpu`, `bool` / `int` / `float` / index conversion): on a GPU each waits for the
    device. `aten::nonzero` (an output size the host must know) is counted from the profiler."""

    METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self) -> HostReads:
        self.count, self._saved = 0, {}
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(tensor, *args, _real=real, **kwargs):
                self.count += 1
                return _real(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


def cuda_counts(events) -> dict:
    """CUDA runtime calls among profiler events: kernel launches, graph launches, and calls
    that make the host wait for the device."""
    names = [e.name for e in events]
    return {
        "kernel_launches": sum("LaunchKernel" in n for n in names),
        "graph_launches": sum(n.startswith(("cudaGraphLaunch", "cuGraphLaunch")) for n in names),
        "syncs": sum(
            n.startswith(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
            or n in ("cudaMemcpy", "cuMemcpyDtoH_v2")
            for n in names
        ),
    }


def bandwidth_limit(config: dict, params: int, dtype_bytes: int, spec: dict, bandwidth: float):
    """The memory-traffic floor of one decode step (module docstring), in closed form."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_per_token = layers * 2 * kv_heads * head_dim * dtype_bytes
    rows = spec["prompts"] * spec["n"]
    mean_own = (spec["gen_tokens"] + 1) / 2
    weights = params * dtype_bytes
    kv = kv_per_token * (spec["prompts"] * spec["prompt_len"] + rows * mean_own)
    seconds = (weights + kv) / bandwidth
    return {
        "weight_bytes": weights,
        "kv_bytes_per_step": kv,
        "bandwidth_bytes_per_s": bandwidth,
        "ms_per_decode_step": 1000 * seconds,
        "rollout_tokens_per_s": rows / seconds,
    }


def device_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where from): the datasheet's figure for a known card, else a device-to-device
    copy measured here (bytes read + written over the time; the CPU's memory on the CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in NOMINAL_BANDWIDTH.items():
            if key in name:
                return value, f"datasheet ({name})"
    x = torch.empty(2**28 if device.type == "cuda" else 2**25, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return 2 * x.numel() / min(seconds), "measured copy"


@contextlib.contextmanager
def tree_of(ref: str | None):
    """The omgrpo tree to compare with: a directory, or a commit checked out into a temporary
    git worktree (removed afterwards)."""
    if ref is None:
        yield None
        return
    if Path(ref).is_dir():
        yield Path(ref).resolve()
        return
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "tree"
        made = subprocess.run(
            ["git", "-C", str(TREE), "worktree", "add", "--detach", str(where), ref],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:  # checked before anything is measured
            why = (made.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
            raise InputError(
                why,
                key="--compare",
                found=ref,
                expected=f"a directory or a commit of the git repository at {TREE}",
            )
        try:
            yield where
        finally:
            subprocess.run(
                ["git", "-C", str(TREE), "worktree", "remove", "--force", str(where)],
                capture_output=True,
            )


def _measure(spec: dict, tree: Path) -> dict:
    from omgrpo.tools.bench import _run_script

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**spec, "bench_tree": str(TREE)}, f)
    try:
        return _run_script(_MEASURE, [f.name], tree)
    finally:
        Path(f.name).unlink()


def _random_prompts(vocab: int, prompts: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (prompts, length), generator=generator).tolist()


def bench_generate(
    steps: int = 1,
    overrides: list[str] | None = None,
    partial: Path | None = None,
    configs: list[str] | None = None,
    device: str = "cpu",
    shrink: int = 16,
    prompts: int = 2,
    n: int = 4,
    prompt_len: int = 64,
    gen_tokens: int = 64,
    compare: str | None = None,
    toy: bool = False,
    repeats: int = 3,
) -> dict:
    """Decoder speed per config (or the toy shapes with `toy`), new vs `compare` (docstring)."""
    if overrides:
        raise InputError(
            "bench generate takes no config overrides (its sizes are its options)",
            found=overrides,
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("torch sees no CUDA device here", key="--device", found=device)
    if min(prompts, n, prompt_len, repeats) < 1 or gen_tokens < 2:
        raise InputError("bench generate: sizes must be >= 1 and --gen-tokens >= 2")
    result: dict = {"benchmark": "generate", "device": device, "compare": compare}
    with tree_of(compare) as old_tree:
        if toy:
            result["toy"] = _bench_toy(old_tree, repeats, partial, result)
        else:
            sizes = dict(prompts=prompts, n=n, prompt_len=prompt_len, gen_tokens=gen_tokens)
            result["sizes"] = {**sizes, "shrink": shrink if device == "cpu" else 1}
            result["configs"] = {}
            for name in configs or ["qwen3-1.7b-base"]:
                source = Path(name) if Path(name).is_dir() else CONFIGS / name
                if not (source / "config.json").is_file():
                    raise FileNotFoundError(f"bench generate: no config.json in {source}")
                figures = _bench_config(source, device, shrink, sizes, repeats, old_tree, partial)
                result["configs"][source.name] = figures
                if partial is not None:
                    partial.write_text(json.dumps({"partial": True, **result}, indent=2))
    return result


def _bench_config(
    source: Path, device: str, shrink: int, sizes: dict, repeats, old, partial=None
) -> dict:
    print(f"bench generate: {source.name} on {device}", file=sys.stderr, flush=True)
    on_cpu = device == "cpu"
    config = (
        shrunk_config(source, shrink)
        if on_cpu
        else json.loads((source / "config.json").read_text())
    )
    dtype = "float32" if on_cpu else "bfloat16"
    spec = {
        **sizes,
        "config": config,
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompts": _random_prompts(config["vocab_size"], sizes["prompts"], sizes["prompt_len"]),
        "temperature": 1.0,
        "top_p": 1.0,
        "eos": [-1],  # no row draws it: every row decodes to full length
        "pad": 0,
        "repeats": repeats,
        "profile": True,
        "profile_tokens": list(PROFILE_TOKENS),
    }
    out = {"new": _measure(spec, TREE)}
    if partial is not None:  # this tree's figures survive a baseline that runs out of time
        partial.write_text(json.dumps({"partial": True, source.name: out}, indent=2))
    if old is not None:
        print(f"bench generate: {source.name} with {old}", file=sys.stderr, flush=True)
        out["old"] = _measure(spec, old)
        out["speedup"] = out["old"]["seconds"] / out["new"]["seconds"]
    params = _param_count(config)
    bandwidth, where = device_bandwidth(torch.device(device))
    limit = bandwidth_limit(config, params, 4 if on_cpu else 2, sizes, bandwidth)
    out["limit"] = {**limit, "bandwidth_from": where, "parameters": params}
    for side in ("new", "old"):
        if side in out:
            ms = out[side]["ms_per_decode_step"]
            out[side]["measured_over_limit"] = limit["ms_per_decode_step"] / ms
    if on_cpu:
        out["compile"] = compile_check(config)
    return out


def _param_count(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


def compile_check(config: dict) -> dict:
    """Whether one decode step of this tree's decoder (forward, sampling, the stop rule,
    the bookkeeping: what a CUDA graph captures) traces as one graph with
    `torch.compile(fullgraph=True)`; dynamo's graph-break count from `torch._dynamo.explain`."""
    import torch._dynamo
    from transformers import AutoConfig, AutoModelForCausalLM

    from omgrpo.generation import engine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    prompts = _random_prompts(config["vocab_size"], 2, 16)
    with torch.no_grad():  # as `sample` builds it: the fused projections
        logits, cache, mask, pos = engine.prefix_tree_forward(model, prompts, [[0, 0]], 0)
        kv = engine._LeanKV(model, cache, mask, pos, 2, 16, engine.WIDTH_BUCKET)
    uniforms = engine.row_uniforms(0, 4, 16)
    stop_ids = torch.tensor([-1])
    rows = engine._Rows(4, 16, 0, torch.device("cpu"), uniforms, 1.0, 1.0, stop_ids)
    rows.sample(logits[:, -1].repeat_interleave(2, 0))

    def step() -> None:
        rows.sample(kv.forward(rows.tok))

    with torch.no_grad():
        explained = torch._dynamo.explain(step)()
        torch._dynamo.reset()
        try:
            torch.compile(step, fullgraph=True, backend="eager")()
            fullgraph, error = True, None
        except Exception as exc:  # a graph break under fullgraph=True raises; report it
            fullgraph, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        torch._dynamo.reset()
    return {
        "graph_breaks": explained.graph_break_count,
        "graphs": explained.graph_count,
        "fullgraph": fullgraph,
        "error": error,
    }


def _bench_toy(old: Path | None, repeats: int, partial, result: dict) -> dict:
    """Toy generation at 16 x 8 and 64 x 8: the toy preset's base, prompts and sampling."""
    from omgrpo.config import compose
    from omgrpo.generation.engine import stop_token_ids

    cfg = compose(["experiment=toy"])
    model_dir, tokenizer, model = _toy_base(cfg)
    texts = _toy_prompts(cfg, tokenizer, max(TOY_SHAPES.values()))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    base_spec = {
        "model_dir": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "n": cfg.rollout.n,
        "gen_tokens": cfg.rollout.max_new_tokens,
        "prompt_len": max(map(len, ids)),
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "eos": stop_token_ids(tokenizer, model),
        "pad": tokenizer.pad_token_id or 0,
        "repeats": repeats,
        "profile": False,
        "profile_tokens": list(PROFILE_TOKENS),
    }
    out = {}
    for shape, count in TOY_SHAPES.items():
        spec = {**base_spec, "prompts": ids[:count]}
        print(f"bench generate: toy {shape}", file=sys.stderr, flush=True)
        out[shape] = {"new": _measure(spec, TREE)}
        if old is not None:
            out[shape]["old"] = _measure(spec, old)
            out[shape]["speedup"] = out[shape]["old"]["seconds"] / out[shape]["new"]["seconds"]
        if partial is not None:
            partial.write_text(json.dumps({"partial": True, **result, "toy": out}, indent=2))
    out["model_dir"] = str(model_dir)
    return out


def _toy_base(cfg):
    """(directory, tokenizer, model) of the toy preset's base (trained on first use)."""
    from omgrpo.models.loading import base_model_dir, load_model, load_tokenizer
    from omgrpo.tasks import load_task

    directory = base_model_dir(cfg.model, cfg.task, load_task(cfg.task))
    model = load_model(directory, torch.device("cpu"), torch.float32)
    return Path(directory).resolve(), load_tokenizer(directory), model


def _toy_prompts(cfg, tokenizer, count: int) -> list[str]:
    """The rendered chat prompts of the first `count` training problems."""
    from omgrpo.core.prompt import render_prompt
    from omgrpo.tasks import load_task

    problems = load_task(cfg.task).train[:count]
    return [render_prompt(tokenizer, p.question) for p in problems]
