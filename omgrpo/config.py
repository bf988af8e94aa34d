"""The one config schema: Hydra structured configs (dataclasses), YAML only for presets.

Every field has a docstring; `omgrpo train --help` / the README list the groups. Presets live in
`experiments/` (`experiment/*.yaml`, `method/*.yaml`). Defaults train OM-GRPO on the toy world
on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from omgrpo.core.car import CarConfig
from omgrpo.core.choices import AGG_MODES, ANSWER_SPANS
from omgrpo.core.diagnostics import COLLAPSE_DEFAULTS
from omgrpo.tasks.toy import ToyWorldSpec
from omgrpo.tracking import TrackingConfig


def presets_dir() -> Path:
    """The Hydra presets: the checkout's own `experiments/` when omgrpo runs from one (an
    editable install or PYTHONPATH, so edits there take effect), else the copy the wheel ships
    as `omgrpo/_presets/` (setup.py copies experiments/ there at build time)."""
    checkout = Path(__file__).resolve().parent.parent / "experiments"
    if (checkout / "config.yaml").is_file():
        return checkout
    shipped = resources.files("omgrpo") / "_presets"
    # Hydra reads a config directory from the file system: pip installs wheels unpacked, so
    # the resource is a real path (a zipped install would need extracting first).
    if not isinstance(shipped, Path) or not (shipped / "config.yaml").is_file():
        raise FileNotFoundError(
            f"omgrpo's presets are missing: no {checkout}/config.yaml (a checkout) and no "
            f"{shipped}/config.yaml (an installed wheel); reinstall omgrpo from a wheel or a checkout"
        )
    return shipped


EXPERIMENTS_DIR = presets_dir()


@dataclass
class RunConfig:
    experiment: str = "toy"
    """Experiment name: first part of the run name, groups runs in trackers."""
    variant: str = "om_grpo"
    """Variant within the experiment (method or ablation): second part of the run name."""
    name: str = "${run.experiment}__${run.variant}__s${seed}"
    """Run directory name under `run.root` (`<experiment>__<variant>__s<seed>`)."""
    root: str = "runs"
    """Folder holding one sub-folder per run (the local run store)."""
    resume: bool | str = "auto"
    """`auto`: continue an unfinished run in the run directory from its newest checkpoint, start
    one where there is none, skip a finished (or collapse-stopped) one; `true`: continue (or
    start) in any case; `false`: start, refusing a directory that holds a run. A resume refuses
    a checkpoint written under a config that differs in a setting that matters."""
    tags: list[str] = field(default_factory=list)
    """Free-form tags recorded with the run."""


@dataclass
class _TaskHead:
    """The `task` fields before the toy world's (a base of `TaskConfig`, for the key order)."""

    name: str = "toy"
    """Task: `toy` (synthetic arithmetic world, labels known) or `files` (JSONL/Parquet)."""
    ttt: bool = False
    """Test-time training: train on the evaluation split without labels (labels only diagnose)."""
    seed: int = 0
    """Seed of the toy generator (splits are drawn from disjoint seeds)."""
    n_train: int = 2000
    """Toy: number of training problems."""
    n_val: int = 128
    """Toy: number of validation problems."""
    n_test: int = 256
    """Toy: number of test problems."""


@dataclass
class TaskConfig(ToyWorldSpec, _TaskHead):
    """The `task` section: `_TaskHead`'s fields, the toy world's generator fields inherited
    from `omgrpo.tasks.toy.ToyWorldSpec` (one declaration of their defaults, which the toy
    bases' cache keys hash; the keys stay flat: `task.hard_share=0.5`), then the files task's.
    """

    train_path: str | None = None
    """Files: training set (.jsonl/.json/.parquet) with question/answer columns."""
    val_path: str | None = None
    """Files: validation set (labels required)."""
    test_path: str | None = None
    """Files: evaluation set (the training set in test-time training)."""
    question_key: str = "question"
    """Files: name of the question column."""
    answer_key: str = "answer"
    """Files: name of the answer column."""


@dataclass
class WarmStartConfig:
    steps: int = 600
    """SFT steps on the toy solutions; fewer steps give a weaker base (0 = untrained)."""
    lr: float = 3e-3
    """SFT learning rate (AdamW, cosine to 10%)."""
    batch_size: int = 64
    """SFT batch size (sequences)."""
    car_share: float = 0.0
    """Share of SFT batches that are CAR comparisons (correct vs. slipped solution -> the
    correct answer), so the base knows CAR's answer format. Off by default: at 600 steps a
    share of 0.1 cut the toy base's val avg@4 from 0.53 to 0.15 (0.25 to 0.07 with the wider
    ranges), so CAR runs on a base that never saw the CAR prompt (see `car/unclosed`)."""
    seed: int = 0
    """Seed of the initial weights and SFT batches."""
    check_problems: int = 128
    """Unseen problems, sampled 8 times each, for the base's acceptance checks (guess rates,
    answer-token entropy, accuracy by difficulty; omgrpo.models.basecheck), stored as checks.json
    beside the base. 0 skips them. Not part of the base's cache key."""
    shipped: bool = True
    """Use the base shipped with omgrpo (`omgrpo/bases/`, made by `omgrpo base ... --ship`)
    when one has this key, instead of training it; false trains it. Not part of the key."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The default `model.lora.target_modules`: every linear layer of a Llama / Qwen2 / Qwen3 block."""


@dataclass
class LoraConfig:
    """LoRA on the native trainer (peft): the base's weights stay frozen, rank-`rank` adapters
    on `target_modules` train; the KL term's reference is the base itself (the policy with its
    adapters switched off, no second copy of the weights). docs/real-models.md, "LoRA"."""

    rank: int = 0
    """r: the adapters' rank; 0 (the default) trains every weight (full fine-tuning)."""
    alpha: float = 32.0
    """The adapters' scale numerator: a layer computes W x + (alpha / rank) B A x."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the update (0 <= dropout < 1; peft's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the modules that get adapters (a module matches when its name is one of these
    or ends with `.` + one of these, as in peft)."""


@dataclass
class ModelConfig:
    path: str | None = None
    """A local HF causal-LM directory or hub id; null builds the toy model (tiny Qwen3)."""
    dtype: str = "auto"
    """`auto` (bf16 on GPU, fp32 on CPU), `bf16`, `fp16` or `fp32`."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu` or `cuda[:N]`."""
    hidden_size: int = 128
    """Toy: model width."""
    num_layers: int = 2
    """Toy: transformer blocks."""
    num_heads: int = 4
    """Toy: attention heads."""
    num_kv_heads: int = 2
    """Toy: key/value heads (GQA, as Qwen3)."""
    tokenizer: str = "bpe"
    """Toy: `bpe` (byte-level BPE trained on toy-world text, digits one per token, as Qwen and
    Llama) or `char` (one token per character)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Toy: SFT warm start that makes the base model; cached on disk by its settings."""
    cache_dir: str = ".cache/omgrpo"
    """Where toy base models are cached so every RL run starts from the same base."""
    gradient_checkpointing: bool = False
    """Trade compute for memory on real models."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (native trainer; `lora.rank` > 0 turns it on)."""


@dataclass
class RolloutConfig:
    n: int = 8
    """G: rollouts per prompt."""
    temperature: float = 1.0
    """Sampling temperature during training."""
    top_p: float = 1.0
    """Nucleus sampling during training."""
    max_new_tokens: int = 64
    """Longest response (tokens)."""
    max_prompt_len: int = 512
    """Longest prompt (tokens, chat template included); every train/val prompt is checked at
    setup and the error lists the longer ones (file, line, id)."""
    max_batch_tokens: int | None = None
    """K/V cache tokens one generation chunk of the native trainer may hold (rollouts,
    validation, CAR): each prompt once plus `max_new_tokens` per row (CAR's pair prompts per
    row). null: chunks sized from the device's free memory before each generation. Results do
    not depend on the chunking; see docs/memory.md."""


@dataclass
class EvalConfig:
    every: int = 10
    """Validate every N steps (and at step 0 and the end); 0 disables validation."""
    num_prompts: int = 128
    """Validation problems per evaluation (the first N of the split)."""
    k: int = 4
    """Samples per problem: reports avg@k and pass@k."""
    temperature: float = 0.8
    """Evaluation temperature (paper: 0.8)."""
    top_p: float = 0.95
    """Evaluation nucleus (paper: 0.95)."""
    batch_size: int = 256
    """Rollouts generated at once during validation."""


@dataclass
class ToyPrmConfig:
    """How the toy PRM is trained (`omgrpo prm train`): a token-classification head on the toy
    base, trained on the base's SFT solutions (every step labelled good) and slipped copies
    (the line with wrong arithmetic labelled bad). Cached (and shipped) under a key of these
    settings and the base's."""

    steps: int = 4000
    """Training steps (AdamW, cosine to 10%). 400 steps at lr 2e-3 failed the PRM's check
    (docs/prm.md, "Recipes tried")."""
    lr: float = 1e-3
    """Learning rate."""
    batch_size: int = 64
    """Solutions per step (half of them slipped)."""
    seed: int = 0
    """Seed of the head's initial weights, the slips and the batches."""
    check_problems: int = 256
    """Held-out problems for the PRM's checks (step accuracy, scores of guessed answers)."""
    shipped: bool = True
    """Use the toy PRM shipped in `omgrpo/bases/` when one has this key; false trains it."""


@dataclass
class PrmConfig:
    """The process reward model of the `process` reward (`omgrpo.models.prm`). Keys left null
    come from the checkpoint's `omgrpo_prm.json` (the toy PRM writes one), else the defaults
    named below."""

    path: str | None = None
    """A local HF PRM directory or hub id; null: the toy PRM of the toy base (trained on first
    use, or installed from `omgrpo/bases/`)."""
    format: str | None = None
    """`causal_lm` (a step scored by P(good_token) against bad_token right after the step tag,
    Math-Shepherd style) or `token_classification` (P(good_label) of a classification head at
    the step tag, Qwen2.5-Math-PRM / PURE style); null: from omgrpo_prm.json."""
    step_tag: str | None = None
    """Text appended after every step; the step is scored at its (last non-blank) character's
    token, e.g. ` ки` (Math-Shepherd), `<extra_0>` (Qwen2.5-Math-PRM); null: from omgrpo_prm.json,
    else a newline."""
    separator: str | None = None
    """How a response is split into steps (blank steps dropped); null: from omgrpo_prm.json,
    else a newline."""
    good_token: str = "+"
    """causal_lm: the token meaning a good step."""
    bad_token: str = "-"
    """causal_lm: the token meaning a bad step."""
    good_label: int = 1
    """token_classification: the label index meaning a good step."""
    chat_template: bool = True
    """Render (question, steps) with the PRM tokenizer's chat template (user: question,
    assistant: the tagged steps) when it has one; else `question` + newline + steps."""
    system: str | None = None
    """A system message for the chat template (Qwen2.5-Math-PRM's: "Please reason step by
    step, and put your final answer within \\boxed{}.")."""
    aggregate: str = "min"
    """Step scores -> reward: `min` (PURE's min-form), `last`, `mean` or `product`."""
    batch_size: int = 64
    """Responses per PRM forward pass."""
    budget_s: float = 60.0
    """Seconds of PRM scoring per training step; batches not started by then are left unscored
    (their rollouts get their group's mean score, `prm/unscored_share` counts them)."""
    dtype: str = "auto"
    """`auto` (bf16 on GPU, fp32 on CPU), `bf16`, `fp16` or `fp32`; the PRM shares the
    policy's device (`model.device`)."""
    toy: ToyPrmConfig = field(default_factory=ToyPrmConfig)
    """The toy PRM's training (used when `path` is null)."""


@dataclass
class RewardConfig:
    parts: list[str] = field(default_factory=lambda: ["soft_vote", "format"])
    """Named reward parts summed into the reward (see `omgrpo.core.rewards.REWARDS`); each is logged."""
    weights: dict[str, float] = field(default_factory=dict)
    """Optional weight per part (a part not listed here has weight 1.0)."""
    math_verify: bool = True
    """Fall back to math-verify when normalised answers differ (off: string/number match only)."""
    equivalence_timeout: float = 5.0
    """Seconds one answer pair may spend in the math-verify worker before it is killed."""
    grading_budget_s: float = 10.0
    """Seconds of math-verify work per training step, shared by all its answer comparisons;
    past it, undecided pairs count as different and `answers/grading_timeouts` counts them."""
    prm: PrmConfig = field(default_factory=PrmConfig)
    """The process reward model of the `process` reward (method presets `prm`, `prm_om`)."""


@dataclass
class AlgorithmConfig:
    """The algorithm section of both backends (verl reads `answer_weight`, `answer_span`,
    `top_entropy_quantile`, `random_mask`, `format_only` and `adv_eps`; its own actor keys hold
    the rest, see `omgrpo.backends.verl.config`)."""

    answer_weight: float = 0.0
    """w >= 0: weight of answer-span tokens in the PG and KL terms (0 = OM-GRPO, 1 = vanilla
    GRPO, between: the paper's soft down-weighting; above 1 up-weights the answer)."""
    answer_kl_weight: float | None = None
    """Weight (>= 0) of answer-span tokens in the KL term alone; null = answer_weight (the paper:
    both terms masked). 1 with answer_weight 0 masks the PG term but keeps the KL anchor."""
    answer_span: str = "boxed"
    """Which tokens are the answer span (masked by `answer_weight`, and the `answer` token role):
    `boxed` (the paper's span, the tokens inside the last `\\boxed{}`; the default until the v2
    study says otherwise), `closing` (also the token(s) that decide where the answer ends: the one
    holding the closing `}` -- whole, whatever it merged with, e.g. the toy BPE's `}.` -- and the
    eos right after it when the response ends there) or `closing_line` (the whole line holding the
    last box, from its start, and that eos) or `closing_only` (the token holding the closing `}`,
    whole, and the eos right after it, without the box's content: study v4's generic mask).
    Token-aligned through the tokenizer's offsets (`omgrpo.core.spans.answer_char_span`)."""
    top_entropy_quantile: float | None = None
    """q in (0, 1] (TRL's name and meaning): only the response tokens whose entropy under the
    sampling policy is at or above the step's (1 - q) quantile, over all the step's response
    tokens, are trained; the others get weight 0 in the PG and KL terms (`mask/*` metrics;
    `omgrpo.core.masks`). null: off. The `answer` token role stays `answer_span`."""
    random_mask: str | None = None
    """A span (`answer_span`'s values): per rollout, as many response tokens as that span holds
    (0 without a well-formed box) are drawn uniformly and get weight 0 in the PG and KL terms;
    the draw's generator is seeded from (seed, step, rollout), never the sampling RNG. null:
    off. The `answer` token role stays `answer_span`."""
    format_only: bool = False
    """Answer tokens get the advantage of the format reward alone (ablation)."""
    clip: float = 0.2
    """PPO clip range epsilon."""
    clip_low: float | None = None
    """DAPO's asymmetric clip: the ratio's lower clip range, in (0, 1] (the ratio is clamped to
    [1 - clip_low, 1 + clip_high]); null = `clip`. verl: actor.clip_ratio_low."""
    clip_high: float | None = None
    """The ratio's upper clip range, > 0 (DAPO's "clip-higher", e.g. 0.28); null = `clip`.
    verl: actor.clip_ratio_high."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling, drop only: the rollouts of groups whose rewards have zero spread
    leave the loss (numerator and denominator) and are not resampled; `dapo/dropped_groups`
    counts them. null/false: off (`omgrpo.core.dapo`)."""
    overlong_filter: bool | None = None
    """DAPO's overlong filtering: truncated responses (at the length limit without an eos) leave
    the loss. null/false: off."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong punishment: a reward penalty falling linearly from 0 to
    -overlong_penalty_factor over the last `overlong_buffer` tokens before the length limit
    (native `rollout.max_new_tokens`, verl `actor_rollout_ref.rollout.response_length`). null:
    off."""
    overlong_penalty_factor: float | None = None
    """The soft overlong punishment's largest penalty (>= 0); null = 1.0 (DAPO's)."""
    kl_coef: float = 0.005
    """beta of the k3 (low-variance) KL to the reference model; 0 skips the reference."""
    agg: str = "token-mean"
    """Loss aggregation: token-mean (divides by all response tokens), seq-mean-token-sum/-mean."""
    adv_eps: float = 1e-6
    """delta in (r - mean) / (std + delta)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int | None = None
    """Rollouts per optimizer step (null: all of the step's rollouts, one update)."""
    micro_batch_size: int | None = None
    """Rollouts per forward pass (gradient accumulation); null: the whole mini-batch."""


def validate_algorithm(algo: DictConfig, prefix: str) -> None:
    """Reject values no backend can train with, naming the key (`prefix`.<field>)."""
    if algo.agg not in AGG_MODES:
        raise ValueError(f"unknown {prefix}.agg '{algo.agg}'; valid: {', '.join(AGG_MODES)}")
    if algo.answer_weight < 0:
        raise ValueError(
            f"{prefix}.answer_weight must be >= 0 (0 = OM-GRPO, 1 = vanilla GRPO), "
            f"got {algo.answer_weight}"
        )
    if algo.answer_kl_weight is not None and algo.answer_kl_weight < 0:
        raise ValueError(
            f"{prefix}.answer_kl_weight must be >= 0 or null, got {algo.answer_kl_weight}"
        )
    if algo.adv_eps < 0:
        raise ValueError(f"{prefix}.adv_eps must be >= 0, got {algo.adv_eps}")
    if algo.answer_span not in ANSWER_SPANS:
        raise ValueError(
            f"unknown {prefix}.answer_span '{algo.answer_span}'; valid: {', '.join(ANSWER_SPANS)}"
        )
    _validate_generic_masks(algo, prefix)
    _validate_dapo(algo, prefix)


def _validate_dapo(algo: DictConfig, prefix: str) -> None:
    """The DAPO-family switches are true, false or null (a config written before they existed
    has none: off); their numbers are range-checked by `VALUE_RANGES`."""
    for key in ("dynamic_sampling", "overlong_filter"):
        value = algo.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{prefix}.{key} must be true, false or null (off), got {value!r}")
    if algo.get("overlong_penalty_factor") is not None and algo.get("overlong_buffer") is None:
        raise ValueError(
            f"{prefix}.overlong_penalty_factor is set but {prefix}.overlong_buffer is null: "
            "set the buffer's length in tokens to turn the soft overlong punishment on"
        )


def _validate_generic_masks(algo: DictConfig, prefix: str) -> None:
    """`top_entropy_quantile` in (0, 1] or null, `random_mask` a span or null (a config
    written before these keys existed has neither: off)."""
    q = algo.get("top_entropy_quantile")
    if q is not None and (isinstance(q, bool) or not isinstance(q, int | float) or not 0 < q <= 1):
        raise ValueError(
            f"{prefix}.top_entropy_quantile must be in (0, 1] (the share of the step's response "
            f"tokens trained, e.g. 0.2) or null (off), got {q!r}"
        )
    span = algo.get("random_mask")
    if span is not None and span not in ANSWER_SPANS:
        raise ValueError(
            f"unknown {prefix}.random_mask '{span}'; valid: {', '.join(ANSWER_SPANS)} (the span "
            "whose token count each rollout's random mask draws) or null (off)"
        )


# (key, kind, minimum, maximum, null allowed): the ranges `check_values` enforces. "int" and
# "float" are closed ranges; "float>" excludes its minimum. A value outside is refused where the
# config enters (`omgrpo train` before Hydra writes anything, `omgrpo plan`), naming the key.
VALUE_RANGES: tuple[tuple[str, str, float | None, float | None, bool], ...] = (
    ("seed", "int", 0, None, False),
    ("task.n_train", "int", 1, None, False),
    ("task.n_val", "int", 0, None, False),
    ("task.n_test", "int", 0, None, False),
    ("model.warm_start.steps", "int", 0, None, False),  # 0 = an untrained base
    ("model.warm_start.lr", "float>", 0, None, False),
    ("model.warm_start.batch_size", "int", 1, None, False),
    ("model.warm_start.car_share", "float", 0, 1, False),
    ("model.warm_start.seed", "int", 0, None, False),
    ("model.warm_start.check_problems", "int", 0, None, False),
    ("rollout.n", "int", 2, None, False),
    ("rollout.temperature", "float", 0, None, False),
    ("rollout.top_p", "float>", 0, 1, False),
    ("rollout.max_new_tokens", "int", 1, None, False),
    ("rollout.max_prompt_len", "int", 1, None, False),
    ("rollout.max_batch_tokens", "int", 1, None, True),
    ("eval.every", "int", 0, None, False),
    ("eval.num_prompts", "int", 1, None, False),
    ("eval.k", "int", 1, None, False),
    ("eval.temperature", "float", 0, None, False),
    ("eval.top_p", "float>", 0, 1, False),
    ("eval.batch_size", "int", 1, None, False),
    ("algorithm.clip", "float>", 0, None, False),
    ("algorithm.kl_coef", "float", 0, None, False),
    ("algorithm.clip_low", "float>", 0, 1, True),
    ("algorithm.clip_high", "float>", 0, None, True),
    ("algorithm.overlong_buffer", "int", 1, None, True),
    ("algorithm.overlong_penalty_factor", "float", 0, None, True),
    ("algorithm.top_entropy_quantile", "float>", 0, 1, True),
    ("algorithm.ppo_epochs", "int", 1, None, False),
    ("algorithm.mini_batch_size", "int", 1, None, True),
    ("algorithm.micro_batch_size", "int", 1, None, True),
    ("optim.lr", "float>", 0, None, False),
    ("optim.eps", "float>", 0, None, False),
    ("optim.weight_decay", "float", 0, None, False),
    ("optim.warmup_ratio", "float", 0, 1, False),
    ("optim.min_lr_ratio", "float", 0, 1, False),
    ("optim.grad_clip", "float", 0, None, False),
    ("trainer.steps", "int", 1, None, True),
    ("trainer.epochs", "int", 1, None, False),
    ("trainer.prompts_per_step", "int", 1, None, False),
    ("trainer.save_every", "int", 0, None, False),
    ("trainer.keep_checkpoints", "int", 1, None, False),
    ("trainer.log_rollouts_every", "int", 1, None, False),
    ("trainer.max_consecutive_skips", "int", 1, None, False),
    ("trainer.log_every", "int", 0, None, False),
    ("trainer.threads", "int", 1, None, True),
    ("trainer.grad_probe_every", "int", 0, None, False),
    ("reward.equivalence_timeout", "float>", 0, None, False),
    ("reward.grading_budget_s", "float>", 0, None, False),
    ("collapse.patience", "int", 1, None, False),
    ("diagnostics.mechanism_every", "int", 0, None, False),
    ("diagnostics.mechanism_prompts", "int", 1, None, False),
)


def check_values(cfg: DictConfig) -> None:
    """Refuse a config value out of its range (`VALUE_RANGES`) with an InputError naming the
    key, the value and the range: e.g. trainer.steps=0 (it trained a whole epoch), -1 (it
    reported "run finished" after no step), rollout.n=0 (it divided by zero)."""
    from omgrpo.errors import check_int, check_number

    for key, kind, low, high, nullable in VALUE_RANGES:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None and OmegaConf.select(cfg, key, default="<absent>") == "<absent>":
            continue  # a config without this key (another backend's)
        if kind == "int":
            check_int(value, key, minimum=low, maximum=high, allow_none=nullable)
        else:
            check_number(
                value,
                key,
                minimum=low,
                maximum=high,
                exclusive_minimum=kind == "float>",
                allow_none=nullable,
            )


def validate_lora(lora: DictConfig, prefix: str = "model.lora") -> None:
    """Reject LoRA settings peft cannot train with, naming the key (`prefix`.<field>)."""
    rank = lora.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{prefix}.rank must be an integer >= 0 (0: no LoRA), got {rank!r}")
    alpha = lora.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"{prefix}.alpha must be a number > 0, got {alpha!r}")
    dropout = lora.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{prefix}.dropout must be >= 0 and < 1, got {dropout!r}")
    targets = lora.target_modules
    if (
        isinstance(targets, str)
        or not targets
        or not all(isinstance(t, str) and t.strip() for t in targets)
    ):
        raise ValueError(
            f"{prefix}.target_modules must be a non-empty list of module names (e.g. "
            f"[{', '.join(LORA_TARGETS)}]), got {targets!r}"
        )


@dataclass
class OptimConfig:
    lr: float = 3e-6
    """AdamW learning rate (paper: 3e-6)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_ratio: float = 0.1
    """Share of steps with linear warm-up before the cosine decay."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a share of lr."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables)."""


@dataclass
class TrainerConfig:
    steps: int | None = 40
    """Optimizer steps (rollout batches); null: epochs x batches per epoch."""
    epochs: int = 1
    """Used when steps is null (paper: 6, test-time training: 30)."""
    prompts_per_step: int = 16
    """Prompts per step (paper: 128); rollouts per step = prompts_per_step x rollout.n."""
    save_every: int = 20
    """Checkpoint every N steps (and at the end); 0 only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk."""
    keep_best: str | None = "val/acc"
    """Also keep the checkpoint with the best value of this logged metric (validation split),
    for `omgrpo eval --checkpoint best`; null keeps only the newest."""
    log_rollouts_every: int = 5
    """Write the step's rollouts to the run store every N steps (and at step 1)."""
    max_consecutive_skips: int = 3
    """Abort after this many consecutive steps with a NaN/inf loss."""
    progress: bool = True
    """Show a progress bar when stderr is a terminal (false: plain lines, as in a log)."""
    log_every: int = 1
    """Print a one-line summary (step, reward, answers per prompt, kl/answer, kl/reasoning,
    last val/acc, s/step) every N steps when stdout is not a terminal or there is no bar;
    0: never."""
    threads: int | None = None
    """torch CPU threads (null: torch's default)."""
    grad_probe_every: int = 0
    """Every N steps (0: never), before the update, measure the policy-gradient parts of the
    answer tokens and of the other response tokens separately (unmasked, on up to 64 rollouts):
    `grad/answer_norm`, `grad/reasoning_norm`, `grad/answer_reasoning_cos`."""
    shuffle_advantages: bool = False
    """Null control: permute the advantages within each group before the update, so the update
    carries the rollouts' usual magnitudes but no reward signal (drift without reward)."""


@dataclass
class DiagnosticsConfig:
    mechanism_every: int = 0
    """Native backend: at step 1 and every N steps (0: never), before the update, measure how
    the step moves the answer "1" (`omgrpo.backends.native.mechanism`, the `mech/*` metrics):
    teacher-forced gates on gold reasoning, the update's direct effect on P(box "1") at fixed
    held-out prefixes split into the answer tokens', the other tokens' and the momentum's
    parts, the leakage cosine and the drift from the reference. Leaves training unchanged;
    without a reference model (`algorithm.kl_coef=0`) it keeps a copy of the base."""
    mechanism_prompts: int = 128
    """Held-out (validation) problems the gates' gold prefixes and the fixed own-reasoning
    prefixes are built from."""


@dataclass
class CollapseConfig:
    max_unique_per_prompt: float = COLLAPSE_DEFAULTS["max_unique_per_prompt"]
    """Collapse needs mean distinct answers per prompt at or below this..."""
    min_mode_share: float = COLLAPSE_DEFAULTS["min_mode_share"]
    """...and the batch's most common answer in at least this share of all rollouts..."""
    patience: int = COLLAPSE_DEFAULTS["patience"]
    """...for this many consecutive steps."""
    stop: bool = False
    """End the run cleanly when collapse is detected (status `collapsed`)."""
    confident_share: float = 0.75
    """`answers/confidently_wrong` counts wrong majorities holding at least this vote share."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    car: CarConfig = field(default_factory=CarConfig)
    seed: int = 0
    """Seed of sampling and data order (the toy base has its own seed: model.warm_start.seed)."""
    method: str = "om_grpo"
    """Name of the composed method preset (set by `method/*.yaml`); informational."""


def register_configs() -> None:
    """The schema in Hydra's ConfigStore, once per process (building it from the dataclasses
    took a third of every `compose`), and YAML read by libyaml (`read_yaml_with_libyaml`)."""
    read_yaml_with_libyaml()
    cs = ConfigStore.instance()
    if "omgrpo_schema.yaml" not in cs.repo:
        cs.store(name="omgrpo_schema", node=Config)


def read_yaml_with_libyaml() -> None:
    """Make OmegaConf (so Hydra: every preset, and verl's 81 config files per verl compose)
    parse YAML with libyaml's parser instead of PyYAML's pure-Python one: the same loader class
    otherwise (OmegaConf's duplicate-key check, float and Path rules). The YAML files of
    experiments/, sweeps/, verl's and Hydra's configs and the committed run configs (328) load to
    the same data ~7x faster (tests/test_config_yaml.py), a verl compose ~25 % and a toy one
    ~15 % quicker. A no-op where PyYAML was built without libyaml."""
    import omegaconf._utils as omegaconf_utils
    import yaml

    if not hasattr(yaml, "CSafeLoader") or hasattr(omegaconf_utils.get_yaml_loader, "libyaml"):
        return

    class LibyamlLoader(yaml.CSafeLoader, omegaconf_utils.get_yaml_loader()):
        """libyaml's parser (first in the MRO), OmegaConf's constructor and resolver rules."""

    def get_yaml_loader() -> type:
        return LibyamlLoader

    get_yaml_loader.libyaml = True  # type: ignore[attr-defined]
    omegaconf_utils.get_yaml_loader = get_yaml_loader


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the config as `omgrpo train` would (for tests, notebooks and sweeps)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(EXPERIMENTS_DIR)):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def to_container(cfg: DictConfig) -> dict:
    """Resolved plain dict (what is logged and what resume compares)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
