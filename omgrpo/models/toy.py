"""The toy world's model: a tiny Qwen3 built from a transformers config, and the SFT warm start
that turns it into a base model of tunable strength.

The base is cached on disk under a key of everything that determines it (architecture, SFT
settings, toy-world ranges), so every RL run of an experiment starts from the same weights and
the SFT cost is paid once.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from omgrpo.console import Progress, quiet_library_bars
from omgrpo.core.car import car_prompt, car_text
from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.core.prompt import render_prompt
from omgrpo.generation.engine import left_pad, right_pad
from omgrpo.generation.rollout import Sequences, response_logits
from omgrpo.models.base_key import toy_base_key
from omgrpo.models.basecheck import write_base_checks
from omgrpo.models.bases import install_shipped
from omgrpo.models.tokenizer import build_char_tokenizer, build_tokenizer
from omgrpo.tasks.toy import ToyWorldSpec, corrupt_solution, generate_sft_problems

SFT_PROBLEMS = 20_000
TOKENIZER_PROBLEMS = 2_000  # the toy BPE's vocabulary saturates well before


def build_toy_model(cfg: Any, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen3ForCausalLM:
    """A tiny Qwen3 (same architecture as the paper's Qwen3-1.7B-Base, scaled down)."""
    head_dim = cfg.hidden_size // cfg.num_heads
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 3,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        # eager attention is faster than sdpa for these tiny shapes on CPU
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def ensure_toy_base(model_cfg: Any, task_cfg: Any, exclude_questions: set[str]) -> Path:
    """Return the cached base-model directory: installed from the bases shipped with omgrpo
    when one has this key (`omgrpo.models.bases`), else trained first."""
    key = toy_base_key(model_cfg, task_cfg)
    out = Path(model_cfg.cache_dir) / f"toy-base-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if model_cfg.warm_start.get("shipped", True) and install_shipped(key, out):
        return out
    # One thread, always: float reductions differ with the thread count, and a base must be
    # the same wherever its key is trained (a fresh clone reproduces a committed study).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_toy_base(model_cfg, task_cfg, exclude_questions, key, out)
    finally:
        torch.set_num_threads(threads)


def _train_toy_base(
    model_cfg: Any, task_cfg: Any, exclude_questions: set[str], key: str, out: Path
) -> Path:
    ws = model_cfg.warm_start
    print(f"warm start: training the toy base ({ws.steps} SFT steps) into {out}", flush=True)
    spec = ToyWorldSpec.from_config(task_cfg)
    problems = generate_sft_problems(SFT_PROBLEMS, ws.seed, spec, exclude_questions)
    tokenizer = build_tokenizer(model_cfg.tokenizer, toy_corpus(problems[:TOKENIZER_PROBLEMS]))
    model = build_toy_model(model_cfg, tokenizer, seed=ws.seed)
    car = car_examples(tokenizer, problems, spec, ws.seed) if ws.car_share > 0 else []
    start = time.perf_counter()
    losses = sft(
        model,
        tokenizer,
        solution_examples(tokenizer, problems),
        steps=ws.steps,
        lr=ws.lr,
        batch_size=ws.batch_size,
        seed=ws.seed,
        car=car,
        car_share=ws.car_share,
    )
    # Write to a temporary directory and rename, so parallel runs never see half a model.
    quiet_library_bars()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {
        "key": key,
        "steps": ws.steps,
        "seconds": round(time.perf_counter() - start, 1),
        "final_loss": losses[-1] if losses else None,
    }
    (tmp / "warm_start.json").write_text(json.dumps(meta, indent=2))
    print(f"warm start: done in {meta['seconds']} s (final loss {meta['final_loss']})", flush=True)
    if ws.check_problems > 0:
        sft_questions = {p.question for p in problems}
        write_base_checks(
            tmp,
            model,
            tokenizer,
            spec,
            ws.check_problems,
            ws.seed,
            exclude_questions | sft_questions,
        )
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def toy_corpus(problems: list) -> list[str]:
    """Text the toy BPE is trained on: rendered prompts with their worked solutions, and the
    CAR template (ChatML rendered by the character tokenizer, which carries the same
    template)."""
    chatml = build_char_tokenizer()
    return [render_prompt(chatml, p.question) + p.solution for p in problems] + [
        car_text("", "", "")
    ]


Example = tuple[list[int], list[int]]  # (prompt ids, target ids); the loss is on the target


def solution_examples(tokenizer: PreTrainedTokenizerBase, problems: list) -> list[Example]:
    """Question -> worked solution + EOS, in the rollout prompt format. The toy's ChatML
    template puts the question in verbatim, so it is rendered once and every prompt is
    tokenized in one batch call (rendering 20k prompts one by one took most of a minute)."""
    slot = "\x00"
    head, tail = render_prompt(tokenizer, slot).split(slot)
    texts = [head + p.question + tail for p in problems]
    assert not problems or texts[0] == render_prompt(tokenizer, problems[0].question)
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    targets = tokenizer([p.solution for p in problems], add_special_tokens=False)["input_ids"]
    return [(a, [*b, tokenizer.eos_token_id]) for a, b in zip(prompts, targets)]


def car_examples(
    tokenizer: PreTrainedTokenizerBase, problems: list, spec: ToyWorldSpec, seed: int
) -> list[Example]:
    """CAR comparisons (the paper's CAR prompt, `omgrpo.core.car.car_prompt`) -> the correct answer
    and the closing brace. A quarter compare a correct solution with itself (rollouts of a group
    are often identical), the rest a correct one with a corrupted one, in random order. This is
    the toy stand-in for what a pre-trained LLM brings to CAR: the answer format and some
    ability to tell a right solution from a slipped one; it uses labels, like all SFT data."""
    rng = random.Random(f"omgrpo-toy-car-sft-{seed}")
    examples = []
    for p in problems:
        wrong = p.solution if rng.random() < 0.25 else corrupt_solution(p, rng, spec)
        if wrong is None:
            continue
        first, second = (p.solution, wrong) if rng.random() < 0.5 else (wrong, p.solution)
        text = car_prompt(tokenizer, p.question, first, second)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        target_ids = tokenizer(p.answer + "}", add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids, target_ids))
    return examples


def sft(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    car: list[Example] | None = None,
    car_share: float = 0.0,
) -> list[float]:
    """Supervised warm start; loss on the target tokens only. A `car_share` of the batches are
    drawn from `car` (whole batches, so short solution prompts are never padded to CAR length)."""
    if steps <= 0:
        return []
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    losses = []
    progress = Progress("warm start (SFT)", steps, {"loss": "loss"}, every=max(steps // 20, 1))
    for step in range(1, steps + 1):
        pool = car if car and rng.random() < car_share else examples
        batch = rng.sample(pool, min(batch_size, len(pool)))
        prompt_ids, prompt_mask = left_pad([a for a, _ in batch], tokenizer.pad_token_id)
        target_ids, target_mask = right_pad([b for _, b in batch], tokenizer.pad_token_id)
        seqs = Sequences(prompt_ids, prompt_mask, target_ids, target_mask)
        logits = response_logits(model, seqs, pad_id=tokenizer.pad_token_id)
        logprobs, _ = token_logprobs_and_entropy(logits, target_ids)
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        losses.append(clipped_step(model, optim, sched, loss))
        progress.update(step, {"loss": losses[-1]})
    progress.close()
    model.eval()
    return losses


def clipped_step(model: torch.nn.Module, optim, sched, loss: torch.Tensor) -> float:
    """One optimizer step on `loss` with the gradient norm clipped to 1 and one schedule step
    (the toy base's SFT and the toy PRM's training); the loss value."""
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    sched.step()
    return loss.item()
