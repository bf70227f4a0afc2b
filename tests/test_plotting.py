"""Tests of the loss-curve plot (code/torchbook/plotting.py), read back from the matplotlib objects it draws."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")  # no display: draw into memory

import matplotlib.pyplot as plt  # noqa: E402

from torchbook.plotting import plot_diagnostics, plot_history  # noqa: E402

HISTORY = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5, "val_loss": 2.7},
           {"step": 30, "loss": 2.2}, {"step": 40, "loss": 2.0, "val_loss": 2.3}]


@pytest.fixture
def close_figures():
    yield
    plt.close("all")


def lines_by_label(figure) -> dict:
    return {line.get_label(): line for line in figure.axes[0].get_lines()}


def test_train_and_sparse_validation_curves_with_labelled_axes(close_figures):
    figure = plot_history({"run": HISTORY})
    ax = figure.axes[0]
    lines = lines_by_label(figure)
    assert list(lines["train"].get_xdata()) == [10, 20, 30, 40]
    assert list(lines["validation"].get_xdata()) == [20, 40]  # only rows that have val_loss
    assert list(lines["validation"].get_ydata()) == [2.7, 2.3]
    assert ax.get_xlabel() == "optimizer step" and "nats" in ax.get_ylabel()
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["train", "validation"]


def test_reference_line_is_drawn_at_its_value_and_labelled(close_figures):
    figure = plot_history({"run": HISTORY}, reference_lines={"unigram baseline": 3.3})
    ax = figure.axes[0]
    horizontal = [line for line in ax.get_lines() if set(line.get_ydata()) == {3.3}]
    assert len(horizontal) == 1 and horizontal[0].get_linestyle() == "--"
    assert "unigram baseline" in [text.get_text() for text in ax.texts]
    # The legend lists curves only, not the baseline (it is labelled on the plot itself).
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["train", "validation"]


def test_several_runs_get_one_colour_each_and_prefixed_labels(close_figures):
    figure = plot_history({"fp32": HISTORY, "bf16": HISTORY})
    lines = lines_by_label(figure)
    assert set(lines) == {"fp32: train", "fp32: validation", "bf16: train", "bf16: validation"}
    assert lines["fp32: train"].get_color() == lines["fp32: validation"].get_color()
    assert lines["fp32: train"].get_color() != lines["bf16: train"].get_color()


def test_drawing_into_a_given_axes_returns_its_figure(close_figures):
    figure, (left, right) = plt.subplots(1, 2)
    returned = plot_history({"run": HISTORY}, ax=right)
    assert returned is figure
    assert len(right.get_lines()) == 2 and len(left.get_lines()) == 0


DIAGNOSTIC_HISTORY = [
    {"step": 10, "loss": 3.0, "lr": 1e-3, "grad_norm": 4.0, "tokens_per_second": 900.0},
    {"step": 20, "loss": 2.5, "lr": 2e-3, "grad_norm": 0.8, "tokens_per_second": 1000.0, "val_loss": 2.7},
    {"step": 30, "loss": 2.2, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_second": 1100.0},
]


def test_diagnostics_draw_lr_grad_norm_and_throughput_one_panel_each(close_figures):
    figure = plot_diagnostics(DIAGNOSTIC_HISTORY)
    lr_ax, norm_ax, speed_ax = figure.axes
    assert [ax.get_ylabel() for ax in figure.axes] == [
        "learning rate", "gradient norm before clipping", "tokens per second"]
    assert list(lr_ax.get_lines()[0].get_ydata()) == [1e-3, 2e-3, 1e-3]
    assert list(norm_ax.get_lines()[0].get_ydata()) == [4.0, 0.8, 0.5]
    assert list(speed_ax.get_lines()[0].get_xdata()) == [10, 20, 30]
    assert norm_ax.get_yscale() == "log" and lr_ax.get_yscale() == "linear"


def test_diagnostics_draw_the_clip_threshold_only_when_given(close_figures):
    norm_ax = plot_diagnostics(DIAGNOSTIC_HISTORY, max_grad_norm=1.0).axes[1]
    threshold = [line for line in norm_ax.get_lines() if set(line.get_ydata()) == {1.0}]
    assert len(threshold) == 1 and threshold[0].get_linestyle() == "--"
    assert "clip threshold 1" in [text.get_text() for text in norm_ax.texts]
    plain_ax = plot_diagnostics(DIAGNOSTIC_HISTORY).axes[1]
    assert len(plain_ax.get_lines()) == 1 and not plain_ax.texts


def test_diagnostics_draw_into_given_axes_beside_a_loss_curve(close_figures):
    figure, axes = plt.subplots(1, 4)
    plot_history({"run": HISTORY}, ax=axes[0])
    assert plot_diagnostics(DIAGNOSTIC_HISTORY, axes=axes[1:]) is figure
    assert [len(ax.get_lines()) for ax in axes] == [2, 1, 1, 1]


def test_diagnostics_refuse_the_wrong_number_of_axes_naming_the_argument(close_figures):
    figure, axes = plt.subplots(1, 2)
    with pytest.raises(ValueError, match="axes must hold 3 axes .* got 2"):
        plot_diagnostics(DIAGNOSTIC_HISTORY, axes=axes)


def test_diagnostics_refuse_an_empty_history(close_figures):
    with pytest.raises(ValueError, match="history is empty"):
        plot_diagnostics([])
