"""The toy world's process reward model: a step classifier trained, like a real PRM, on labelled
steps, and so only as good as its labels.

It is the toy base (`omgrpo.models.toy`) with a token-classification head
(`Qwen3ForTokenClassification`, the `token_classification` PRM format), trained on the base's SFT
solutions, every step labelled good, and on slipped copies of them (`corrupt_solution`: one line's
result off by a little, later lines carrying it forward), where the line whose arithmetic is wrong
is labelled bad. Nothing labels the closing line: a chain of right lines that boxes a guess looks
like any other to it, and in the shortcut world the base's own SFT solutions box guesses as
"good" steps. Its checks (`checks.json`, printed by `omgrpo prm train`) measure both: step
accuracy on held-out lines, and the scores it gives guessed answers.

Cached under a key of its recipe (the base's key and the training settings), shipped like the
toy bases (`omgrpo/bases/toy-prm-<key>/`, `omgrpo prm train ... --ship`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from omgrpo.console import Progress, quiet_library_bars
from omgrpo.core.process import aggregate, split_steps
from omgrpo.core.task import Problem
from omgrpo.models.base_key import recipe_key, toy_base_key
from omgrpo.models.bases import SHIPPED_DIR, install_shipped
from omgrpo.models.prm import PRM_META, PrmSettings, ProcessRewardModel, load_prm
from omgrpo.models.toy import SFT_PROBLEMS, clipped_step
from omgrpo.tasks.toy import (
    ToyWorldSpec,
    corrupt_solution,
    draw_guess,
    generate_sft_problems,
    with_guess,
)

TOY_PRM_VERSION = 1
PRM_CHECKS = "checks.json"
MIN_BALANCED_ACCURACY = 0.75
"""The toy PRM's one acceptance check, fixed before it was first trained: held-out step accuracy
averaged over right and wrong lines (chance: 0.5)."""
SETTINGS = PrmSettings(format="token_classification", step_tag="\n", separator="\n")
_LINE = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")


def toy_prm_recipe(model_cfg: Any, task_cfg: Any, toy_cfg: Any) -> dict[str, Any]:
    """Everything that determines the toy PRM's weights; its sha256 is the PRM's key."""
    train = {k: v for k, v in dict(toy_cfg).items() if k not in ("check_problems", "shipped")}
    return {
        "version": TOY_PRM_VERSION,
        "base": toy_base_key(model_cfg, task_cfg),
        "warm_start_seed": model_cfg.warm_start.seed,
        "train": train,
    }


def ensure_toy_prm(cfg: Any, base_dir: str | Path, exclude: set[str]) -> Path:
    """The toy PRM of `cfg`'s toy base: cached, else installed from `omgrpo/bases/`, else
    trained (one thread, so its bytes do not depend on the machine's core count)."""
    toy = cfg.reward.prm.toy
    key = recipe_key(toy_prm_recipe(cfg.model, cfg.task, toy))
    out = Path(cfg.model.cache_dir) / f"toy-prm-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if toy.shipped and install_shipped(key, out, prefix="toy-prm"):
        return out
    print(training_notice(toy, out), flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_toy_prm(cfg, Path(base_dir), exclude, out)
    finally:
        torch.set_num_threads(threads)


def training_notice(toy: Any, out: Path, shipped_dir: Path = SHIPPED_DIR) -> str:
    """What a run says before it trains a toy PRM: why (none ships for this recipe, or
    `shipped=false`), how long it should take, scaled from the shipped PRMs' own logged training
    time, and where it is cached (trained once per recipe)."""
    why = (
        "reward.prm.toy.shipped=false"
        if not toy.shipped
        else "no shipped toy PRM matches this base and recipe (omgrpo/bases/ ships "
        + ", ".join(_shipped_prm_commands(shipped_dir))
        + ")"
    )
    per_step = [
        checks["training"]["seconds"]
        / json.loads((d / "shipped.json").read_text())["recipe"]["train"]["steps"]
        for d in sorted(shipped_dir.glob("toy-prm-*"))
        if (checks := read_prm_checks(d)) and "training" in checks
    ]
    eta = ""
    if per_step:
        minutes = toy.steps * max(per_step) / 60
        eta = f", about {minutes:.0f} min ({toy.steps} steps at the shipped PRM's logged pace)"
    return f"toy PRM: {why}: training one once on one thread{eta}, cached in {out}"


def _shipped_prm_commands(shipped_dir: Path) -> list[str]:
    """The commands that made the shipped toy PRMs (their manifests), e.g. `omgrpo prm train
    experiment=toy_shortcut`."""
    return [
        "`" + json.loads((d / "shipped.json").read_text())["command"] + "`'s"
        for d in sorted(shipped_dir.glob("toy-prm-*"))
        if (d / "shipped.json").exists()
    ] or ["none"]


def step_labels(solution: str) -> list[int]:
    """1 per step whose arithmetic is right, 0 where `a op b = c` is wrong; other steps (the
    closing line) are 1: nothing in the data says whether a boxed answer is right.

    >>> step_labels("3+4=7\\n7*2=15\\n15-1=14\\nSo the answer is \\\\boxed{14}.")
    [1, 0, 1, 1]
    """
    labels = []
    for line in toy_steps(solution):
        m = _LINE.match(line)
        if m is None:
            labels.append(1)
            continue
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        labels.append(int(value == c))
    return labels


def toy_steps(text: str) -> list[str]:
    """The steps the toy PRM scores: the response's non-blank lines."""
    return [text[a:b] for a, b in split_steps(text, SETTINGS.separator)]


def training_examples(problems: list[Problem], spec: ToyWorldSpec, seed: int) -> list[tuple]:
    """(question, steps, labels) for each SFT solution as it is and for a slipped copy of it."""
    rng = random.Random(f"omgrpo-toy-prm-{seed}")
    out = []
    for p in problems:
        out.append((p.question, toy_steps(p.solution), step_labels(p.solution)))
        wrong = corrupt_solution(p, rng, spec)
        if wrong is not None:
            out.append((p.question, toy_steps(wrong), step_labels(wrong)))
    return out


def train_toy_prm(cfg: Any, base_dir: Path, exclude: set[str], out: Path) -> Path:
    """Train the toy PRM from `base_dir` into `out`, with its checks."""
    toy, seed = cfg.reward.prm.toy, cfg.reward.prm.toy.seed
    spec = ToyWorldSpec.from_config(cfg.task)
    print(f"toy PRM: training a step classifier ({toy.steps} steps) into {out}", flush=True)
    quiet_library_bars()
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(base_dir, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    n = min(SFT_PROBLEMS, toy.steps * toy.batch_size)
    problems = generate_sft_problems(n, cfg.model.warm_start.seed, spec, exclude)
    examples = training_examples(problems, spec, seed)
    start = time.perf_counter()
    encoder = ProcessRewardModel(model, tokenizer, SETTINGS)  # for its encoding only
    model.train().requires_grad_(True)  # (the wrapper froze it)
    losses = _fit(model, encoder, examples, toy, seed)
    model.eval()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    settings = {"format": SETTINGS.format, "step_tag": SETTINGS.step_tag, "separator": "\n"}
    (tmp / PRM_META).write_text(json.dumps(settings, indent=2) + "\n")
    seconds = round(time.perf_counter() - start, 1)
    print(f"toy PRM: trained in {seconds} s (final loss {losses[-1]:.4f})", flush=True)
    held_out = exclude | {p.question for p in problems}
    prm = ProcessRewardModel(model, tokenizer, SETTINGS, batch_size=128)
    checks = toy_prm_checks(prm, spec, toy.check_problems, seed, held_out)
    checks["training"] = {"seconds": seconds, "examples": len(examples), "final_loss": losses[-1]}
    (tmp / PRM_CHECKS).write_text(json.dumps(checks, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _fit(model, encoder: ProcessRewardModel, examples: list[tuple], toy: Any, seed: int):
    """Cross-entropy on the step tags' tokens only (labels -100 elsewhere), the classes weighted
    to balance: a slipped line is about one step in eight, and unweighted the head learned to call
    every step good (balanced held-out accuracy 0.51 after 300 steps)."""
    labels = [x for *_, ls in examples for x in ls]
    weight = torch.tensor([labels.count(1) / max(labels.count(0), 1), 1.0])
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=toy.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, toy.steps) / toy.steps))
    )
    encoded = [(encoder.encode(q, steps), labels) for q, steps, labels in examples]
    progress = Progress("toy PRM", toy.steps, {"loss": "loss"}, every=max(toy.steps // 10, 1))
    losses = []
    for step in range(1, toy.steps + 1):
        batch = rng.sample(encoded, min(toy.batch_size, len(encoded)))
        width = max(len(ids) for (ids, _), _ in batch)
        ids = torch.full((len(batch), width), encoder.pad_id, dtype=torch.long)
        mask, targets = torch.zeros_like(ids), torch.full_like(ids, -100)
        for i, ((row, positions), labels) in enumerate(batch):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            targets[i, positions] = torch.tensor(labels)
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, 2)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), weight=weight, ignore_index=-100
        )
        losses.append(clipped_step(model, optim, sched, loss))
        progress.update(step, {"loss": losses[-1]})
    progress.close()
    return losses


def toy_prm_checks(
    prm: ProcessRewardModel, spec: ToyWorldSpec, n: int, seed: int, exclude: set[str]
) -> dict[str, Any]:
    """The toy PRM on `n` held-out problems (faithful solutions): its accuracy on right lines
    and on slipped lines (threshold 0.5), and what it makes of guessed answers: the same right
    lines closing on a guess, and a bare guess. The min-aggregated score of each kind of chain
    is the reward `method=prm` would give it."""
    faithful = dataclasses.replace(spec, guess_rate_easy=0.0, guess_rate_hard=0.0)
    problems = generate_sft_problems(n, seed + 7919, faithful, exclude)
    rng = random.Random(f"omgrpo-toy-prm-check-{seed}")
    chains: dict[str, list[str]] = {"faithful": [], "slipped": [], "guessed": [], "bare_guess": []}
    questions: dict[str, list[str]] = {k: [] for k in chains}
    for p in problems:
        wrong = corrupt_solution(p, rng, spec)
        guess = draw_guess(rng, spec, p.meta["difficulty"])
        while str(guess) == p.answer:
            guess = draw_guess(rng, spec, p.meta["difficulty"])
        kinds = {
            "faithful": p.solution,
            "slipped": wrong,
            "guessed": with_guess(p, guess, bare=False).solution,
            "bare_guess": with_guess(p, guess, bare=True).solution,
        }
        for kind, text in kinds.items():
            if text is not None:
                chains[kind].append(text)
                questions[kind].append(p.question)
    scores = {k: prm(questions[k], chains[k]) for k in chains}
    right, wrong_lines = [], []
    for kind in ("faithful", "slipped"):
        for text, s in zip(chains[kind], scores[kind]):
            for label, x in zip(step_labels(text), s):
                (right if label else wrong_lines).append(x)
    acc_right = float(np.mean([x >= 0.5 for x in right]))
    acc_wrong = float(np.mean([x < 0.5 for x in wrong_lines]))
    balanced = (acc_right + acc_wrong) / 2
    summary = {
        kind: {
            "chains": len(s),
            "closing_score": float(np.mean([x[-1] for x in s])),
            "min_score": float(np.mean([aggregate(x, "min") for x in s])),
            "accepted": float(np.mean([aggregate(x, "min") >= 0.5 for x in s])),
        }
        for kind, s in scores.items()
    }
    return {
        "passed": balanced >= MIN_BALANCED_ACCURACY,
        "checks": [
            {
                "check": "step_accuracy/balanced",
                "measured": round(balanced, 4),
                "target": [MIN_BALANCED_ACCURACY, None],
                "passed": balanced >= MIN_BALANCED_ACCURACY,
            }
        ],
        "step_accuracy": {
            "right_lines": acc_right,
            "wrong_lines": acc_wrong,
            "right_count": len(right),
            "wrong_count": len(wrong_lines),
        },
        "chains": summary,
    }


def read_prm_checks(prm_dir: str | Path) -> dict[str, Any] | None:
    path = Path(prm_dir) / PRM_CHECKS
    return json.loads(path.read_text()) if path.exists() else None


def format_prm_checks(checks: dict[str, Any]) -> str:
    """The checks as the lines `omgrpo prm train` prints."""
    acc = checks["step_accuracy"]
    lines = [
        f"toy PRM checks: {'passed' if checks['passed'] else 'FAILED'}",
        f"  held-out steps: right lines scored good {acc['right_lines']:.3f} "
        f"(n={acc['right_count']}), wrong lines scored bad {acc['wrong_lines']:.3f} "
        f"(n={acc['wrong_count']}); balanced {checks['checks'][0]['measured']:.3f} "
        f"(target >= {MIN_BALANCED_ACCURACY})",
        "  chains (mean closing-line score, mean min-step score, share with min >= 0.5):",
    ]
    for kind, s in checks["chains"].items():
        lines.append(
            f"    {kind:<11} n={s['chains']:<4} closing {s['closing_score']:.3f}  "
            f"min {s['min_score']:.3f}  accepted {s['accepted']:.3f}"
        )
    return "\n".join(lines)


def configured_prm(cfg: Any, splits: Any, device: torch.device) -> ProcessRewardModel:
    """The PRM of `cfg.reward.prm`: the checkpoint at `path`, or (null) the toy base's toy PRM,
    trained on first use. `splits`: the task's, kept out of the toy PRM's training data."""
    from omgrpo.models.loading import base_model_dir, resolve_dtype

    prm_cfg = cfg.reward.prm
    path = prm_cfg.path
    if not path:
        if cfg.model.path or cfg.task.name != "toy":
            raise ValueError(
                "reward.prm.path is null, which means the toy PRM, but this is not a toy run "
                "(model.path set or task not toy); point reward.prm.path at a PRM checkpoint"
            )
        seen = {p.question for split in (splits.train, splits.val, splits.test) for p in split}
        path = ensure_toy_prm(cfg, base_model_dir(cfg.model, cfg.task, splits), seen)
    elif str(path).startswith(("/", ".", "~")) and not Path(str(path)).expanduser().exists():
        raise FileNotFoundError(f"reward.prm.path '{path}' does not exist")
    return load_prm(path, prm_cfg, device, resolve_dtype(prm_cfg.dtype, device))
