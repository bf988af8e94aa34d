"""Benchmarks with JSON output (`omgrpo bench <name> [--json]`); speed targets live here, not in
unit tests. Each benchmark runs the real trainer on the toy preset.

`step`: seconds per training step by stage (gen, car, old/ref log-probs, reward, adv, update),
  rollout tokens/s and peak memory for majority voting at 16 x 8 and 64 x 8 (prompts x rollout.n),
  each shape in a fresh process (so peak memory is that shape's). `--baseline DIR` runs the same
  shapes with the omgrpo source tree in DIR (e.g. a `git worktree` of an older commit) right
  after, and reports new-over-old speed-ups measured in the same run (`--new-only KEY=VALUE`:
  overrides the baseline does not know, e.g. `model.tokenizer=char`). `--vs-trl` also runs TRL's
  `GRPOTrainer` (the `bench` extra) on the same base model, prompts, G, max new tokens,
  temperature, top-p, beta, clip and learning rate, each shape right after omgrpo's, and reports
  `trl_over_omgrpo` = TRL's wall seconds per step / omgrpo's (`perf/step_wall_s`).
  `--repeats N` measures each shape in N interleaved rounds (new, baseline, TRL, new, ...):
  figures are per-key medians over the rounds and each ratio the median of the rounds' ratios
  (listed under `ratio_rounds`), so a slow patch of a shared machine that hits one side of one
  round does not decide a ratio.

`car`: the cost of CAR against its alternatives, per training step:
  (a) majority voting, (b) OM-GRPO without CAR, (c) OM-GRPO with CAR, (d) OM-GRPO without CAR
  at n = 16 and n = 64 rollouts per prompt. Reports mean seconds per stage (the first step is
  a warm-up and is dropped) and the ratios `car_over_gen` = time/car / time/gen in (c) and
  `step_car_over_mv` = time/step (c) / (a); `--variants` picks a subset (a and c always). Also
  CAR's achieved matmul FLOP/s against a dense matmul in the same process (`throughput`).

`memory`: the memory planner against a measurement on the CPU: the three backbones with their
  real layer count and attention layout and every width divided by 16, one step at the paper's
  lengths, the peak RSS of each stage against the plan (`omgrpo.tools.memory_bench`). On a GPU
  (`--device cuda --shrink 1`): the real models in bf16, CUDA's peak allocated memory per stage,
  and rollout tokens/s.

`generate`: the rollout decoder against the memory-bandwidth limit: tokens/s, ms per decode
  step, kernel-launching operations and host reads per step, whether the step compiles as one
  graph; `--compare REF` measures another tree (directory or commit) in the same run, `--toy`
  the toy world's generation at 16 x 8 and 64 x 8 (`omgrpo.tools.generate_bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from omgrpo.config import compose
from omgrpo.errors import InputError, check_int
from omgrpo.tracking.provenance import collect_provenance
from omgrpo.tracking.store import RunStore

CAR_VARIANTS = {
    "a_mv": ["method=mv"],
    "b_om_grpo_no_car": ["method=om_grpo_no_car"],
    "c_om_grpo_car": ["method=om_grpo"],
    "d_om_grpo_n16": ["method=om_grpo_no_car", "rollout.n=16"],
    "d_om_grpo_n64": ["method=om_grpo_no_car", "rollout.n=64"],
}


def _fixed(steps: int, overrides: list[str] | None) -> list[str]:
    """Overrides of every benchmark run: no validation, trackers, checkpoints or progress bar."""
    return [
        "eval.every=0",
        "trainer.progress=false",
        "tracking.mlflow=false",
        "tracking.wandb=false",
        "trainer.save_every=0",
        f"trainer.steps={steps}",
        *(overrides or []),
    ]


def bench_car(
    steps: int = 3,
    overrides: list[str] | None = None,
    partial: Path | None = None,
    variants: list[str] | None = None,
) -> dict:
    from omgrpo.backends.native.trainer import train

    fixed = _fixed(steps, overrides)
    chosen = variants or list(CAR_VARIANTS)
    unknown = sorted(set(chosen) - set(CAR_VARIANTS))
    if unknown or not {"a_mv", "c_om_grpo_car"} <= set(chosen):
        raise InputError(
            f"bench car --variants: unknown {unknown}; valid: {', '.join(CAR_VARIANTS)} "
            "(a_mv and c_om_grpo_car are always needed)"
        )
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in chosen:
            variant = CAR_VARIANTS[name]
            print(f"bench car: {name} ({steps} steps)", file=sys.stderr, flush=True)
            run = train(compose([*fixed, *variant, f"run.root={root}", f"run.name={name}"]))
            df = RunStore(run).read_metrics()
            df = df[df["train/step"] >= (2 if steps > 1 else 1)]
            cols = [c for c in df.columns if c.startswith(("time/", "mem/"))]
            results[name] = {c: float(df[c].mean()) for c in cols}
            results[name]["rollouts_per_step"] = float(
                compose([*fixed, *variant]).rollout.n * compose(fixed).trainer.prompts_per_step
            )
            if partial is not None:  # long variants (n = 64) should not lose finished ones
                partial.write_text(json.dumps({"partial": True, "seconds": results}, indent=2))
    c, a = results["c_om_grpo_car"], results["a_mv"]
    ratios = {
        "car_over_gen": c["time/car"] / c["time/gen"],
        "step_car_over_mv": c["time/step"] / a["time/step"],
        **{
            f"step_{name[2:]}_over_car": results[name]["time/step"] / c["time/step"]
            for name in ("d_om_grpo_n16", "d_om_grpo_n64")
            if name in results
        },
    }
    # CPU targets: all-pairs CAR at most 1.5x generation, a CAR step at most 2x an MV step
    targets = {"car_over_gen": 1.5, "step_car_over_mv": 2.0}
    return {
        "benchmark": "car",
        "steps_averaged": max(1, steps - 1),
        "overrides": overrides or [],
        "seconds": results,
        "ratios": ratios,
        "targets": targets,
        "meets_targets": {k: ratios[k] <= v for k, v in targets.items()},
        "throughput": car_throughput(compose([*fixed, "method=om_grpo"])),
    }


def car_throughput(cfg, repeats: int = 2) -> dict:
    """CAR's achieved matmul FLOP/s on one step's pairs against a dense fp32 matmul in the same
    process. FLOPs are counted by `torch.utils.flop_counter` (matmuls and attention; the
    element-wise work is not counted), on rollouts sampled from the base for the first
    `prompts_per_step` training problems."""
    from omegaconf import OmegaConf
    from torch.utils.flop_counter import FlopCounterMode

    from omgrpo.generation.car import generate_pair_answers
    from omgrpo.generation.rollout import sample, stop_token_ids
    from omgrpo.models.loading import base_model_dir, load_model, load_tokenizer, resolve_device
    from omgrpo.tasks import load_task, render_prompt

    splits = load_task(cfg.task)
    base = base_model_dir(cfg.model, cfg.task, splits)
    device = resolve_device(cfg.model.device)
    tokenizer = load_tokenizer(base)
    model = load_model(base, device, torch.float32).eval()
    problems = splits.train[: cfg.trainer.prompts_per_step]
    G = cfg.rollout.n
    torch.manual_seed(cfg.seed)
    seqs = sample(
        model,
        [tokenizer(render_prompt(tokenizer, p.question))["input_ids"] for p in problems],
        n=G,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        eos_id=stop_token_ids(tokenizer, model),
        pad_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(seqs.response_ids, skip_special_tokens=True)
    groups = [(p.question, texts[g * G : (g + 1) * G]) for g, p in enumerate(problems)]
    # Counted with eager attention: the counter does not see the CPU SDPA kernel's matmuls.
    eager = OmegaConf.merge(cfg.car, {"prefer_sdpa": False})
    with FlopCounterMode(display=False) as counter:
        generate_pair_answers(model, tokenizer, groups, eager, rng=0)
    seconds = min(
        _seconds(lambda: generate_pair_answers(model, tokenizer, groups, cfg.car, rng=0))
        for _ in range(repeats)
    )
    n = 1024
    x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    dense = min(_seconds(lambda: x @ y) for _ in range(5))
    car_flops = counter.get_total_flops() / seconds
    matmul_flops = 2 * n**3 / dense
    return {
        "car_gflop_per_s": car_flops / 1e9,
        "matmul_gflop_per_s": matmul_flops / 1e9,
        "car_share_of_matmul": car_flops / matmul_flops,
        "car_gflop": counter.get_total_flops() / 1e9,
        "car_seconds": seconds,
    }


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


STEP_SHAPES = {"16x8": ["trainer.prompts_per_step=16"], "64x8": ["trainer.prompts_per_step=64"]}

# Runs in a fresh process: `train()` on the given overrides, then the mean of every timing column
# over the steps after the first (a warm-up). Only uses APIs that older trees have too (or skips
# them), so the same script measures a baseline checkout.
_MEASURE = """
import json, sys, tempfile
from omgrpo.config import compose
from omgrpo.errors import InputError, check_int
from omgrpo.tracking.store import RunStore
from omgrpo.backends.native.trainer import train
steps, overrides = int(sys.argv[1]), sys.argv[2:]
try:  # transformers without scikit-learn, as in `omgrpo train` (not in older trees)
    from omgrpo.models.hf_import import hide_sklearn_from_transformers
    hide_sklearn_from_transformers()
except ImportError:
    pass
try:  # the grader's one-off warm-up (a few seconds) is not part of any step's time
    from omgrpo.core.answers import start_grader_warm_up
    warm = start_grader_warm_up()
    if warm is not None:
        warm.wait(timeout=120)
except ImportError:  # an older tree
    pass
with tempfile.TemporaryDirectory() as root:
    run = train(compose([*overrides, f"run.root={root}", "run.name=bench"]))
    df = RunStore(run).read_metrics()
df = df[df["train/step"] >= (2 if steps > 1 else 1)]
cols = [c for c in df.columns if c.startswith(("time/", "mem/", "perf/", "response/length"))]
result = {c: float(df[c].mean()) for c in cols}
import omgrpo, torch
result["source"] = omgrpo.__file__
result["threads"] = torch.get_num_threads()
print("BENCH-RESULT " + json.dumps(result))
"""


def _measure(overrides: list[str], steps: int, source: Path | None = None) -> dict:
    """Mean per-step figures of one shape, trained in a fresh process (`source`: the omgrpo tree
    to import, default this one)."""
    # `python -c` imports from its working directory first: run in the tree to measure.
    # this tree is the directory holding omgrpo/ (parents[2] of omgrpo/tools/bench.py)
    tree = Path(source or Path(__file__).resolve().parents[2]).resolve()
    return _run_script(_MEASURE, [str(steps), *overrides], tree)


def _measure_trl(overrides: list[str], steps: int) -> dict:
    """The same figures for TRL's GRPOTrainer on the same base and batch (`omgrpo.tools.trl_peer`)."""
    return _run_script(_TRL_MEASURE, [str(steps), *overrides], Path(__file__).resolve().parents[2])


def _run_script(script: str, argv: list[str], tree: Path) -> dict:
    """Run a measuring script in a fresh Python importing omgrpo from `tree`; its result line."""
    # the tree first; what the caller's path held (e.g. carried wheels) after it
    path = [str(tree.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("BENCH-RESULT "))
    return json.loads(line.removeprefix("BENCH-RESULT "))


# Runs TRL's GRPOTrainer in a fresh process on the base and settings of the omgrpo overrides;
# prints per-step wall seconds (the first step dropped, as for omgrpo).
_TRL_MEASURE = """
import json, sys
from omgrpo.tools.trl_peer import trl_step_seconds
print("BENCH-RESULT " + json.dumps(trl_step_seconds(int(sys.argv[1]), sys.argv[2:])))
"""


def bench_step(
    steps: int = 3,
    overrides: list[str] | None = None,
    partial: Path | None = None,
    baseline: Path | None = None,
    new_only: list[str] | None = None,
    vs_trl: bool = False,
    repeats: int = 1,
    shapes: list[str] | None = None,
) -> dict:
    if repeats < 1:
        raise InputError(key="--repeats", found=repeats, expected="an integer >= 1")
    if shapes is not None and (not shapes or set(shapes) - set(STEP_SHAPES)):
        expected = f"a comma-separated subset of {', '.join(STEP_SHAPES)}"
        raise InputError(key="--shapes", found=",".join(shapes), expected=expected)
    chosen = {shape: STEP_SHAPES[shape] for shape in (shapes or STEP_SHAPES)}
    fixed = _fixed(steps, ["method=mv", *(overrides or [])])
    # A relative cache dir would differ between this tree and the baseline's working dir.
    cache = Path(compose(fixed).model.cache_dir).resolve()
    fixed.append(f"model.cache_dir={cache}")
    result: dict = {"benchmark": "step", "steps_averaged": max(1, steps - 1), "overrides": fixed}
    result["new_only"] = new_only or []
    result["repeats"] = repeats
    result["new"], result["old"] = {}, {}
    rounds: dict[str, list[dict]] = {}
    for shape, extra in chosen.items():
        rounds[shape] = []
        new_args = [*fixed, *extra, *(new_only or [])]
        for k in range(repeats):
            tag = f" (round {k + 1}/{repeats})" if repeats > 1 else ""
            print(f"bench step: {shape} ({steps} steps){tag}", file=sys.stderr, flush=True)
            one = {"new": _measure(new_args, steps)}
            if baseline is not None:  # back to back with the new tree, same shape, same base
                print(f"bench step: {shape} baseline {baseline}{tag}", file=sys.stderr, flush=True)
                one["old"] = _measure([*fixed, *extra], steps, source=baseline)
            if vs_trl:
                print(f"bench step: {shape} TRL GRPOTrainer{tag}", file=sys.stderr, flush=True)
                one["trl"] = _measure_trl(new_args, steps)
            rounds[shape].append(one)
            for side in one:
                result.setdefault(side, {})[shape] = _median_figures(
                    [r[side] for r in rounds[shape]]
                )
            if partial is not None:
                partial.write_text(json.dumps({"partial": True, **result}, indent=2))
    per_round: dict[str, dict] = {shape: {} for shape in chosen}
    if baseline is not None:
        result["baseline"] = str(baseline)
        result["speedup"] = {}
        for shape, rs in rounds.items():
            ratios = {
                key: [r["old"][key] / r["new"][key] for r in rs]
                for key in ("time/step", "time/gen")
            }
            per_round[shape]["speedup"] = ratios
            result["speedup"][shape] = {k: statistics.median(v) for k, v in ratios.items()}
    else:
        del result["old"]
    if vs_trl:
        # both wall clock from one step's end to the next (omgrpo's `time/step` sums its timed
        # stages only)
        result["trl_over_omgrpo"] = {}
        for shape, rs in rounds.items():
            ratios = [r["trl"]["time/step"] / r["new"]["perf/step_wall_s"] for r in rs]
            per_round[shape]["trl_over_omgrpo"] = ratios
            result["trl_over_omgrpo"][shape] = statistics.median(ratios)
        result["trl_target"] = 3.0  # the speed goal: omgrpo >= 3x faster than TRL's GRPOTrainer
    if repeats > 1:
        result["ratio_rounds"] = per_round
    return result


def _median_figures(runs: list[dict]) -> dict:
    """Per numeric key, the median over repeated measurements of one side and shape (other
    values as in the first)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def bench_memory(steps: int = 1, overrides=None, partial=None, **kwargs) -> dict:
    from omgrpo.tools.memory_bench import bench_memory as run

    return run(steps=steps, overrides=overrides, partial=partial, **kwargs)


def bench_generate(**kwargs) -> dict:
    from omgrpo.tools.generate_bench import bench_generate as run

    return run(**kwargs)


BENCHMARKS = {
    "car": bench_car,
    "step": bench_step,
    "memory": bench_memory,
    "generate": bench_generate,
}


def _trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None


def _add_step_flags(parser: argparse.ArgumentParser) -> None:
    """`bench step`'s own flags."""
    parser.add_argument(
        "--baseline", type=Path, help="step: also measure the omgrpo tree in this directory"
    )
    parser.add_argument(
        "--new-only",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="step: an override for this tree only (keys the baseline does not know)",
    )
    parser.add_argument(
        "--vs-trl",
        action="store_true",
        help="step: also run TRL's GRPOTrainer on the same model and batch (the bench extra, without verl)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="step: interleaved rounds per shape; figures and ratios are medians over them",
    )
    parser.add_argument(
        "--shapes",
        type=lambda text: text.split(","),
        help=f"step: comma-separated subset of {', '.join(STEP_SHAPES)} (default: all)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omgrpo bench", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--steps", type=int, default=3, help="steps per variant (first dropped)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    _add_step_flags(parser)
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        help=f"car: comma-separated subset of {', '.join(CAR_VARIANTS)}",
    )
    parser.add_argument(
        "--configs",
        type=lambda text: text.split(","),
        help="memory: fixture names or directories with a config.json (default: the three backbones)",
    )
    parser.add_argument(
        "--gen-tokens",
        type=int,
        help="memory: new tokens the generation stage decodes (default: the response length)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="memory: measure RSS on the CPU (fp32) or CUDA's allocated memory on a GPU (bf16)",
    )
    parser.add_argument(
        "--shrink",
        type=int,
        default=16,
        help="memory: divide every width by this (1: the real model; default 16, for a CPU)",
    )
    parser.add_argument(
        "--prompts", type=int, default=2, help="memory: prompts generated (default 2)"
    )
    parser.add_argument(
        "--rollouts", type=int, default=4, help="memory: rollouts per prompt (default 4)"
    )
    parser.add_argument(
        "--micro", type=int, default=1, help="memory: rows per update micro-batch (default 1)"
    )
    parser.add_argument(
        "--compare",
        metavar="REF",
        help="generate: also measure this omgrpo tree (a directory or a git commit)",
    )
    parser.add_argument(
        "--toy", action="store_true", help="generate: the toy world's shapes 16x8 and 64x8"
    )
    parser.add_argument("--prompt-len", type=int, help="generate: prompt tokens (default 64)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="generate: timed runs per measurement (median)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for every variant")
    return parser


def _kwargs(ns) -> dict:
    if ns.name == "step":
        return {
            "baseline": ns.baseline,
            "new_only": ns.new_only,
            "vs_trl": ns.vs_trl,
            "repeats": ns.repeats,
            "shapes": ns.shapes,
        }
    if ns.name == "memory":
        return {
            "configs": ns.configs,
            "gen_tokens": ns.gen_tokens,
            "device": ns.device,
            "shrink": ns.shrink,
            "prompts": ns.prompts,
            "n": ns.rollouts,
            "micro": ns.micro,
        }
    if ns.name == "generate":
        sizes = {"prompts": ns.prompts, "n": ns.rollouts, "gen_tokens": ns.gen_tokens or 64}
        if ns.prompt_len is not None:
            sizes["prompt_len"] = ns.prompt_len
        return {
            **sizes,
            "configs": ns.configs,
            "device": ns.device,
            "shrink": ns.shrink,
            "compare": ns.compare,
            "toy": ns.toy,
            "repeats": ns.rounds,
        }
    return {"variants": ns.variants}


def _check_args(ns) -> None:
    """Every size flag >= 1 and --out a file that can be written, checked before any
    measurement starts (InputError naming the flag): a bench runs for minutes, and wrote its
    --out only at the end."""
    sizes = ("steps", "repeats", "shrink", "prompts", "rollouts", "micro", "rounds")
    for name in sizes:
        check_int(getattr(ns, name), f"--{name}", minimum=1)
    for name in ("gen_tokens", "prompt_len"):
        if getattr(ns, name) is not None:
            check_int(getattr(ns, name), "--" + name.replace("_", "-"), minimum=1)
    if ns.configs is not None and not all(c.strip() for c in ns.configs):
        raise InputError(key="--configs", found=",".join(ns.configs), expected="names, no empty")
    out = ns.out
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        why = "a folder" if out.is_dir() else "its folder does not exist"
        raise InputError(why, key="--out", found=str(out), expected="a file to write")


def main(argv: list[str]) -> int:
    parser = _parser()
    ns = parser.parse_intermixed_args(argv)
    _check_args(ns)
    if ns.vs_trl and not _trl_installed():  # before any run: the peer would fail last
        parser.error(
            "--vs-trl needs TRL (the `bench` extra), which cannot share an environment with "
            "verl 0.9.1: run `make bench-env`, then `.venv-trl/bin/omgrpo bench step --vs-trl ...`"
        )
    kwargs = _kwargs(ns)
    # which commit, torch build, devices and package versions produce these figures (taken
    # first: the tree may change during a long run)
    provenance = collect_provenance()
    with contextlib.redirect_stdout(sys.stderr):  # training's console; stdout is the result
        result = BENCHMARKS[ns.name](
            steps=ns.steps, overrides=ns.overrides, partial=ns.out, **kwargs
        )
    result["provenance"] = provenance
    text = json.dumps(result, indent=2)
    if ns.out:
        ns.out.write_text(text)
    print(text)
    if not ns.json and ns.name == "car":
        r = result["ratios"]
        print(
            f"time/car / time/gen = {r['car_over_gen']:.2f} (target <= 1.5); "
            f"step(CAR) / step(MV) = {r['step_car_over_mv']:.2f} (target <= 2.0)"
        )
    if not ns.json and ns.name == "memory":
        for name, r in result["configs"].items():
            ratios = ", ".join(f"{k} {v['peak_ratio']:.2f}" for k, v in r["stages"].items())
            print(f"{name}: measured / planned peak: {ratios} (target: within 25 %)")
    return 0
