"""Loss curves and training diagnostics from training histories, on labelled axes.

A history is ``Trainer.history``: a list of dicts, one per logged step,
each with ``step`` and some of ``loss``, ``val_loss``, ``lr``, ``grad_norm``,
``tokens_per_second``. ``plot_history`` draws losses (one line per run and per
key); ``plot_diagnostics`` draws the three signals that explain a loss curve:
the learning rate, the gradient norm before clipping against the clip
threshold, and the throughput; ``plot_memory_by_kind`` stacks chapter 7's
predicted memory per kind against the sequence length; ``plot_resume_runs``
draws chapter 5's killed and resumed runs beside the uninterrupted one;
``plot_step_timeline`` draws one training step under DDP or FSDP2 as rows of
boxes (chapter 6).
This module needs only matplotlib, so it plots histories from anywhere
(a live run, or results saved as JSON on another machine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

# How each key is drawn: training dense and thin, validation sparse with markers.
LINE_STYLES = {
    "loss": {"linewidth": 1.2},
    "val_loss": {"linewidth": 1.8, "marker": "o", "markersize": 4},
}
KEY_LABELS = {"loss": "train", "val_loss": "validation"}


def plot_history(
    histories: Mapping[str, Sequence[Mapping[str, float]]],
    keys: Sequence[str] = ("loss", "val_loss"),
    ax: Axes | None = None,
    reference_lines: Mapping[str, float] | None = None,
    ylabel: str = "loss (nats per token)",
    title: str | None = None,
) -> Figure:
    """Plot ``keys`` against ``step`` for every run in ``histories``; return the figure.

    ``histories`` maps a run's name (the legend's label) to its history; rows
    without a key are skipped, so sparse validation losses plot as their own
    line. ``reference_lines`` maps a label to a constant drawn as a dashed
    horizontal line (a baseline to beat). Pass ``ax`` to draw into an existing
    figure.
    """
    if ax is None:
        figure, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    else:
        figure = ax.figure
    # One run: a colour per key. Several runs: a colour per run, a line style per key.
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for run_index, (run, history) in enumerate(histories.items()):
        for key_index, key in enumerate(keys):
            rows = [row for row in history if key in row]
            if not rows:
                continue
            name = KEY_LABELS.get(key, key)
            label = name if len(histories) == 1 else f"{run}: {name}"
            colour = colours[
                (key_index if len(histories) == 1 else run_index) % len(colours)
            ]
            ax.plot(
                [row["step"] for row in rows],
                [row[key] for row in rows],
                label=label,
                color=colour,
                **LINE_STYLES.get(key, {"linewidth": 1.2}),
            )
    for label, value in (reference_lines or {}).items():
        ax.axhline(value, linestyle="--", linewidth=1.0, color="grey")
        ax.annotate(
            label,
            xy=(1.0, value),
            xycoords=("axes fraction", "data"),
            xytext=(-4, -3),
            textcoords="offset points",
            ha="right",
            va="top",
            color="grey",
            fontsize="small",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return figure


# The diagnostics panels: history key, y-axis label, log scale (norms span decades).
DIAGNOSTIC_PANELS = (
    ("lr", "learning rate", False),
    ("grad_norm", "gradient norm before clipping", True),
    ("tokens_per_second", "tokens per second", False),
)


def plot_diagnostics(
    history: Sequence[Mapping[str, float]],
    max_grad_norm: float | None = None,
    axes: Sequence[Axes] | None = None,
    title: str | None = None,
) -> Figure:
    """Plot learning rate, gradient norm and tokens/s against ``step``, one panel each.

    ``max_grad_norm`` draws the clip threshold as a dashed line on the
    gradient-norm panel, so you see how often clipping acted (every point above
    the line was scaled down to it). Pass three ``axes`` to draw beside other
    plots, for example a loss curve in the same figure.
    """
    if not history:
        raise ValueError(
            "plot_diagnostics: history is empty; train at least log_every steps first"
        )
    if axes is None:
        figure, axes = plt.subplots(
            1, len(DIAGNOSTIC_PANELS), figsize=(10, 3), layout="constrained"
        )
    elif len(axes) != len(DIAGNOSTIC_PANELS):
        raise ValueError(
            f"plot_diagnostics: axes must hold {len(DIAGNOSTIC_PANELS)} axes "
            f"(learning rate, gradient norm, tokens per second), got {len(axes)}"
        )
    figure = axes[0].figure
    for ax, (key, label, log_scale) in zip(axes, DIAGNOSTIC_PANELS, strict=True):
        rows = [row for row in history if key in row]
        ax.plot(
            [row["step"] for row in rows], [row[key] for row in rows], linewidth=1.2
        )
        if log_scale:
            ax.set_yscale("log")
            # Plain numbers (0.5, 2), not 5x10^-1: a norm rarely spans many decades.
            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(
                LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if max_grad_norm is not None:
        norm_ax = axes[[key for key, _, _ in DIAGNOSTIC_PANELS].index("grad_norm")]
        norm_ax.axhline(max_grad_norm, linestyle="--", linewidth=1.0, color="grey")
        norm_ax.annotate(
            f"clip threshold {max_grad_norm:g}",
            xy=(1.0, max_grad_norm),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            va="bottom",
            color="grey",
            fontsize="small",
        )
    if title:
        figure.suptitle(title)
    return figure


def plot_memory_by_kind(
    seq_lens: Sequence[int],
    predicted: Mapping[str, Sequence[float]],
    measured: Mapping[str, Sequence[float]] | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Stacked bars of predicted training memory (MB) per kind against sequence length.

    ``predicted`` maps a kind ("parameters", "activations", ...) to bytes, one per
    sequence length, stacked in the order given; ``measured`` maps a label to
    bytes drawn as markers over the bars, so a reader sees prediction and
    measurement in one place.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.6))
    positions = range(len(seq_lens))
    bottom = [0.0] * len(seq_lens)
    for kind, values in predicted.items():
        heights = [value / 1e6 for value in values]
        ax.bar(
            positions, heights, bottom=bottom, width=0.6, label=f"{kind} (predicted)"
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    measured = measured or {}
    markers = ("o", "D", "s")[: len(measured)]  # up to three measurements
    for (label, values), marker in zip(measured.items(), markers, strict=True):
        ax.plot(
            positions,
            [value / 1e6 for value in values],
            marker,
            color="black",
            markersize=6,
            markerfacecolor="white",
            label=label,
        )
    ax.set_xticks(list(positions), [f"{steps:,}" for steps in seq_lens])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("memory (MB)")
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


# Chapter 5's four runs: the uninterrupted one, the resumed one and two controls.
RESUME_RUNS = {
    "A": ("A: uninterrupted", {"color": "tab:blue"}),
    "B": ("B: killed, then resumed", {"color": "tab:orange", "marker": "o", "ls": ""}),
    "C": ("C: resumed without RNG state", {"color": "tab:red", "ls": ":"}),
    "D": ("D: resumed at the first batch", {"color": "tab:green", "ls": "--"}),
}


def plot_resume_runs(
    runs: Mapping[str, Mapping[str, Sequence[float]]], resume_step: int
) -> Figure:
    """Loss per step of chapter 5's runs A-D (``steps``, ``losses``) and each minus A's.

    The difference panel is linear within 1e-4 and logarithmic beyond, so an exact
    zero (a bit-exact resume) and the controls' small gaps are both visible.
    """
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2)
    )
    reference = runs["A"]["losses"]
    for name, (label, style) in RESUME_RUNS.items():
        steps, losses = runs[name]["steps"], runs[name]["losses"]
        top.plot(steps, losses, label=label, markersize=4, **style)
        if name != "A":
            gap = [loss - ref for loss, ref in zip(losses, reference, strict=True)]
            color = style["color"]
            bottom.plot(
                steps, gap, "o-", markersize=3, color=color, label=f"{name} minus A"
            )
    top.set_ylabel("training loss (nats per token)")
    bottom.set_yscale("symlog", linthresh=1e-4)
    bottom.set_yticks([-1e-2, -1e-4, 0, 1e-4, 1e-2])
    bottom.set_ylabel("loss minus A's")
    bottom.set_xlabel("optimizer step")
    for axis in (top, bottom):
        axis.axvline(resume_step, color="gray", linestyle="--", linewidth=1)
    top.legend(title=f"killed after step {resume_step} (dashed)")
    bottom.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    return fig


# One DDP or FSDP2 step (chapter 6): what a rank computes and what it sends meanwhile.
STEP_COLOURS = {
    "forward": "#c6dbef",
    "backward": "#6baed6",
    "all-reduce": "#fd8d3c",
    "all-gather": "#74c476",
    "reduce-scatter": "#9e9ac8",
    "full weights held": "#fee391",
}


def plot_step_timeline(
    lanes: Mapping[str, Sequence[tuple[float, float, str, str]]],
    xlabel: str,
    title: str | None = None,
) -> Figure:
    """Draw one training step as rows of boxes; returns the figure.

    ``lanes`` maps a row's name (top to bottom) to its boxes, each ``(start,
    length, label, kind)``; ``kind`` is a key of ``STEP_COLOURS`` and names the
    box in the legend. The caller decides the x scale and says it in ``xlabel``.
    """
    fig, ax = plt.subplots(figsize=(9, 1.3 + 0.5 * len(lanes)))
    names = list(lanes)
    kinds_drawn: dict[str, None] = {}
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        for start, length, label, kind in lanes[name]:
            ax.barh(
                y,
                length,
                left=start,
                height=0.6,
                color=STEP_COLOURS[kind],
                edgecolor="black",
                linewidth=0.5,
            )
            ax.text(
                start + length / 2,
                y,
                label,
                ha="center",
                va="center",
                fontsize=7,
                rotation=90 if length < 0.03 * _lane_span(lanes) else 0,
            )
            kinds_drawn[kind] = None
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, _lane_span(lanes) * 1.01)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=STEP_COLOURS[kind]) for kind in kinds_drawn
    ]
    fig.legend(
        handles,
        list(kinds_drawn),
        loc="lower center",
        ncol=len(kinds_drawn),
        fontsize=8,
        frameon=False,
    )
    if title:
        ax.set_title(title)
    # room for the legend below the axis label
    fig.tight_layout(rect=(0, 0.1 + 0.1 / len(lanes), 1, 1))
    return fig


def _lane_span(lanes: Mapping[str, Sequence[tuple[float, float, str, str]]]) -> float:
    return max(
        start + length for boxes in lanes.values() for start, length, _, _ in boxes
    )
