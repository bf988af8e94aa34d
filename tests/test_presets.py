"""Hydra presets: every method x every experiment composes; paper presets carry the paper's
hyperparameters (appendix "Implementation Details"); method presets set what their comments
say (reward parts, answer-token weight w, CAR, G)."""

import functools

import pytest

from omgrpo.config import EXPERIMENTS_DIR, compose
from omgrpo.models.loading import base_model_dir

METHODS = sorted(p.stem for p in (EXPERIMENTS_DIR / "method").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (EXPERIMENTS_DIR / "experiment").glob("*.yaml"))
PAPER = [e for e in EXPERIMENTS if e.startswith("paper")]
TOY = [e for e in EXPERIMENTS if e.startswith("toy")]

SV = ["soft_vote", "format"]
# method -> (reward parts, answer_weight w, format_only, car.enable, rollout.n)
EXPECTED = {
    "gt": (["gt"], 1.0, False, False, 8),
    "mv": (["majority_vote"], 1.0, False, False, 8),
    "self_certainty": (["self_certainty"], 1.0, False, False, 8),
    "entropy": (["entropy"], 1.0, False, False, 8),
    "coreward": (["coreward"], 1.0, False, False, 8),
    "om_grpo": (SV, 0.0, False, True, 8),
    "om_grpo_no_omu": (SV, 1.0, False, True, 8),
    "om_grpo_no_car": (SV, 0.0, False, False, 8),
    "om_grpo_no_soft": (["majority_vote", "format"], 0.0, False, False, 8),
    "om_grpo_no_car_no_omu": (SV, 1.0, False, False, 8),
    "om_grpo_w025": (SV, 0.25, False, True, 8),
    "om_grpo_w050": (SV, 0.5, False, True, 8),
    "om_grpo_w075": (SV, 0.75, False, True, 8),
    "om_grpo_format_only": (SV, 0.0, True, True, 8),
    "om_grpo_no_car_n8": (SV, 0.0, False, False, 8),
    "om_grpo_no_car_n16": (SV, 0.0, False, False, 16),
    "om_grpo_no_car_n64": (SV, 0.0, False, False, 64),
    "om_grpo_kl_anchor": (SV, 0.0, False, False, 8),
    "om_grpo_no_car_w025": (SV, 0.25, False, False, 8),
    "om_grpo_no_car_w050": (SV, 0.5, False, False, 8),
    "om_grpo_no_car_w075": (SV, 0.75, False, False, 8),
    "om_grpo_no_car_format_only": (SV, 0.0, True, False, 8),
    "mv_shuffled": (["majority_vote"], 1.0, False, False, 8),
    "om_grpo_closing": (SV, 0.0, False, True, 8),
    "om_grpo_no_car_closing": (SV, 0.0, False, False, 8),
    "om_grpo_no_car_closing_line": (SV, 0.0, False, False, 8),
    # study v4's generic masks (PREREGISTRATION-v4's arm table)
    "om_grpo_no_car_closing_only": (SV, 0.0, False, False, 8),
    "om_grpo_no_car_top_entropy": (SV, 1.0, False, False, 8),
    "om_grpo_no_car_random_mask": (SV, 1.0, False, False, 8),
    "prm": (["process", "format"], 1.0, False, False, 8),
    "prm_om": (["process", "format"], 0.0, False, False, 8),
    "prm_last": (["process", "format"], 1.0, False, False, 8),
    "prm_mean": (["process", "format"], 1.0, False, False, 8),
    "prm_product": (["process", "format"], 1.0, False, False, 8),
}


@functools.cache  # several tests read the same pairs (and never change a config)
def _compose(experiment: str, method: str = "om_grpo", *extra: str):
    overrides = [f"experiment={experiment}", f"method={method}", *extra]
    if experiment.startswith("paper"):
        overrides.append("model.path=/models/backbone")
    return compose(overrides)


def test_the_preset_lists_are_what_the_docs_promise():
    assert set(METHODS) == set(EXPECTED), "document a new method preset in EXPECTED"
    assert set(EXPERIMENTS) >= {
        "toy",
        "toy_weak",
        "toy_strong",
        "toy_ttt",
        "paper",
        "paper_qwen3_1p7b",
        "paper_llama3p2_3b",
        "paper_qwen2p5_7b",
        "paper_ttt",
    }


@pytest.mark.parametrize("group", ["method", "experiment"])
def test_every_preset_file_says_what_it_is(group):
    for path in sorted((EXPERIMENTS_DIR / group).glob("*.yaml")):
        lines = path.read_text().splitlines()
        assert lines[0] == "# @package _global_", path
        assert lines[1].startswith("# ") and len(lines[1]) > 10, f"{path}: describe the preset"


def _keys(group: str, name: str) -> set[str]:
    """The dotted keys a preset sets, with those of the presets of its group it builds on
    (`defaults: [toy, _self_]`)."""
    from omgrpo.errors import read_yaml

    def flat(node: dict, prefix: str = "") -> set[str]:
        keys = set()
        for key, value in node.items():
            if isinstance(value, dict):
                keys |= flat(value, f"{prefix}{key}.")
            elif key != "defaults" or prefix:
                keys.add(f"{prefix}{key}")
        return keys

    data = read_yaml(EXPERIMENTS_DIR / group / f"{name}.yaml") or {}
    parents = [d for d in data.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return flat(data).union(*(_keys(group, parent) for parent in parents))


def _pairs() -> list[tuple[str, str]]:
    """Every method at a toy and a paper scale, every scale with two methods, and every pair
    whose presets set a common key. The rest add nothing: the presets hold no interpolations,
    so a pair sharing no key composes as the union of what each sets (composing all 14 x 34
    pairs took ~110 CPU-s of the suite)."""
    experiments = {e: _keys("experiment", e) for e in EXPERIMENTS}
    methods = {m: _keys("method", m) for m in METHODS}
    pairs = {(e, m) for m in METHODS for e in ("toy", "paper_qwen3_1p7b")}
    pairs |= {(e, m) for e in EXPERIMENTS for m in ("om_grpo", "mv")}
    pairs |= {(e, m) for e in EXPERIMENTS for m in METHODS if experiments[e] & methods[m]}
    return sorted(pairs)


def test_presets_hold_no_interpolations():
    """What `_pairs` leaves out relies on it."""
    for group in ("experiment", "method"):
        for path in (EXPERIMENTS_DIR / group).glob("*.yaml"):
            assert "${" not in path.read_text(), path


def test_preset_keys_are_read_with_their_parents():
    assert "model.warm_start.steps" in _keys("experiment", "toy_shortcut")  # from toy
    assert "task.hard_share" in _keys("experiment", "toy_mixed")  # via toy_shortcut
    assert {"reward.prm.aggregate", "reward.parts"} <= _keys("method", "prm_last")  # via prm
    assert not any(k.startswith("defaults") for k in _keys("method", "prm_last"))


@pytest.mark.parametrize(("experiment", "method"), _pairs())
@pytest.mark.slow
def test_every_method_composes_at_every_scale(method, experiment):
    cfg = _compose(experiment, method)
    assert cfg.method == method
    assert cfg.run.variant == method
    assert cfg.run.experiment == experiment  # keeps the scales' run names apart
    assert cfg.run.name == f"{experiment}__{method}__s0"
    parts, w, format_only, car, n = EXPECTED[method]
    assert list(cfg.reward.parts) == parts
    assert cfg.algorithm.answer_weight == w
    assert cfg.algorithm.format_only is format_only
    assert cfg.car.enable is car
    assert cfg.rollout.n == n  # method presets win over the scale's G
    assert cfg.algorithm.answer_kl_weight == (1.0 if method == "om_grpo_kl_anchor" else None)
    # only the closing-span presets leave the paper's answer span
    spans = ("closing_line", "closing_only", "closing")
    span = next((s for s in spans if method.endswith(f"_{s}")), "boxed")
    assert cfg.algorithm.answer_span == span
    # only study v4's generic-mask presets mask more than the answer span
    top_entropy = 0.2 if method == "om_grpo_no_car_top_entropy" else None
    assert cfg.algorithm.top_entropy_quantile == top_entropy
    assert cfg.algorithm.random_mask == (
        "boxed" if method == "om_grpo_no_car_random_mask" else None
    )


@pytest.mark.parametrize("experiment", PAPER)
def test_paper_presets_have_the_papers_hyperparameters(experiment):
    cfg = _compose(experiment)
    ttt = experiment.endswith("ttt")
    assert cfg.optim.lr == pytest.approx(3e-6)
    assert list(cfg.optim.betas) == [0.9, 0.999]
    assert cfg.optim.eps == pytest.approx(1e-8)
    assert cfg.optim.warmup_ratio == pytest.approx(0.1)
    assert cfg.algorithm.kl_coef == pytest.approx(0.005)
    assert cfg.algorithm.clip == pytest.approx(0.2)
    assert cfg.rollout.n == 8
    assert cfg.trainer.prompts_per_step == 128
    assert cfg.rollout.max_prompt_len == 512
    assert cfg.rollout.max_new_tokens == 3072
    assert cfg.rollout.temperature == 1.0
    assert cfg.eval.temperature == pytest.approx(0.8)
    assert cfg.eval.top_p == pytest.approx(0.95)
    assert cfg.trainer.steps is None
    assert cfg.trainer.epochs == (30 if ttt else 6)
    assert cfg.task.ttt is ttt
    assert cfg.task.name == "files"


@pytest.mark.parametrize("experiment", PAPER)
@pytest.mark.slow
def test_paper_presets_need_a_model_path(experiment):
    # `model.path: ???` documents the requirement (OmegaConf keeps the schema's null when
    # merging ???); without a path the trainer refuses to build the toy model for task files.
    assert "path: ???" in (EXPERIMENTS_DIR / "experiment" / f"{experiment}.yaml").read_text()
    cfg = compose([f"experiment={experiment}"])
    assert cfg.model.path is None
    with pytest.raises(ValueError, match=r"set model\.path"):
        base_model_dir(cfg.model, cfg.task, None)


@pytest.mark.parametrize(
    ("experiment", "warm_start_steps", "ttt", "steps", "epochs"),
    [
        ("toy", 600, False, 40, 1),
        ("toy_weak", 200, False, 40, 1),
        ("toy_strong", 1500, False, 40, 1),
        ("toy_ttt", 600, True, None, 5),
    ],
)
def test_toy_scales(experiment, warm_start_steps, ttt, steps, epochs):
    cfg = _compose(experiment)
    assert cfg.model.path is None
    assert cfg.model.device == "cpu"
    assert cfg.task.name == "toy"
    assert cfg.model.warm_start.steps == warm_start_steps
    assert cfg.task.ttt is ttt
    assert cfg.trainer.steps == steps
    assert cfg.trainer.epochs == epochs
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.car.pairs_per_anchor is None  # CAR uses all G(G-1) pairs unless asked


def test_command_line_overrides_still_win_over_presets():
    cfg = _compose("paper_qwen3_1p7b", "om_grpo_no_car_n16", "rollout.n=4", "car.enable=true")
    assert cfg.rollout.n == 4
    assert cfg.car.enable is True


@pytest.mark.slow
def test_only_the_null_control_shuffles_advantages():
    for method in METHODS:
        cfg = _compose("toy", method)
        assert cfg.trainer.shuffle_advantages is (method == "mv_shuffled"), method
