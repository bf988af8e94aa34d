"""The paper's figures from a `load_runs` frame: one function per figure.

Each `name(df, out_dir, *, rollouts=None) -> [png, pdf]` draws from the runs it needs and writes
`out_dir/<name>.png` and `.pdf`; `draw_<name>(df, rollouts=None) -> Figure` returns the
matplotlib Figure instead (notebooks display it inline). When the runs needed are not in `df`,
both raise `MissingRunsError` saying which `omgrpo train` presets produce them.

Curves are means over seeds (runs of the same experiment and variant). With 3 or more seeds a
band shows the 95% Student-t interval of the mean (legend: "mean ± 95% CI, n=3"); with 2 seeds a
t-interval is meaningless (t = 12.7), so thin lines show each seed instead (legend: "mean of
n=2; thin lines: seeds"). Bands and y-limits are clipped to the metric's range (`metric_range`:
accuracies and shares in [0, 1], counts, KL, entropies and times >= 0). Per-step training
metrics of long runs are smoothed with a trailing rolling mean (the axis label says over how
many steps), validation metrics never.
Figures are drawn on `matplotlib.figure.Figure` with the Agg canvas: no pyplot state, safe
in scripts, tests and notebooks.
"""

from __future__ import annotations

import io
import math
import re
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from omgrpo.analysis.load import aggregate_seeds, run_roots

__all__ = [
    "FIGURES",
    "MissingRunsError",
    "all_figures",
    "answer_weight",
    "base_strength",
    "car_mechanics",
    "car_top_vote",
    "collapse_route",
    "failure_recovery",
    "kl_answer_reasoning",
    "metric_range",
    "prm_baselines",
    "rollout_bias",
    "save_png",
    "ten_epoch_dynamics",
    "token_roles",
    "training_dynamics",
    "unique_answers",
]


class MissingRunsError(LookupError):
    """The runs (or metrics) a figure or table needs are not in the frame; the message names
    the `omgrpo train` presets that produce them."""


# -- how to produce the runs each figure needs -------------------------------------------------
SEEDS = "(a few seeds each: `seed=0`, `seed=1`, `seed=2`)"
HINT_METHODS = (
    "`omgrpo train method=gt`, `omgrpo train method=mv`, `omgrpo train method=om_grpo` "
    f"{SEEDS}, or the matching sweep in sweeps/"
)
HINT_LONG = (
    "long runs of each method, e.g. `omgrpo train method=mv trainer.steps=null "
    "trainer.epochs=10` and the same with method=om_grpo, gt, self_certainty, coreward"
)
HINT_WEIGHT = (
    "om_grpo runs with different answer-token weights: `omgrpo train method=om_grpo "
    "algorithm.answer_weight=0.25 run.variant=w0.25` (likewise 0.5 and 0.75), `omgrpo train "
    "method=om_grpo algorithm.format_only=true run.variant=format_only`, next to "
    "`omgrpo train method=om_grpo` (w=0), or the answer-weight sweep in sweeps/"
)
HINT_CAR = (
    "runs with CAR on, which log car/*: `omgrpo train method=om_grpo car.enable=true "
    "run.variant=om_grpo_car`"
)
HINT_N = (
    "om_grpo runs at several rollout budgets and with CAR: `omgrpo train method=om_grpo "
    "car.enable=true run.variant=car_n8` (n=8), `omgrpo train method=om_grpo rollout.n=8 "
    "run.variant=n8`, `rollout.n=16 run.variant=n16`, `rollout.n=64 run.variant=n64`"
)
HINT_BASE = (
    "runs from bases of different strength: `omgrpo train method=mv "
    "model.warm_start.steps=150 run.experiment=weak` and `model.warm_start.steps=1200 "
    "run.experiment=strong` (likewise method=om_grpo), or real bases of different size "
    "(`model.path=...`)"
)
HINT_PRM = (
    "runs rewarded by a process reward model next to OM-GRPO: `omgrpo train method=prm` "
    "(and prm_last, prm_mean, prm_product, prm_om), `omgrpo train method=om_grpo_no_car`, "
    "or sweeps/prm.yaml"
)
HINT_RECOVERY = (
    "runs with validation on a labelled split (`eval.every>0`) whose base leaves some "
    "validation prompts unsolved at step 0 (a weak base: `model.warm_start.steps=150`): "
    "`omgrpo train method=om_grpo eval.every=5 model.warm_start.steps=150`"
)

METHOD_ORDER = ("gt", "om_grpo", "mv", "self_certainty", "entropy", "coreward")
METHOD_COLORS = {
    "gt": "#444444",
    "om_grpo": "#1f77b4",
    "mv": "#d62728",
    "self_certainty": "#9467bd",
    "entropy": "#8c564b",
    "coreward": "#2ca02c",
}
_PALETTE = ("#ff7f0e", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#aec7e8", "#98df8a")


# -- helpers -----------------------------------------------------------------------------------
MIN_SEEDS_FOR_CI = 3
"""Fewer seeds draw each seed instead of a t-band (a 2-seed 95% interval uses t = 12.7)."""

_UNIT_INTERVAL = re.compile(
    r"(val/(acc(_\w+)?|pass@\w+|extract_rate|consistency|guess_rate_\w+|bare_guess_rate"
    r"|peak_share)|acc/.+|recovery/cum_(pass|avg)|rollout/top_answer_share"
    r"|answers/(batch_mode_share|extract_rate|top_vote_acc|confidently_wrong|label_flip_rate"
    r"|wrong_majority|consistency|guess_rate_\w+|bare_guess_rate|peak_share)"
    r"|car/(position_bias|select_correct|incorrect_pair_first|top_vote_acc|unclosed)"
    r"|reward_quality/(reward_acc|majority_ratio|zero_spread_groups)"
    r"|clip/frac|answer/frac)"
)
_NON_NEGATIVE = re.compile(
    r"(answers/(unique_.+|vote_entropy)|val/unique_answers|kl/.+|loss/kl|entropy/.+"
    r"|car/(anchor_entropy_.+|pool_size|truncated|num_pairs)|recovery/zero_pass_prompts"
    r"|time/.+|mem/.+|perf/.+|response/.+|grad/(norm|answer_norm|reasoning_norm)|lr|train/.+)"
)


def metric_range(metric: str) -> tuple[float, float]:
    """The values `metric` can take: (0, 1) for accuracies and shares, (0, inf) for counts,
    KL, entropies and times, (-inf, inf) otherwise (rewards, losses, advantages)."""
    if _UNIT_INTERVAL.fullmatch(metric):
        return 0.0, 1.0
    if _NON_NEGATIVE.fullmatch(metric):
        return 0.0, math.inf
    return -math.inf, math.inf


def _numeric(df: pd.DataFrame, metric: str) -> pd.Series:
    return pd.to_numeric(df[metric], errors="coerce") if metric in df else pd.Series(dtype=float)


def _has(df: pd.DataFrame, metric: str) -> bool:
    return metric in df.columns and bool(_numeric(df, metric).notna().any())


def _need(df: pd.DataFrame, what: str, metrics: Sequence[str], hint: str) -> None:
    if df is None or df.empty:
        raise MissingRunsError(f"{what}: no runs loaded; it needs {hint}")
    missing = [m for m in metrics if not _has(df, m)]
    if missing:
        raise MissingRunsError(f"{what}: no run logs {', '.join(missing)}; it needs {hint}")


def _cfg(df: pd.DataFrame, key: str, default=None) -> pd.Series:
    col = f"cfg.{key}"
    return df[col] if col in df.columns else pd.Series(default, index=df.index, dtype=object)


def _with_labels(df: pd.DataFrame, label: pd.Series | None = None) -> pd.DataFrame:
    """`df` with a `curve` column: the variant (experiment/variant if several experiments)."""
    out = df.copy()
    if label is None:
        multi = out["experiment"].nunique() > 1
        label = (
            out["experiment"].astype(str) + "/" + out["variant"].astype(str)
            if multi
            else out["variant"].astype(str)
        )
        roots = run_roots(out)
        label = pd.Series(
            [f"{r}: {lab}" if r else lab for r, lab in zip(roots, label)], index=out.index
        )
    out["curve"] = label.astype(str).to_numpy()
    return out


def _order(labels: Sequence[str], df: pd.DataFrame) -> list[str]:
    """Curves in paper order: by method (gt, om_grpo, mv, ...), then name."""
    method_of = df.drop_duplicates("curve").set_index("curve")["method"].to_dict()

    def key(label: str):
        method = str(method_of.get(label, ""))
        rank = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
        return (rank, label)

    return sorted(set(labels), key=key)


def _colors(df: pd.DataFrame) -> dict[str, str]:
    """One color per curve: the method's color for the first curve of each method."""
    out, used, spare = {}, set(), iter(_PALETTE * 10)
    for label in _order(df["curve"].unique(), df):
        method = str(df.loc[df["curve"] == label, "method"].iloc[0])
        color = METHOD_COLORS.get(method)
        if color is None or color in used:
            color = next(spare)
        used.add(color)
        out[label] = color
    return out


def _window(metric: str, n_points: int) -> int:
    if metric.startswith(("val/", "recovery/")):
        return 1
    return max(1, n_points // 40)


def _curves(
    ax: Axes,
    df: pd.DataFrame,
    metric: str,
    *,
    colors: dict[str, str],
    scale: float | pd.Series = 1.0,
    linestyle: str = "-",
    suffix: str = "",
    labels: Sequence[str] | None = None,
    ylabel: str | None = None,
) -> int:
    """The mean over seeds of `metric` per curve, with a 95% CI band (n >= 3 seeds) or each
    seed's line (n = 2), clipped to `metric_range`; returns the number of curves drawn."""
    # only the columns used below, not a copy of every logged metric per curve
    data = df[[c for c in ("curve", "method", "run", "step") if c in df.columns]].copy()
    data[metric] = _numeric(df, metric) * scale
    data = data.dropna(subset=[metric])
    if data.empty:
        return 0
    lo, hi = metric_range(metric)
    agg = aggregate_seeds(data, metric, by=("curve", "step"))
    drawn, window = 0, 1
    for label in labels or _order(agg["curve"].unique(), data):
        g = agg[agg["curve"] == label].sort_values("step")
        if g.empty:
            continue
        window = _window(metric, len(g))

        def smooth(values: pd.Series, window=window) -> np.ndarray:
            return values.rolling(window, min_periods=1).mean().to_numpy(dtype=float)

        mean = smooth(g["mean"])
        ci = smooth(g["ci95"].where(g["n"] >= MIN_SEEDS_FOR_CI))
        x = g["step"].to_numpy(dtype=float)
        n = int(g["n"].max())
        color = colors.get(label)
        marker = "o" if len(g) <= 12 else None
        name = label + suffix + _seeds_note(n)
        ax.plot(x, mean, linestyle=linestyle, color=color, label=name, marker=marker, ms=3)
        if n >= MIN_SEEDS_FOR_CI and np.isfinite(ci).any():
            band = np.clip(mean - ci, lo, hi), np.clip(mean + ci, lo, hi)
            ax.fill_between(x, *band, color=color, alpha=0.18, linewidth=0)
        elif n > 1:
            for _, seed in data[data["curve"] == label].groupby("run"):
                seed = seed.sort_values("step")
                ax.plot(
                    seed["step"].to_numpy(dtype=float),
                    smooth(seed[metric]),
                    linestyle=linestyle,
                    color=color,
                    linewidth=0.7,
                    alpha=0.45,
                )
        drawn += 1
    _fit_ylim(ax, (lo, hi), data[metric].to_numpy(dtype=float), agg["mean"].to_numpy(dtype=float))
    text = ylabel or metric
    if window > 1:
        text += f"\n(rolling mean, {window} steps)"
    ax.set_ylabel(text)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return drawn


def _seeds_note(n: int) -> str:
    """What a curve shows, for its legend entry."""
    if n >= MIN_SEEDS_FOR_CI:
        return f" (mean ± 95% CI, n={n})"
    if n == 2:
        return " (mean of n=2; thin lines: seeds)"
    return ""


_YRANGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fit_ylim(ax: Axes, bounds: tuple[float, float], *values: np.ndarray) -> None:
    """Y limits from the seeds' values and the means (union over the curves of this axes), not
    from the CI bands: with 3 seeds a 95% t-interval is wide and would flatten the curves; the
    band then runs off the axes, which is what it should show. Never beyond `bounds` (the
    metric's range), so an accuracy axis never shows values below 0 or above 1."""
    finite = np.concatenate([v[np.isfinite(v)] for v in values])
    if not finite.size:
        return
    lo, hi = _YRANGE.get(ax, (math.inf, -math.inf))
    lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    _YRANGE[ax] = (lo, hi)
    pad = 0.08 * (hi - lo) if hi > lo else max(0.05 * abs(hi), 0.05)
    ax.set_ylim(max(lo - pad, bounds[0]), min(hi + pad, bounds[1]))


def _same_ylim(axes: Sequence[Axes]) -> None:
    lo = min(ax.get_ylim()[0] for ax in axes)
    hi = max(ax.get_ylim()[1] for ax in axes)
    for ax in axes:
        ax.set_ylim(lo, hi)


def _new_figure(rows: int, cols: int, *, width: float = 4.2, height: float = 3.2) -> Figure:
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots(rows, cols, squeeze=False)
    return fig


def _axes(fig: Figure) -> list[Axes]:
    return list(fig.axes)


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False)


def _save(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, pdf = out_dir / f"{name}.png", out_dir / f"{name}.pdf"
    save_png(fig, png, dpi=150)
    # The PNG's draw placed the axes (constrained layout); the PDF keeps those positions rather
    # than laying the figure out again: 16 % less CPU for both files, every axes within 0.0003
    # of the figure's size of where a layout of its own would put it (a study's 8 figures).
    fig.set_layout_engine("none")
    fig.savefig(pdf, metadata=_metadata("pdf"))
    return [png, pdf]


def save_png(fig: Figure, path: Path, dpi: int) -> None:
    """`fig` as a 256-colour palette PNG: line plots on a white background lose nothing
    visible, and the file is about a third of matplotlib's RGBA one (the committed reports'
    figures must fit the repository's size budget)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    rgb = Image.open(buffer).convert("RGB")
    palette = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)


def _metadata(ext: str) -> dict:
    # No timestamps: the same runs give byte-identical PDFs.
    return {"CreationDate": None} if ext == "pdf" else {}


def _scales(df: pd.DataFrame) -> list[str]:
    return sorted(df["scale"].astype(str).unique())


def _bool(series: pd.Series) -> pd.Series:
    return series.map(lambda v: str(v).lower() in ("true", "1", "1.0"))


def _car_on(df: pd.DataFrame) -> pd.Series:
    """Rows of runs with CAR: `cfg.car.enable`, or (older configs) any car/* metric logged."""
    if "cfg.car.enable" in df.columns:
        return _bool(df["cfg.car.enable"])
    car_cols = [c for c in df.columns if c.startswith("car/")]
    if not car_cols:
        return pd.Series(False, index=df.index)
    logged = df[car_cols].apply(pd.to_numeric, errors="coerce").notna().any(axis=1)
    return logged.groupby(df["run"]).transform("any")


# -- the figures -------------------------------------------------------------------------------
def draw_training_dynamics(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. 1: validation accuracy over steps (one row per base model) and distinct
    answers per batch; every variant, mean over seeds (bands: see the module doc). Majority
    voting's answers per batch fall towards 1 as it collapses; OM-GRPO keeps them near
    GT-Reward's."""
    _need(df, "training dynamics", ["val/acc", "answers/unique_per_batch"], HINT_METHODS)
    df = _with_labels(df)
    colors = _colors(df)
    scales = _scales(df)
    fig = _new_figure(len(scales), 2)
    axes = _axes(fig)
    for i, scale in enumerate(scales):
        part = df[df["scale"].astype(str) == scale]
        a, b = axes[2 * i], axes[2 * i + 1]
        _curves(a, part, "val/acc", colors=colors, ylabel="val/acc (avg@k)")
        _curves(b, part, "answers/unique_per_batch", colors=colors, ylabel="unique answers / batch")
        a.set_title(f"{scale}: validation accuracy")
        b.set_title(f"{scale}: answers per batch")
        _legend(a)
    fig.suptitle("Training dynamics")
    return fig


def draw_ten_epoch_dynamics(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (10-epoch dynamics): validation accuracy, the KL loss scaled by the KL
    coefficient (β · loss/kl), and the entropy of reasoning and answer tokens. Self-certainty
    collapses into over-confident repetition (KL spikes, entropy vanishes), CoReward drifts to
    high entropy, MV to consensus with low KL; OM-GRPO tracks GT-Reward."""
    metrics = ["val/acc", "loss/kl", "entropy/reasoning", "entropy/answer"]
    _need(df, "10-epoch dynamics", metrics, HINT_LONG)
    df = _with_labels(df)
    colors = _colors(df)
    beta = pd.to_numeric(_cfg(df, "algorithm.kl_coef", 1.0), errors="coerce").fillna(1.0)
    fig = _new_figure(1, 4, width=3.8)
    a, b, c, d = _axes(fig)
    _curves(a, df, "val/acc", colors=colors, ylabel="val/acc (avg@k)")
    _curves(b, df, "loss/kl", colors=colors, scale=beta, ylabel="β · loss/kl")
    _curves(c, df, "entropy/reasoning", colors=colors)
    _curves(d, df, "entropy/answer", colors=colors)
    for ax, title in zip(
        (a, b, c, d), ("accuracy", "KL loss", "entropy: reasoning", "entropy: answer")
    ):
        ax.set_title(title)
    _legend(a)
    fig.suptitle("Training dynamics over long training")
    return fig


def _weight_label(row_w, row_fo, row_car) -> str:
    if str(row_fo).lower() in ("true", "1"):
        label = "format-only"
    else:
        w = pd.to_numeric(pd.Series([row_w]), errors="coerce").iloc[0]
        label = "w = ?" if pd.isna(w) else f"w = {float(w):g}"
        if label == "w = 0":
            label = "w = 0 (OM-GRPO)"
        elif label == "w = 1":
            label = "w = 1 (w/o OMU)"
    return label + (" + CAR" if row_car else "")


def draw_answer_weight(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (soft answer-token down-weighting): validation accuracy of om_grpo runs by
    the weight w of the outcome-reward gradient on answer tokens (w = 0 is OM-GRPO) and the
    format-only variant. Small w stays stable; w = 0.5 degrades, w = 0.75 collapses."""
    what = "answer-token down-weighting"
    _need(df, what, ["val/acc"], HINT_WEIGHT)
    part = df[df["method"] == "om_grpo"]
    if part.empty:
        raise MissingRunsError(f"{what}: no run with method=om_grpo; it needs {HINT_WEIGHT}")
    car = _car_on(part)
    labels = [
        _weight_label(w, fo, c)
        for w, fo, c in zip(
            _cfg(part, "algorithm.answer_weight", 0.0),
            _cfg(part, "algorithm.format_only", False),
            car,
        )
    ]
    part = _with_labels(part, pd.Series(labels, index=part.index))
    if part["curve"].nunique() < 2:
        raise MissingRunsError(
            f"{what}: all om_grpo runs have the same answer weight ({labels[0]}); it needs "
            f"{HINT_WEIGHT}"
        )

    def rank(label: str):
        if label.startswith("format-only"):
            return (2.0, label)
        try:
            return (float(label.split("=")[1].split()[0]), label)
        except (IndexError, ValueError):
            return (3.0, label)

    order = sorted(part["curve"].unique(), key=rank)
    cmap = ["#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#8c564b", "#9467bd", "#7f7f7f"]
    colors = {label: cmap[i % len(cmap)] for i, label in enumerate(order)}
    fig = _new_figure(1, 1, width=5.5, height=3.6)
    (ax,) = _axes(fig)
    _curves(ax, part, "val/acc", colors=colors, labels=order, ylabel="val/acc (avg@k)")
    ax.set_title("Answer-token down-weighting (om_grpo)")
    _legend(ax)
    return fig


def draw_kl_answer_reasoning(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (KL on answer vs reasoning tokens): per-token KL to the reference on the
    answer span and on the reasoning tokens. Under MV the answer-token KL rises sharply while
    reasoning KL grows slowly: collapse lives on the answer span; OM-GRPO keeps both low."""
    _need(df, "KL on answer vs reasoning tokens", ["kl/answer", "kl/reasoning"], HINT_METHODS)
    df = _with_labels(df)
    colors = _colors(df)
    fig = _new_figure(1, 2)
    a, b = _axes(fig)
    _curves(a, df, "kl/answer", colors=colors, ylabel="KL (answer tokens)")
    _curves(b, df, "kl/reasoning", colors=colors, ylabel="KL (reasoning tokens)")
    _same_ylim([a, b])
    a.set_title("answer tokens")
    b.set_title("reasoning tokens")
    _legend(a)
    fig.suptitle("KL divergence to the reference policy")
    return fig


def draw_car_top_vote(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (CAR and top-vote accuracy): how often the top-voted answer of a group is
    correct, with CAR's augmented pool (solid, `car/top_vote_acc`) and, on the same rollouts,
    without the pair answers (dashed, `answers/top_vote_acc`); right: validation accuracy of
    om_grpo runs with and without CAR."""
    what = "CAR and top-vote accuracy"
    _need(df, what, ["car/top_vote_acc", "answers/top_vote_acc"], HINT_CAR)
    car = _car_on(df) & _numeric(df, "car/top_vote_acc").notna().groupby(df["run"]).transform("any")
    runs = _with_labels(df[car])
    colors = _colors(runs)
    fig = _new_figure(1, 2, width=4.8)
    a, b = _axes(fig)
    _curves(a, runs, "car/top_vote_acc", colors=colors, suffix=" (with CAR)")
    _curves(
        a,
        runs,
        "answers/top_vote_acc",
        colors=colors,
        linestyle="--",
        suffix=" (without CAR)",
        ylabel="top-vote accuracy",
    )
    a.set_title("top-voted answer is correct")
    _legend(a)
    om = df[df["method"] == "om_grpo"]
    om = _with_labels(om, om["variant"].astype(str) + np.where(_car_on(om), " (CAR)", " (no CAR)"))
    if _has(om, "val/acc"):
        _curves(b, om, "val/acc", colors=_colors(om), ylabel="val/acc (avg@k)")
        _legend(b)
    b.set_title("validation accuracy, om_grpo")
    fig.suptitle("Contrast-augmented reward and vote reliability")
    return fig


def draw_unique_answers(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (unique answers per sample): mean number of distinct answers among the G
    rollouts of a prompt. MV approaches 1 (one answer whatever the question); OM-GRPO stays
    near GT-Reward."""
    _need(df, "unique answers per sample", ["answers/unique_per_prompt"], HINT_METHODS)
    df = _with_labels(df)
    colors = _colors(df)
    scales = _scales(df)
    fig = _new_figure(1, len(scales), width=5.0, height=3.4)
    for ax, scale in zip(_axes(fig), scales):
        part = df[df["scale"].astype(str) == scale]
        _curves(
            ax, part, "answers/unique_per_prompt", colors=colors, ylabel="unique answers / prompt"
        )
        ax.set_title(f"{scale}: distinct answers per sample")
        _legend(ax)
    return fig


CAR_MECHANICS = (
    "car/position_bias",
    "car/select_correct",
    "car/incorrect_pair_first",
    "car/anchor_entropy_correct",
    "car/anchor_entropy_incorrect",
)


def draw_car_mechanics(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (mechanistic analysis of CAR): (a) position bias, share of pair answers that
    pick solution 1 when the two answers differ (0.5 = none); (b) share of pairs with exactly
    one correct solution whose answer is the correct one; (c) both solutions wrong: share
    picking solution 1 (0.5 = no systematic bias); (d) entropy of the pair answers around an
    anchor rollout, correct anchors (solid) vs incorrect (dashed)."""
    _need(df, "CAR mechanics", CAR_MECHANICS, HINT_CAR)
    runs = _with_labels(
        df[_numeric(df, "car/position_bias").notna().groupby(df["run"]).transform("any")]
    )
    colors = _colors(runs)
    fig = _new_figure(1, 4, width=3.8)
    a, b, c, d = _axes(fig)
    _curves(a, runs, "car/position_bias", colors=colors, ylabel="P(pick solution 1)")
    _curves(b, runs, "car/select_correct", colors=colors, ylabel="P(select correct)")
    _curves(c, runs, "car/incorrect_pair_first", colors=colors, ylabel="P(pick solution 1)")
    _curves(d, runs, "car/anchor_entropy_correct", colors=colors, suffix=" correct")
    _curves(
        d,
        runs,
        "car/anchor_entropy_incorrect",
        colors=colors,
        linestyle="--",
        suffix=" incorrect",
        ylabel="pair-answer entropy (nats)",
    )
    for ax in (a, c):
        ax.axhline(0.5, color="black", lw=0.8, ls=":")
    titles = (
        "(a) position bias",
        "(b) correct-answer selection",
        "(c) incorrect pairs",
        "(d) anchor entropy",
    )
    for ax, title in zip((a, b, c, d), titles):
        ax.set_title(title)
    _legend(a)
    _legend(d)
    fig.suptitle("Mechanistic analysis of CAR")
    return fig


def _top_answer_share(rollouts: pd.DataFrame) -> pd.DataFrame:
    """Per run and step: mean over prompts of the share of the prompt's most common answer."""
    r = rollouts.copy()
    r["answer"] = r["answer"].astype(object).where(r["answer"].notna(), None)
    rows = []
    for (run, step), g in r.groupby(["run", "step"], sort=True):
        shares = []
        for _, p in g.groupby("prompt_id"):
            counts = p["answer"].dropna().value_counts()
            shares.append(float(counts.iloc[0]) / len(p) if len(counts) else 0.0)
        rows.append({"run": run, "step": int(step), "rollout/top_answer_share": np.mean(shares)})
    return pd.DataFrame(rows)


def draw_rollout_bias(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (rollout-level pseudo-label bias): share of the batch's most common answer
    (`answers/batch_mode_share`, the paper's top-answer / predicted-"1" share), accuracy of the
    rollouts against the labels (`acc/train`) and mean training reward (`reward/total`); with
    `rollouts`, also the mean within-prompt share of each prompt's top answer. MV's reward rises
    while its accuracy falls and one answer takes over the batch: bias, not random noise."""
    metrics = ["answers/batch_mode_share", "acc/train", "reward/total"]
    _need(df, "rollout-level bias", metrics, HINT_METHODS)
    df = _with_labels(df)
    colors = _colors(df)
    extra = rollouts is not None and not rollouts.empty and "answer" in rollouts.columns
    fig = _new_figure(1, 4 if extra else 3, width=3.8)
    axes = _axes(fig)
    _curves(
        axes[0], df, "answers/batch_mode_share", colors=colors, ylabel="batch-mode answer share"
    )
    _curves(axes[1], df, "acc/train", colors=colors, ylabel="rollout accuracy (acc/train)")
    _curves(axes[2], df, "reward/total", colors=colors, ylabel="mean reward")
    titles = ["top-answer share (batch)", "accuracy", "mean training reward"]
    if extra:
        shares = _top_answer_share(rollouts)
        ident = df.drop_duplicates("run")[["run", "curve", "method", "experiment", "variant"]]
        shares = shares.merge(ident, on="run", how="inner")
        _curves(
            axes[3], shares, "rollout/top_answer_share", colors=colors,
            ylabel="top-answer share within a prompt",
        )  # fmt: skip
        titles.append("top-answer share (per prompt)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
    _legend(axes[0])
    fig.suptitle("Rollout-level pseudo-label bias")
    return fig


def _base_label(scale: str, steps) -> tuple[tuple, str]:
    if scale != "toy":
        return (1, 0.0, scale), scale
    value = pd.to_numeric(pd.Series([steps]), errors="coerce").iloc[0]
    if pd.isna(value):
        return (0, math.inf, "toy"), "toy base"
    return (0, float(value), ""), f"toy base, {int(value)} SFT steps"


def draw_base_strength(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (effect of base-model strength): validation accuracy per variant, one panel
    per base (toy bases by warm-start SFT steps, `cfg.model.warm_start.steps`; real bases by
    model). Weaker bases score lower; OM-GRPO stays stable, MV becomes prone to late collapse."""
    what = "weak vs strong base"
    _need(df, what, ["val/acc"], HINT_BASE)
    keys = [
        _base_label(str(s), w)
        for s, w in zip(df["scale"], _cfg(df, "model.warm_start.steps", None))
    ]
    df = _with_labels(df).assign(base=[k[1] for k in keys], base_rank=[k[0] for k in keys])
    bases = df.drop_duplicates("base").sort_values("base_rank", kind="stable")["base"].tolist()
    if len(bases) < 2:
        raise MissingRunsError(
            f"{what}: all runs share one base ({bases[0]}); it needs {HINT_BASE}"
        )
    colors = _colors(df)
    fig = _new_figure(1, len(bases), width=4.0)
    axes = _axes(fig)
    for ax, base in zip(axes, bases):
        _curves(ax, df[df["base"] == base], "val/acc", colors=colors, ylabel="val/acc (avg@k)")
        ax.set_title(base)
        _legend(ax)
    _same_ylim(axes)
    fig.suptitle("Effect of base-model strength")
    return fig


def draw_failure_recovery(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper Fig. (failure recovery): of the validation prompts no sample solved at step 0
    (pass@k = 0), the share solved at least once so far (`recovery/cum_pass`, cumulative
    pass@k) and their accuracy now (`recovery/cum_avg`, avg@k)."""
    _need(df, "failure recovery", ["recovery/cum_pass", "recovery/cum_avg"], HINT_RECOVERY)
    df = _with_labels(df)
    colors = _colors(df)
    fig = _new_figure(1, 2)
    a, b = _axes(fig)
    _curves(a, df, "recovery/cum_pass", colors=colors, ylabel="cumulative pass@k")
    _curves(b, df, "recovery/cum_avg", colors=colors, ylabel="avg@k")
    a.set_title("initially unsolved prompts: solved so far")
    b.set_title("initially unsolved prompts: accuracy")
    if "recovery/zero_pass_prompts" in df:
        n = _numeric(df, "recovery/zero_pass_prompts").dropna()
        if len(n):
            fig.suptitle(f"Failure recovery ({int(n.max())} prompts with pass@k = 0 at step 0)")
    _legend(a)
    return fig


HINT_WORLDS = (
    "runs in a toy world with a difficulty mix, e.g. `omgrpo train experiment=toy_shortcut "
    "method=mv` (and method=gt, om_grpo_no_car, om_grpo_no_car_no_omu), or `make study`"
)


def _panels(df: pd.DataFrame, metrics: Sequence[tuple[str, str]], title: str) -> Figure:
    """One panel per (metric, title) that `df` has, curves per variant (bases and worlds of
    the same variant pooled: filter `df` to one world first)."""
    df = _with_labels(df, df["variant"])
    colors = _colors(df)
    present = [(m, t) for m, t in metrics if _has(df, m)]
    cols = min(3, len(present))
    fig = _new_figure(math.ceil(len(present) / cols), cols)
    axes = _axes(fig)
    for ax, (metric, text) in zip(axes, present):
        _curves(ax, df, metric, colors=colors)
        ax.set_title(text)
    for ax in axes[len(present) :]:
        ax.set_visible(False)
    _legend(axes[0])
    fig.suptitle(title)
    return fig


def draw_collapse_route(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """The shortcut worlds' route to collapse (docs/toy-worlds.md): validation accuracy on easy
    and hard problems, the hard-problem guess rate (a boxed answer the reasoning did not
    compute), the share of samples boxing the guess prior's peak ("1"), and in training the
    answer-reasoning consistency and the share of groups with a wrong majority."""
    _need(df, "collapse route", ["val/acc_hard", "val/guess_rate_hard"], HINT_WORLDS)
    metrics = [
        ("val/acc_easy", "val accuracy, easy"),
        ("val/acc_hard", "val accuracy, hard"),
        ("val/guess_rate_hard", "val guess rate, hard"),
        ("val/peak_share", 'val share boxing the peak ("1")'),
        ("val/bare_guess_rate", "val bare-guess rate"),
        ("answers/consistency", "train: answer = last computed value"),
        ("answers/wrong_majority", "train: groups with a wrong majority"),
    ]
    return _panels(df, metrics, "Collapse route")


def draw_token_roles(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """KL to the reference by token role (answer, the last computed result, the closing line
    and the other reasoning tokens), and the gradient probe: norms and cosine of the answer
    tokens' and the other tokens' policy-gradient parts."""
    _need(df, "token roles", ["kl/answer", "kl/result"], HINT_WORLDS)
    metrics = [
        ("kl/answer", "KL: answer"),
        ("kl/result", "KL: last computed result"),
        ("kl/format", "KL: closing line"),
        ("kl/other", "KL: other reasoning"),
        ("grad/answer_norm", "PG gradient norm: answer"),
        ("grad/reasoning_norm", "PG gradient norm: other tokens"),
        ("grad/answer_reasoning_cos", "cosine, answer vs other"),
    ]
    return _panels(df, metrics, "Token roles")


def draw_prm_baselines(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Paper appendix figure (PRM-based process reward baselines): validation accuracy over
    steps of the runs rewarded by a process reward model (`prm*` presets) beside OM-GRPO,
    majority voting and, where they ran, the controls (GT reward, the shuffled-advantage null);
    right, the PRM runs' mean aggregated PRM score (their reward) and mean step score, which rise
    as the policy learns what the PRM likes."""
    _need(df, "PRM baselines", ["val/acc", "prm/aggregate_mean"], HINT_PRM)
    method = df["method"].astype(str)
    beside = method.isin(["mv", "mv_shuffled", "gt"])
    df = _with_labels(df[method.str.startswith(("prm", "om_grpo")) | beside])
    colors = _colors(df)
    fig = _new_figure(1, 2)
    a, b = _axes(fig)
    _curves(a, df, "val/acc", colors=colors, ylabel="val/acc (avg@k)")
    prm = df[df["method"].astype(str).str.startswith("prm")]
    _curves(b, prm, "prm/aggregate_mean", colors=colors, ylabel="PRM score")
    _curves(b, prm, "prm/step_score_mean", colors=colors, linestyle=":", suffix=" (mean step)")
    a.set_title("validation accuracy")
    b.set_title("PRM score (dotted: step mean)")
    _legend(a)
    _legend(b)
    fig.suptitle("PRM baselines vs OM-GRPO")
    return fig


HINT_REWARD_QUALITY = (
    "runs with labelled training data that log the proxy-reward quality (any run since issue "
    "39, e.g. `omgrpo train experiment=toy method=om_grpo`)"
)


def draw_reward_quality(df: pd.DataFrame, rollouts: pd.DataFrame | None = None) -> Figure:
    """Proxy-reward quality (docs/metrics.md, `reward_quality/*`): how often the reward's sign
    (above the group's mean) agrees with correctness, how often the vote is right
    (`answers/top_vote_acc`, TTRL's label accuracy), the majority ratio, the reward/correctness
    correlation and the share of groups with zero reward spread, per training step."""
    _need(df, "reward quality", ["reward_quality/reward_acc"], HINT_REWARD_QUALITY)
    metrics = [
        ("reward_quality/reward_acc", "reward accuracy"),
        ("answers/top_vote_acc", "label accuracy (vote right)"),
        ("reward_quality/majority_ratio", "majority ratio"),
        ("reward_quality/reward_correct_corr", "corr(reward, correct)"),
        ("reward_quality/zero_spread_groups", "groups with zero reward spread"),
    ]
    return _panels(df, metrics, "Proxy-reward quality")


FATE_COLORS = {
    "learned": "#2ca02c",
    "forgotten": "#d62728",
    "sharpened": "#1f77b4",
    "always": "#9ecae1",
    "never": "#bbbbbb",
}


def draw_problem_fates(counts: pd.DataFrame) -> Figure:
    """Each run's validation problems by fate (`omgrpo.analysis.problems.fate_counts`: learned,
    forgotten, sharpened, always, never), as a stacked bar of shares, one bar per run."""
    if counts is None or counts.empty:
        raise MissingRunsError(
            "problem fates: no run has problems.parquet; it needs runs that validated since "
            "issue 39 (the native trainer and the verl backend write it at each validation)"
        )
    fates = [f for f in FATE_COLORS if f in counts.columns]
    shares = counts.set_index("run")[fates].div(counts.set_index("run")["problems"], axis=0)
    fig = _new_figure(1, 1, width=7.0, height=0.5 + 0.35 * len(shares))
    (ax,) = _axes(fig)
    left = np.zeros(len(shares))
    for fate in fates:
        ax.barh(shares.index, shares[fate], left=left, color=FATE_COLORS[fate], label=fate)
        left += shares[fate].to_numpy()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of validation problems")
    ax.invert_yaxis()
    ax.legend(ncols=len(fates), loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8)
    fig.suptitle("Each problem's fate, first to last validation")
    return fig


def problem_fates(counts: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """`draw_problem_fates` written to `out_dir/problem_fates.png` and `.pdf`; raises
    MissingRunsError without counts."""
    return _save(draw_problem_fates(counts), Path(out_dir), "problem_fates")


# -- registry ----------------------------------------------------------------------------------
FigureFn = Callable[..., list[Path]]


def _exported(name: str, draw: Callable[..., Figure]) -> FigureFn:
    def figure(
        df: pd.DataFrame, out_dir: Path | str, *, rollouts: pd.DataFrame | None = None
    ) -> list[Path]:
        return _save(draw(df, rollouts=rollouts), Path(out_dir), name)

    figure.__name__ = figure.__qualname__ = name
    figure.__doc__ = (
        f"{draw.__doc__}\n\n    Writes `out_dir/{name}.png` and `.pdf` and returns their paths; "
        "raises MissingRunsError when the runs it needs are absent."
    )
    return figure


training_dynamics = _exported("training_dynamics", draw_training_dynamics)
ten_epoch_dynamics = _exported("ten_epoch_dynamics", draw_ten_epoch_dynamics)
answer_weight = _exported("answer_weight", draw_answer_weight)
kl_answer_reasoning = _exported("kl_answer_reasoning", draw_kl_answer_reasoning)
car_top_vote = _exported("car_top_vote", draw_car_top_vote)
unique_answers = _exported("unique_answers", draw_unique_answers)
car_mechanics = _exported("car_mechanics", draw_car_mechanics)
rollout_bias = _exported("rollout_bias", draw_rollout_bias)
base_strength = _exported("base_strength", draw_base_strength)
failure_recovery = _exported("failure_recovery", draw_failure_recovery)
collapse_route = _exported("collapse_route", draw_collapse_route)
token_roles = _exported("token_roles", draw_token_roles)
prm_baselines = _exported("prm_baselines", draw_prm_baselines)
reward_quality = _exported("reward_quality", draw_reward_quality)

FIGURES: dict[str, FigureFn] = {
    "training_dynamics": training_dynamics,
    "ten_epoch_dynamics": ten_epoch_dynamics,
    "answer_weight": answer_weight,
    "kl_answer_reasoning": kl_answer_reasoning,
    "car_top_vote": car_top_vote,
    "unique_answers": unique_answers,
    "car_mechanics": car_mechanics,
    "rollout_bias": rollout_bias,
    "base_strength": base_strength,
    "failure_recovery": failure_recovery,
    "collapse_route": collapse_route,
    "token_roles": token_roles,
    "prm_baselines": prm_baselines,
    "reward_quality": reward_quality,
}
"""Every figure, in the paper's order: name -> fn(df, out_dir, *, rollouts=None)."""

DRAW: dict[str, Callable[..., Figure]] = {name: globals()[f"draw_{name}"] for name in FIGURES}
"""name -> draw_<name>(df, rollouts=None) -> Figure (for notebooks)."""

TITLES = {
    "training_dynamics": "Training dynamics (val acc, unique answers per batch)",
    "ten_epoch_dynamics": "Long-training dynamics (val acc, KL loss, entropy)",
    "answer_weight": "Answer-token down-weighting (w = 0, .25, .5, .75, format-only)",
    "kl_answer_reasoning": "KL on answer vs reasoning tokens",
    "car_top_vote": "CAR and top-vote accuracy",
    "unique_answers": "Unique answers per sample",
    "car_mechanics": "CAR mechanics (position bias, selection, incorrect pairs, entropy)",
    "rollout_bias": "Rollout-level pseudo-label bias",
    "base_strength": "Weak vs strong base",
    "failure_recovery": "Failure recovery (prompts with initial pass@k = 0)",
    "collapse_route": "Collapse route (guessing, the peak answer, accuracy by difficulty)",
    "token_roles": "KL by token role and the answer/reasoning gradient probe",
    "prm_baselines": "PRM baselines vs OM-GRPO (val acc; the PRM runs' scores)",
    "reward_quality": "Proxy-reward quality (reward vs correctness, vote accuracy, spread)",
    "problem_fates": "Each problem's fate (learned, forgotten, sharpened, always, never)",
}


def all_figures(
    df: pd.DataFrame,
    out_dir: Path | str,
    rollouts: pd.DataFrame | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, list[Path] | str]:
    """Draw every figure (or those in `only`) that the runs allow: name -> written paths, or
    name -> the MissingRunsError message for a figure that could not be drawn."""
    unknown = sorted(set(only or ()) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {list(FIGURES)}")
    out: dict[str, list[Path] | str] = {}
    for name, fn in FIGURES.items():
        if only and name not in only:
            continue
        try:
            out[name] = fn(df, Path(out_dir), rollouts=rollouts)
        except MissingRunsError as e:
            out[name] = str(e)
    return out
