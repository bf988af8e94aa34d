"""`omgrpo plan backend=verl experiment=X ...` (the per-GPU plan of a verl preset,
`omgrpo.models.verl_memory`) and `omgrpo plan --table` (what fits where: the paper's three
backbones on 24 / 48 / 80 GiB, native trainer and verl; README "Real models" pastes it and
tests/models/test_verl_memory.py checks the paste); `omgrpo plan --table --lora` (the native
trainer with LoRA, the three backbones: docs/real-models.md, "LoRA")."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "model_configs"
BACKBONES = {
    "Qwen3-1.7B-Base": "qwen3-1.7b-base",
    "Llama-3.2-3B-Instruct": "llama-3.2-3b-instruct",
    "Qwen2.5-7B": "qwen2.5-7b",
}
DEVICES_GB = (24, 48, 80)
# the native trainer at the paper's lengths (512 + 3072 tokens), a small step: 4 prompts x 8
SMALL_STEP = [
    "trainer.prompts_per_step=4",
    "algorithm.micro_batch_size=1",
    "eval.batch_size=32",
    "car.chunk_pairs=28",
]
NATIVE = {
    "native, `experiment=paper`": [],
    "native, paper + small step": SMALL_STEP,
    "native, small step + `algorithm.kl_coef=0`": [*SMALL_STEP, "algorithm.kl_coef=0"],
}
# LoRA (rank 64 on every block linear, `model.lora.*`): the README's table has these rows for
# the backbone whose full fine-tuning does not fit one card; `lora_table` has all three
LORA = ["model.lora.rank=64"]
NATIVE_LORA = {
    "native, paper + LoRA (`model.lora.rank=64`)": LORA,
    "native, small step + LoRA": [*SMALL_STEP, *LORA],
}
LORA_BACKBONES = ("Qwen2.5-7B",)


def _native_cell(cfg, model_dir: Path, gb: int) -> str:
    from omgrpo.models.memory import GIB, plan_memory

    plan = plan_memory(cfg, str(model_dir), gb * GIB, "cuda")
    top = max(plan.stages, key=lambda st: st.peak)
    if plan.fits:
        return f"fits ({top.name} {top.peak / GIB:.1f})"
    worst = [st for st in plan.stages if not st.fits]
    n = len(worst)
    return f"no ({n} stage{'s' if n > 1 else ''}; {top.name} {top.peak / GIB:.1f})"


def _verl_cell(model_dir: Path, gb: int) -> str:
    from omgrpo.models.memory import GIB, model_shape
    from omgrpo.models.verl_memory import build_verl_plan, one_gpu_settings

    shape = model_shape(str(model_dir))
    try:
        st = one_gpu_settings(shape, gb * GIB, 512, 3072)
    except ValueError:
        return "no"
    if st.offload_policy:
        host = build_verl_plan(shape, st, gb * GIB).host_bytes / GIB
        how = f"FSDP2 offload, {host:.0f} GiB host RAM"
    else:
        how = "offload" if st.param_offload else "no offload"
    return f"fits ({how}; vLLM {st.gpu_memory_utilization:.2f})"


def _native_rows(label: str, rows: dict[str, list[str]]) -> list[str]:
    from omgrpo.config import compose

    model_dir = CONFIGS / BACKBONES[label]
    lines = []
    for name, extra in rows.items():
        cfg = compose(["experiment=paper", f"model.path={model_dir}", *extra])
        cells = [_native_cell(cfg, model_dir, gb) for gb in DEVICES_GB]
        lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return lines


def _head() -> list[str]:
    head = "| backbone | trainer | " + " | ".join(f"{gb} GiB" for gb in DEVICES_GB) + " |"
    return [head, "|---|---|" + "---|" * len(DEVICES_GB)]


def fit_table() -> str:
    """The markdown table of what fits where (peaks in GiB, the largest stage named)."""
    lines = _head()
    for label, fixture in BACKBONES.items():
        lines += _native_rows(label, NATIVE)
        if label in LORA_BACKBONES:
            lines += _native_rows(label, NATIVE_LORA)
        cells = [_verl_cell(CONFIGS / fixture, gb) for gb in DEVICES_GB]
        lines.append(f"| {label} | verl, one GPU | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lora_table() -> str:
    """The native trainer's LoRA rows for the three backbones (docs/real-models.md, "LoRA")."""
    lines = _head()
    for label in BACKBONES:
        lines += _native_rows(label, NATIVE_LORA)
    return "\n".join(lines)


def verl_plan_main(args: list[str]) -> int:
    """`omgrpo plan backend=verl experiment=X [verl overrides] --device-gb N [--json]`:
    0 fits, 1 does not fit, 2 no plan."""
    from omgrpo.backends.verl.config import compose_verl
    from omgrpo.errors import InputError, check_number
    from omgrpo.models.memory import GIB, check_model_config
    from omgrpo.models.verl_memory import format_verl_plan, plan_verl

    parser = argparse.ArgumentParser(prog="omgrpo plan backend=verl")
    parser.add_argument("--device-gb", type=float, required=True, help="GPU memory in GiB")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_intermixed_args(args)
    check_number(ns.device_gb, "--device-gb", minimum=0, exclusive_minimum=True)
    experiments = [o.partition("=")[2] for o in ns.overrides if o.startswith("experiment=")]
    if not experiments:
        raise InputError("name a verl preset", key="experiment", expected="experiment=X")
    rest = [o for o in ns.overrides if not o.startswith(("experiment=", "backend="))]
    cfg = compose_verl(experiments[-1], rest)
    model_dir = cfg.actor_rollout_ref.model.path
    if not model_dir:
        raise InputError(
            "set it to a directory with the model's config.json (no weights needed)",
            key="actor_rollout_ref.model.path",
        )
    check_model_config(str(model_dir))
    plan = plan_verl(cfg, model_dir, int(ns.device_gb * GIB))
    print(json.dumps(plan.to_json(), indent=2) if ns.json else format_verl_plan(plan))
    return 0 if plan.fits else 1


def main(args: list[str]) -> int:
    if "--table" in args:
        print(lora_table() if "--lora" in args else fit_table())
        return 0
    return verl_plan_main(args)
