"""PNG figures of the report (matplotlib, Agg backend; no display needed).

* held-out EM trajectories per seed (paper Figs 2-4),
* training dynamics and training health per seed (Figs 5-8, 11) from verl file-logger metrics,
* the multi-hop search-count profile with completed-rollout EM and abort rates (Fig. 13).

Every function writes one PNG and returns what it could not draw (missing metrics), so the report
can say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from eval.report.results import AVG_ALL, AVG_HELDOUT  # noqa: E402
from reward_fns import PRIMARY  # noqa: E402

SHAPE_COLOURS = {"em_only": "tab:red", "f1_only": "tab:blue", "f1_format": "tab:green"}
_EXTRA_COLOURS = ("tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
DPI = 120


def shape_colour(shape: str, shapes: Sequence[str]) -> str:
    """Fixed colours for the paper's shapes; others cycle through a qualitative palette."""
    if shape in SHAPE_COLOURS:
        return SHAPE_COLOURS[shape]
    others = [s for s in shapes if s not in SHAPE_COLOURS]
    return _EXTRA_COLOURS[others.index(shape) % len(_EXTRA_COLOURS)] if shape in others else "black"


@dataclass(frozen=True)
class Panel:
    """One training-metric panel: title, y label, metric names tried in order (first logged wins)."""

    title: str
    ylabel: str
    metrics: tuple[str, ...]


DYNAMICS_PANELS = (
    Panel("training reward", "mean reward (shape's own scale)", ("reward/mean", "critic/score/mean")),
    Panel("tool calls", "searches per rollout", ("rollout/searches_mean",)),
    Panel("response length", "tokens (model + tool)", ("response_length/mean",)),
    Panel("model tokens", "model tokens per rollout", ("rollout/model_tokens_mean",)),
    Panel(
        "length-clip ratio",
        "fraction of rollouts",
        ("rollout/length_clip_ratio", "response_length/clip_ratio"),
    ),
    Panel("abort ratio", "fraction without an answer", ("rollout/abort_ratio",)),
    Panel("zero-variance groups", "fraction of GRPO groups", ("grpo/zero_variance_group_frac",)),
    Panel("training EM", "EM of rollouts", ("reward/em",)),
)
HEALTH_PANELS = (
    Panel("gradient norm", "actor grad norm", ("actor/grad_norm",)),
    Panel("entropy", "token entropy", ("actor/entropy",)),
    Panel("KL loss", "low-var KL", ("actor/kl_loss",)),
    Panel("policy loss", "pg loss", ("actor/pg_loss",)),
    Panel("abort ratio", "fraction without an answer", ("rollout/abort_ratio",)),
    Panel(
        "natural termination",
        "fraction ending in a turn without a tool call",
        ("rollout/termination/answer",),
    ),
)


def _by_shape(frame: pd.DataFrame, shapes: Sequence[str]) -> list[tuple[tuple[str, str], pd.DataFrame]]:
    """((shape, run), rows sorted by step) groups in the order of ``shapes``, then by run name."""
    order = {s: i for i, s in enumerate(shapes)}
    groups = {key: g.sort_values("step") for key, g in frame.groupby(["shape", "run"])}
    return [(key, groups[key]) for key in sorted(groups, key=lambda k: (order.get(k[0], len(order)), k[1]))]


def _save(fig: plt.Figure, path: Path, laid_out: bool = False) -> Path:
    """Write `fig` as PNG and close it; cropped to its content unless it was `laid_out` already (a
    crop draws the figure twice)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches=None if laid_out else "tight")
    plt.close(fig)
    return path


def plot_trajectories(
    scores: pd.DataFrame, seed: int, shapes: Sequence[str], matched_horizon: int, path: Path
) -> Path:
    """Average EM vs step for one seed, one line per shape: left over all benchmarks (paper's
    Avg), right over the held-out benchmarks. Dashed: the step-0 floor; dotted: the matched horizon."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    sub = scores[(scores["seed"] == seed) & (scores[PRIMARY].notna())]
    for ax, avg, title in (
        (axes[0], AVG_ALL, "EM, average over all benchmarks"),
        (axes[1], AVG_HELDOUT, "EM, average over held-out benchmarks"),
    ):
        data = sub[sub["benchmark"] == avg]
        floor = data[data["step"] == 0][PRIMARY]
        for (shape, run), line in _by_shape(data, shapes):
            label = shape if (data[data["shape"] == shape]["run"].nunique() == 1) else f"{shape} ({run})"
            ax.plot(
                line["step"],
                line[PRIMARY],
                marker="o",
                markersize=3,
                color=shape_colour(shape, shapes),
                label=label,
            )
        if len(floor):
            ax.axhline(floor.mean(), color="grey", linestyle="--", linewidth=1, label="untrained (step 0)")
        ax.axvline(
            matched_horizon, color="black", linestyle=":", linewidth=1, label=f"step {matched_horizon}"
        )
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact match")
    axes[1].legend(loc="best", fontsize=8)
    fig.suptitle(f"Held-out EM trajectories, seed {seed}")
    return _save(fig, path)


def plot_training(
    logs: pd.DataFrame,
    seed: int,
    shapes: Sequence[str],
    panels: Sequence[Panel],
    smooth: int,
    title: str,
    path: Path,
) -> Path:
    """Grid of training-metric panels for one seed, one line per run (raw thin, moving average of
    ``smooth`` steps bold). A panel whose metrics are all absent says so (``missing_panels``)."""
    cols = 4 if len(panels) > 6 else 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    sub = logs[logs["seed"] == seed]
    runs_per_shape = sub.groupby("shape")["run"].nunique()
    for ax, panel in zip(axes.flat, panels, strict=False):
        metric = next((m for m in panel.metrics if (sub["metric"] == m).any()), None)
        if metric is None:
            ax.text(
                0.5,
                0.5,
                "not logged:\n" + "\n".join(panel.metrics),
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
                color="grey",
            )
            ax.set_title(panel.title)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for (shape, run), line in _by_shape(sub[sub["metric"] == metric], shapes):
            colour = shape_colour(shape, shapes)
            ax.plot(line["step"], line["value"], color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(
                line["step"],
                line["value"].rolling(smooth, min_periods=1).mean(),
                color=colour,
                linewidth=1.8,
                label=shape if runs_per_shape[shape] == 1 else f"{shape} ({run})",
            )
        ax.set_title(f"{panel.title}\n({metric})", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("training step")
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=9)
    fig.suptitle(f"{title}, seed {seed} (moving average over {smooth} steps; raw series faint)")
    fig.tight_layout(rect=(0, 0, 0.93, 0.95))
    return _save(fig, path, laid_out=True)


def missing_panels(logs: pd.DataFrame, seed: int, panels: Sequence[Panel]) -> list[str]:
    """The panels of ``plot_training`` at ``seed`` whose metrics are all absent from ``logs``, each as
    its metric names joined by " / "."""
    logged = set(logs.loc[logs["seed"] == seed, "metric"])
    return [" / ".join(p.metrics) for p in panels if not logged.intersection(p.metrics)]


def plot_search_profile(
    profile: pd.DataFrame, aborts: pd.DataFrame, shapes: Sequence[str], path: Path, max_searches: int = 10
) -> Path:
    """Fig. 13: share of completed rollouts and their EM by number of searches, per shape, and the
    abort rate per shape (multi-hop benchmarks, selected checkpoints pooled over seeds). Search
    counts are already folded at ``max_searches`` (labelled ">=max")."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colours = {s: shape_colour(s, shapes) for s in shapes}
    shapes = [s for s in shapes if s in set(aborts["shape"])]
    width = 0.8 / max(1, len(shapes))
    for i, shape in enumerate(shapes):
        sub = profile[profile["shape"] == shape].sort_values("searches")
        colour = colours[shape]
        axes[0].bar(
            sub["searches"] + (i - (len(shapes) - 1) / 2) * width,
            sub["share"],
            width=width,
            color=colour,
            label=shape,
        )
        axes[1].plot(sub["searches"], sub[PRIMARY], marker="o", color=colour, label=shape)
    top = int(profile["searches"].max()) if len(profile) else 0
    for ax in axes[:2]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if top >= max_searches:
            ticks = list(range(0, top + 1, max(1, top // 10)))
            ax.set_xticks(ticks, [f">={t}" if t == max_searches else str(t) for t in ticks])
    axes[0].set_title("completed rollouts by search count")
    axes[0].set_xlabel("searches in the rollout")
    axes[0].set_ylabel("share of completed rollouts")
    axes[1].set_title("EM of completed rollouts")
    axes[1].set_xlabel("searches in the rollout")
    axes[1].set_ylabel("exact match")
    rates = aborts.set_index("shape").reindex(list(shapes))
    bars = axes[2].bar(list(shapes), rates["abort_rate"], color=[colours[s] for s in shapes])
    axes[2].bar_label(bars, labels=[f"{v:.1%}" for v in rates["abort_rate"].fillna(0)], fontsize=9)
    axes[2].set_ylim(0, max(0.05, float(rates["abort_rate"].max()) * 1.15))
    axes[2].set_title("abort rate (no answer)")
    axes[2].set_ylabel("fraction of rollouts")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Search-count profile on multi-hop benchmarks (matched-horizon checkpoints, seeds pooled)")
    fig.tight_layout()
    return _save(fig, path)


ZERO_VARIANCE = "grpo/zero_variance_group_frac"


def plot_zero_variance(logs: pd.DataFrame, shapes: Sequence[str], smooth: int, path: Path) -> Path | None:
    """``grpo/zero_variance_group_frac`` per reward shape, all seeds in one figure (the mechanism
    the paper proposed: a shape whose groups more often get identical rewards gets fewer GRPO
    gradients). Left: fraction per step, one faint line per run and the seed mean (moving average
    of ``smooth`` steps) bold per shape; right: the mean over all logged steps per shape (bar) and
    per seed (dots). Returns None (and writes nothing) when the metric is not logged."""
    sub = logs[logs["metric"] == ZERO_VARIANCE]
    if sub.empty:
        return None
    present = [s for s in shapes if s in set(sub["shape"])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    for i, shape in enumerate(present):
        colour = shape_colour(shape, shapes)
        rows = sub[sub["shape"] == shape]
        for _, line in rows.groupby("run"):
            line = line.sort_values("step")
            axes[0].plot(line["step"], line["value"], color=colour, alpha=0.25, linewidth=0.8)
        mean = rows.groupby("step")["value"].mean().sort_index()
        axes[0].plot(
            mean.index, mean.rolling(smooth, min_periods=1).mean(), color=colour, linewidth=2, label=shape
        )
        per_seed = rows.groupby("seed")["value"].mean()
        axes[1].bar(i, per_seed.mean(), color=colour, alpha=0.6)
        axes[1].scatter([i] * len(per_seed), per_seed, color="black", s=14, zorder=3)
    axes[0].set_title(f"zero-variance groups per step ({ZERO_VARIANCE})", fontsize=10)
    axes[0].set_xlabel("training step")
    axes[0].set_ylabel("fraction of GRPO groups")
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    axes[1].set_xticks(range(len(present)), present)
    axes[1].set_title("mean over steps (bar: seeds' mean; dots: seeds)", fontsize=10)
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"GRPO groups with identical rewards, by reward shape (seed mean, {smooth}-step moving average)"
    )
    fig.tight_layout()
    return _save(fig, path)


def plot_zero_variance_gain(frame: pd.DataFrame, path: Path) -> Path:
    """Zero-variance group fraction against EM gain, one point per cell (``study.regimes.cells``
    frame: ``regime, group, shape, zero_var, gain``): marker per regime, filled at the smallest G."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    shapes = sorted(frame["shape"].unique())
    small = int(frame["group"].min())
    markers = {"dense": "o", "sparse": "s"}
    for (regime, group, shape), sub in frame.groupby(["regime", "group", "shape"]):
        colour = shape_colour(shape, shapes)
        ax.scatter(
            sub["zero_var"],
            sub["gain"],
            marker=markers.get(regime, "^"),
            facecolors=colour if group == small else "none",
            edgecolors=colour,
            s=46,
            label=f"{regime} {shape} G={int(group)}",
        )
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("zero-variance group fraction (own reward, steps 1..matched horizon)")
    ax.set_ylabel("gain in EM (Avg all), best checkpoint vs step 0")
    ax.legend(fontsize=7, loc="best")
    ax.set_title("Tied groups against learning, one point per cell")
    return _save(fig, path)
