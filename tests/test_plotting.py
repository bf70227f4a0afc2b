"""Tests of the loss curves and of the pictures drawn from live objects.

Both (plotting.py, diagrams.py) are read back from the matplotlib objects they draw.
"""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")  # no display: draw into memory

import matplotlib.pyplot as plt  # noqa: E402

from torchbook.book.plotting import plot_diagnostics, plot_history  # noqa: E402

HISTORY = [
    {"step": 10, "loss": 3.0},
    {"step": 20, "loss": 2.5, "val_loss": 2.7},
    {"step": 30, "loss": 2.2},
    {"step": 40, "loss": 2.0, "val_loss": 2.3},
]


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
    # only rows that have val_loss
    assert list(lines["validation"].get_xdata()) == [
        20,
        40,
    ]
    assert list(lines["validation"].get_ydata()) == [2.7, 2.3]
    assert ax.get_xlabel() == "optimizer step" and "nats" in ax.get_ylabel()
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "train",
        "validation",
    ]


def test_reference_line_is_drawn_at_its_value_and_labelled(close_figures):
    figure = plot_history({"run": HISTORY}, reference_lines={"unigram baseline": 3.3})
    ax = figure.axes[0]
    horizontal = [line for line in ax.get_lines() if set(line.get_ydata()) == {3.3}]
    assert len(horizontal) == 1 and horizontal[0].get_linestyle() == "--"
    assert "unigram baseline" in [text.get_text() for text in ax.texts]
    # The legend lists curves only, not the baseline (labelled on the plot itself).
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "train",
        "validation",
    ]


def test_several_runs_get_one_colour_each_and_prefixed_labels(close_figures):
    figure = plot_history({"fp32": HISTORY, "bf16": HISTORY})
    lines = lines_by_label(figure)
    assert set(lines) == {
        "fp32: train",
        "fp32: validation",
        "bf16: train",
        "bf16: validation",
    }
    assert lines["fp32: train"].get_color() == lines["fp32: validation"].get_color()
    assert lines["fp32: train"].get_color() != lines["bf16: train"].get_color()


def test_drawing_into_a_given_axes_returns_its_figure(close_figures):
    figure, (left, right) = plt.subplots(1, 2)
    returned = plot_history({"run": HISTORY}, ax=right)
    assert returned is figure
    assert len(right.get_lines()) == 2 and len(left.get_lines()) == 0


DIAGNOSTIC_HISTORY = [
    {"step": 10, "loss": 3.0, "lr": 1e-3, "grad_norm": 4.0, "tokens_per_second": 900.0},
    {
        "step": 20,
        "loss": 2.5,
        "lr": 2e-3,
        "grad_norm": 0.8,
        "tokens_per_second": 1000.0,
        "val_loss": 2.7,
    },
    {
        "step": 30,
        "loss": 2.2,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_second": 1100.0,
    },
]


def test_diagnostics_draw_lr_grad_norm_and_throughput_one_panel_each(close_figures):
    figure = plot_diagnostics(DIAGNOSTIC_HISTORY)
    lr_ax, norm_ax, speed_ax = figure.axes
    assert [ax.get_ylabel() for ax in figure.axes] == [
        "learning rate",
        "gradient norm before clipping",
        "tokens per second",
    ]
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


# The pictures of chapters 1 and 2: strides, broadcasting and the module tree.

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchbook.book.diagrams import (  # noqa: E402
    BUFFER_COLOUR,
    PARAMETER_COLOUR,
    SAVED_BUFFER_COLOUR,
    STRETCHED_COLOUR,
    plot_broadcasting,
    plot_memory_layout,
    plot_module_tree,
    show_error,
    storage_positions,
)


def texts_of(ax) -> list[str]:
    return [text.get_text() for text in ax.texts]


def test_storage_positions_match_where_torch_reads_each_element():
    # A view of arange holds, at each index, the number of its storage position:
    # an independent record of where torch itself reads every element.
    storage = torch.arange(60)
    view = storage.view(3, 4, 5).permute(1, 0, 2)[1:, :, ::2]
    assert (
        storage_positions(view.shape, view.stride(), view.storage_offset())
        == view.flatten().tolist()
    )


def strip_values(ax, rows: int) -> list[str]:
    """The storage strip's labels, left to right (drawn at y = -rows - 0.1)."""
    strip = [
        text
        for text in ax.texts
        if abs(text.get_position()[1] - (-rows - 0.1)) < 1e-9
        and text.get_text() != "storage"
    ]
    return [
        text.get_text()
        for text in sorted(strip, key=lambda text: text.get_position()[0])
    ]


def test_memory_path_walks_rows_of_a_tensor_and_columns_of_its_transpose(close_figures):
    matrix = torch.arange(6).view(2, 3)
    figure = plot_memory_layout({"m": matrix, "m.t()": matrix.t()})
    row_path, column_path = (ax.get_lines()[0] for ax in figure.axes)
    # along each row
    assert list(row_path.get_xdata()) == [
        0.5,
        1.5,
        2.5,
        0.5,
        1.5,
        2.5,
    ]
    # down each column
    assert list(column_path.get_xdata()) == [
        0.5,
        0.5,
        0.5,
        1.5,
        1.5,
        1.5,
    ]
    assert "m.t(): shape (3, 2), stride (1, 3)" == figure.axes[1].get_title(loc="left")


def test_a_view_shares_the_storage_strip_and_a_copy_reorders_its_own(close_figures):
    matrix = torch.arange(6).view(2, 3)
    view_ax, copy_ax = plot_memory_layout(
        {"view": matrix.t(), "copy": matrix.t().contiguous()}
    ).axes
    assert strip_values(view_ax, rows=3) == ["0", "1", "2", "3", "4", "5"]
    assert strip_values(copy_ax, rows=3) == ["0", "3", "1", "4", "2", "5"]


def test_memory_layout_refuses_four_dimensions_naming_the_tensor(close_figures):
    with pytest.raises(ValueError, match="'big' has shape \\(1, 1, 1, 1\\)"):
        plot_memory_layout({"big": torch.zeros(1, 1, 1, 1)})


def test_broadcasting_picture_refuses_shapes_that_do_not_broadcast(close_figures):
    # torch.broadcast_shapes' own error, naming the size and dimension that clash
    with pytest.raises(RuntimeError, match="dimension of length 4 at -1"):
        plot_broadcasting({"clash": [("a", (2, 3)), ("b", (4,))]})


def test_broadcasting_picture_marks_stretched_dimensions_and_the_result(close_figures):
    figure = plot_broadcasting(
        {
            "scale": [("inv_rms", (2, 4, 1)), ("x", (2, 4, 8))],
            "mask": [("mask", (4, 4)), ("scores", (2, 2, 4, 4))],
        }
    )
    scale_ax, mask_ax = figure.axes
    assert "1→8" in texts_of(scale_ax) and texts_of(mask_ax).count("·→2") == 2
    stretched = [
        patch
        for patch in scale_ax.patches
        if patch.get_facecolor()[:3] == matplotlib.colors.to_rgb(STRETCHED_COLOUR)
    ]
    assert len(stretched) == 1  # only inv_rms's last dimension stretches
    # the result row, before the column numbers
    result_row = [text for text in texts_of(mask_ax)][-8:-4]
    assert result_row == ["2", "2", "4", "4"]


class TiedWithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer(
            "mask", torch.ones(2, 2, dtype=torch.bool), persistent=False
        )
        self.register_buffer("running", torch.zeros(3))


def test_module_tree_colours_parameters_and_both_kinds_of_buffer(close_figures):
    tree_ax = plot_module_tree(TiedWithBuffers()).axes[0]
    colour_of = {text.get_text(): text.get_color() for text in tree_ax.texts}
    # persistent=False: not in state_dict
    assert colour_of["mask 2×2 bool"] == BUFFER_COLOUR
    assert colour_of["running 3"] == SAVED_BUFFER_COLOUR
    assert colour_of["weight 5×3"] == PARAMETER_COLOUR
    # the head's weight is the embedding's
    assert "weight 5×3 = embed.weight" in colour_of


def test_module_tree_counts_a_tied_weight_once_and_collapses_repeated_layers(
    close_figures,
):
    model = TiedWithBuffers()
    tree_ax, count_ax = plot_module_tree(model).axes
    counts = [text.get_text().strip() for text in count_ax.texts]
    # 15 + 3 * 12, tie once
    assert counts[0] == f"{sum(p.numel() for p in model.parameters()):,}" == "51"
    assert "1–2" in [text.get_text().strip() for text in tree_ax.texts]
    assert "2 × Linear" in texts_of(tree_ax)
    # layers.2 is folded into 1–2
    assert not any(text.strip() == "2" for text in texts_of(tree_ax))
    expanded = plot_module_tree(model, collapse_repeats=False).axes[0]
    assert "2" in [text.get_text().strip() for text in expanded.texts]


class ManyBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        for index in range(4):  # too long for one row at the normal font size
            self.register_buffer(
                f"table_number_{index}", torch.zeros(256, 256), persistent=False
            )


def tree_text_boxes(figure, dpi: float) -> list[tuple[float, float, float, str]]:
    """(row centre, x0, x1, text) of the tree panel's texts, drawn at ``dpi``."""
    figure.set_dpi(dpi)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = []
    for text in figure.axes[0].texts:
        if text.get_text().strip():
            box = text.get_window_extent(renderer)
            boxes.append(((box.y0 + box.y1) / 2, box.x0, box.x1, text.get_text()))
    return boxes


def test_module_tree_wraps_a_long_row_of_tensors_inside_its_panel(close_figures):
    figure = plot_module_tree(ManyBuffers())
    tree_ax = figure.axes[0]
    labels = [
        text for text in tree_ax.texts if text.get_text().startswith("table_number_")
    ]
    assert len(labels) == 4  # every buffer is still named, at the normal font size
    assert {text.get_fontsize() for text in labels} == {7.5}
    boxes = tree_text_boxes(figure, 100)
    rows = {round(box[0]) for box in boxes if box[3].startswith("table_number_")}
    assert len(rows) > 1  # wrapped onto more than one line
    panel_right = tree_ax.get_window_extent(figure.canvas.get_renderer()).x1
    assert max(box[2] for box in boxes) <= panel_right


@pytest.mark.parametrize("dpi", [72, 110, 150, 300])
def test_module_tree_texts_keep_apart_at_any_dpi(close_figures, dpi):
    from torchbook.models import GPT, GPTConfig

    figure = plot_module_tree(
        GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, d_model=96))
    )
    boxes = sorted(tree_text_boxes(figure, dpi), key=lambda box: (box[0], box[1]))
    minimum_gap = 2 * dpi / 72  # 2 points, at this dpi
    collisions = [
        (left[3], right[3])
        for left, right in zip(boxes, boxes[1:], strict=False)
        if abs(left[0] - right[0]) < 1 and right[1] - left[2] < minimum_gap
    ]
    assert not collisions, collisions


def test_module_tree_legend_lists_only_the_kinds_drawn(close_figures):
    legend_of = {  # legend entries start with a square
        name: {t[2:] for t in texts_of(plot_module_tree(model).axes[0]) if t[0] == "■"}
        for name, model in (("buffers", ManyBuffers()), ("mixed", TiedWithBuffers()))
    }
    assert legend_of["buffers"] == {"parameter (trained, saved)", "buffer, not saved"}
    assert "buffer, saved" in legend_of["mixed"]


def test_show_error_names_the_type_and_wraps_long_messages_to_the_page(capsys):
    words = " ".join(f"word{i}" for i in range(40))  # about 280 characters
    show_error(ValueError(words))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and all(len(line) <= 88 for line in lines)
    assert lines[0].startswith("ValueError: word0 ")
    assert all(line.startswith("    word") for line in lines[1:])
    # nothing lost or reordered by the wrapping
    assert " ".join(" ".join(lines).split()) == f"ValueError: {words}"


def test_show_error_keeps_the_line_breaks_of_a_message_of_several_lines(capsys):
    show_error(RuntimeError("Error(s) in loading state_dict:\n\tMissing key(s): w"))
    assert capsys.readouterr().out.splitlines() == [
        "RuntimeError: Error(s) in loading state_dict:",
        "        Missing key(s): w",
    ]
