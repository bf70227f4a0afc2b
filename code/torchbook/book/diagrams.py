"""Pictures drawn from live objects: a tensor's storage, broadcasting, a module tree.

Chapters 1 and 2 draw these from the tensors, modules and measurements of
their own cells, so a picture stays true when the code changes. Shapes,
strides and registries are read through the objects' own methods
(``stride()``, ``named_parameters()``, ...); besides matplotlib, the module
calls torch only for ``torch.broadcast_shapes``, so the broadcasting picture
draws the result shape torch itself computes.

``show_error`` is the text counterpart: chapters that provoke an error on
purpose print it with this one helper, so every such message reads alike.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from torch import nn

# Colours shared by the pictures below: what is trained, what is only carried.
PARAMETER_COLOUR = "tab:blue"
BUFFER_COLOUR = "tab:orange"
SAVED_BUFFER_COLOUR = "tab:brown"
# a size-1 or missing dimension that broadcasting stretches
STRETCHED_COLOUR = "#fdd9a0"
KEPT_COLOUR = "#cfe3f5"  # a dimension whose size is already the result's
PAGE_WIDTH = 88  # columns of a printed line, as the book's code is formatted


def show_error(error: Exception) -> None:
    """Print ``TypeName: message``, each line wrapped to the page's 88 columns.

    A chapter shows the real message a mistake provokes; wrapping keeps a long one
    readable in HTML and PDF, and a message of several lines (``load_state_dict``
    lists its missing keys one per line) keeps its own line breaks.
    """
    message = f"{type(error).__name__}: {error}"
    for line in message.splitlines() or [""]:
        print(textwrap.fill(line, PAGE_WIDTH, subsequent_indent="    "))


def storage_positions(
    shape: Sequence[int], stride: Sequence[int], offset: int = 0
) -> list[int]:
    """Storage position of each element of a strided tensor, in row-major index order.

    Element (i0, i1, ...) lives at ``offset + i0 * stride[0] + i1 * stride[1] + ...``:
    this is all a view is, and why a view needs no copy.
    """
    positions = [offset]
    for size, step in zip(shape, stride, strict=True):
        positions = [p + i * step for p in positions for i in range(size)]
    return positions


def _flat_values(values: object) -> list:
    """The leaves of a nested list (what ``Tensor.tolist()`` returns), in order."""
    if not isinstance(values, list):
        return [values]
    return [leaf for item in values for leaf in _flat_values(item)]


def plot_memory_layout(
    tensors: Mapping[str, torch.Tensor], cmap: str = "viridis"
) -> Figure:
    """Draw each tensor's elements as a grid over the flat storage they live in.

    Per tensor (1-D to 3-D; a 3-D tensor is drawn as its first dimension's
    slices side by side): the grid of its elements by index, each labelled with
    its value and coloured by its position in storage, and a red line from each
    element to the next one in memory; below, the storage itself as a strip in
    memory order. Views of one tensor share the strip and its colours; a copy has
    a strip of its own. Shape and strides come from the tensors themselves.
    """
    figure, axes = plt.subplots(
        len(tensors),
        1,
        figsize=(7.5, 1.7 * len(tensors)),
        layout="constrained",
        squeeze=False,
    )
    colours = plt.get_cmap(cmap)
    for ax, (name, tensor) in zip(axes[:, 0], tensors.items(), strict=True):
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        if not 1 <= len(shape) <= 3:
            raise ValueError(
                f"plot_memory_layout: {name!r} has shape {shape}; draw 1-D to 3-D "
                "tensors"
            )
        positions = storage_positions(shape, stride, tensor.storage_offset())
        values = _flat_values(tensor.tolist())
        first, span = min(positions), max(max(positions) - min(positions), 1)
        slices, rows, cols = (1,) * (3 - len(shape)) + shape
        centres = {}  # storage position -> grid cell centre
        for index, (position, value) in enumerate(zip(positions, values, strict=True)):
            block, rest = divmod(index, rows * cols)
            row, col = divmod(rest, cols)
            x, y = block * (cols + 1) + col, -row
            shade = 0.1 + 0.85 * (position - first) / span
            colour, ink = colours(shade), "white" if shade < 0.6 else "black"
            ax.add_patch(
                plt.Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="white")
            )
            label = f"{value:g}" if isinstance(value, float) else str(value)
            ax.text(
                x + 0.5,
                y + 0.5,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color=ink,
                zorder=3,
            )
            centres[position] = (x + 0.5, y + 0.5)
            strip_x = position - first
            ax.add_patch(
                plt.Rectangle(
                    (strip_x, -rows - 0.6), 1, 1, facecolor=colour, edgecolor="white"
                )
            )
            ax.text(
                strip_x + 0.5,
                -rows - 0.1,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color=ink,
            )
        in_memory_order = [centres[p] for p in sorted(centres)]
        ax.plot(
            *zip(*in_memory_order, strict=True),
            color="tab:red",
            linewidth=0.6,
            alpha=0.6,
            zorder=2,
        )
        ax.plot(
            *in_memory_order[0], marker="o", color="tab:red", markersize=3, zorder=2
        )
        ax.text(-0.2, 1 - rows / 2, "by index", ha="right", va="center", fontsize=8)
        ax.text(-0.2, -rows - 0.1, "storage", ha="right", va="center", fontsize=8)
        ax.set_title(f"{name}: shape {shape}, stride {stride}", fontsize=9, loc="left")
        width = max(slices * (cols + 1) - 1, span + 1)
        ax.set_xlim(-4.5, width + 0.5)
        ax.set_ylim(-rows - 0.8, 1.2)
        ax.set_aspect("equal")
        ax.set_anchor("W")
        ax.axis("off")
    return figure


def plot_broadcasting(
    cases: Mapping[str, Sequence[tuple[str, Sequence[int]]]],
) -> Figure:
    """Draw how broadcasting lines up each case's operand shapes from the right.

    ``cases`` maps a title to its operands as ``(name, shape)``. One panel per
    case: a row per operand and one for the result, a column per dimension
    (counted from the right, as broadcasting counts). A dimension that is
    already the result's size is blue; a size-1 or missing one, which
    broadcasting stretches without copying, is orange and reads ``1→n`` or ``·→n``.
    The result shape comes from ``torch.broadcast_shapes``, so shapes that do not
    broadcast raise torch's own error.
    """
    figure, axes = plt.subplots(
        1,
        len(cases),
        figsize=(2.6 * len(cases), 1.9),
        layout="constrained",
        squeeze=False,
    )
    for ax, (title, operands) in zip(axes[0], cases.items(), strict=True):
        result = tuple(torch.broadcast_shapes(*(shape for _, shape in operands)))
        columns = len(result)
        rows = [*operands, ("result", result)]
        for row, (name, shape) in enumerate(rows):
            y = -row
            ax.text(
                -0.15,
                y + 0.45,
                name,
                ha="right",
                va="center",
                fontsize=8,
                weight="bold" if name == "result" else "normal",
            )
            for column in range(columns):
                # -columns .. -1: broadcasting counts from the right
                dim = column - columns
                size = shape[dim] if len(shape) >= -dim else None
                stretched = size != result[dim]
                text = (
                    str(size)
                    if not stretched
                    else f"{'·' if size is None else size}→{result[dim]}"
                )
                ax.add_patch(
                    plt.Rectangle(
                        (column, y),
                        0.95,
                        0.9,
                        facecolor=STRETCHED_COLOUR if stretched else KEPT_COLOUR,
                        edgecolor="0.4",
                        linestyle="--" if size is None else "-",
                        linewidth=0.8,
                    )
                )
                ax.text(
                    column + 0.475, y + 0.45, text, ha="center", va="center", fontsize=8
                )
        for column in range(columns):
            ax.text(
                column + 0.475,
                1.15,
                str(column - columns),
                ha="center",
                va="center",
                fontsize=7,
                color="0.4",
            )
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-2.2, columns + 0.1)
        ax.set_ylim(-len(rows) + 0.8, 1.5)
        ax.set_aspect("equal")
        ax.axis("off")
    return figure


def _tensor_label(name: str, tensor: torch.Tensor) -> str:
    """``name`` and shape, plus dtype if not floating (a bool mask, integer ids)."""
    shape = "×".join(map(str, tensor.shape)) or "scalar"
    dtype = (
        ""
        if tensor.is_floating_point()
        else f" {str(tensor.dtype).removeprefix('torch.')}"
    )
    return f"{name} {shape}{dtype}"


TREE_FONT = 7.5  # points
TREE_GAP_PT = 6.0  # space between neighbouring texts of a row, in points
TREE_FILL = 0.92  # a row of tensors wraps beyond this share of the room measured


def _module_tree_axes(height: float) -> tuple[Figure, tuple[plt.Axes, plt.Axes]]:
    """The tree panel and the parameter-count panel, with fixed margins."""
    figure, axes = plt.subplots(
        1,
        2,
        figsize=(7.5, height),
        width_ratios=(3.6, 1),
        sharey=True,
        gridspec_kw={
            "left": 0.01,
            "right": 0.94,
            "top": 0.99,
            "bottom": 0.4 / height,
            "wspace": 0.02,
        },
    )
    return figure, tuple(axes)


def _after(ax: plt.Axes, anchor: plt.Text, y: float, text: str, **style) -> plt.Text:
    """``text`` at data height ``y``, TREE_GAP_PT points right of ``anchor``'s box."""
    return ax.annotate(
        text,
        xy=(1.0, y),
        xycoords=(anchor, "data"),
        xytext=(TREE_GAP_PT, 0),
        textcoords="offset points",
        va="center",
        fontsize=TREE_FONT,
        **style,
    )


def plot_module_tree(model: nn.Module, collapse_repeats: bool = True) -> Figure:
    """Draw a module tree: each submodule's type, own tensors and parameter count.

    Read from ``named_modules()``, ``named_parameters()``, ``named_buffers()`` and
    ``state_dict()``: parameters (blue) are trained and saved; buffers are moved
    with the model but not trained, orange when ``state_dict`` leaves them out
    (``persistent=False``), brown when it saves them. A parameter that another
    name registered first is marked as tied. The bars count each submodule's
    parameters, every shared tensor once. With ``collapse_repeats``, the children
    of a container after its first that match the first's type and count are
    drawn as one line. A row of tensors too long for the panel wraps onto more
    lines, and the legend names only the kinds of tensor drawn.
    """
    first_name = {}  # id of each Parameter -> the name it was registered under first
    for name, parameter in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(parameter), name)
    saved = set(model.state_dict(keep_vars=True))
    modules = dict(model.named_modules())
    # text, type, labelled tensors, count
    rows: list[tuple[str, str, list[tuple[str, str]], int]] = []
    skipped_prefixes: list[str] = []
    for name, module in modules.items():
        if any(
            name == prefix or name.startswith(f"{prefix}.")
            for prefix in skipped_prefixes
        ):
            continue
        parent, _, leaf = name.rpartition(".")
        depth = name.count(".") + 1 if name else 0
        count = sum(p.numel() for p in module.parameters())
        if collapse_repeats and leaf.isdigit() and leaf != "0":
            first = modules[f"{parent}.0" if parent else "0"]
            siblings = [
                n
                for n in modules
                if n.rpartition(".")[0] == parent and n.rpartition(".")[2].isdigit()
            ]
            if (
                leaf == "1"
                and all(type(modules[n]) is type(first) for n in siblings[1:])
                and all(
                    sum(p.numel() for p in modules[n].parameters()) == count
                    for n in siblings[1:]
                )
            ):
                skipped_prefixes += siblings[1:]
                last = siblings[-1].rpartition(".")[2]
                rows.append(
                    (
                        "  " * depth + (leaf if last == leaf else f"{leaf}–{last}"),
                        f"{len(siblings) - 1} × {type(module).__name__}",
                        [(f"each as {parent}.0", "0.4")],
                        count * (len(siblings) - 1),
                    )
                )
                continue
        tensors = []
        for tensor_name, parameter in module.named_parameters(recurse=False):
            full = f"{name}.{tensor_name}" if name else tensor_name
            tied = (
                ""
                if first_name[id(parameter)] == full
                else f" = {first_name[id(parameter)]}"
            )
            tensors.append(
                (_tensor_label(tensor_name, parameter) + tied, PARAMETER_COLOUR)
            )
        for tensor_name, buffer in module.named_buffers(recurse=False):
            full = f"{name}.{tensor_name}" if name else tensor_name
            tensors.append(
                (
                    _tensor_label(tensor_name, buffer),
                    SAVED_BUFFER_COLOUR if full in saved else BUFFER_COLOUR,
                )
            )
        rows.append(
            ("  " * depth + (leaf or "(model)"), type(module).__name__, tensors, count)
        )

    # Widths are measured once at the figure's dpi to choose the columns and where
    # a long row wraps; the texts are then placed relative to each other, in points,
    # when drawn, so that no two collide whatever dpi the figure is saved at.
    figure, (tree_ax, _) = _module_tree_axes(height=1.0)
    renderer = figure.canvas.get_renderer()
    inch = figure.dpi

    def width(text: str, **style: object) -> float:
        drawn = tree_ax.text(0, 0, text, fontsize=TREE_FONT, **style)
        size = drawn.get_window_extent(renderer).width / inch
        drawn.remove()
        return size

    panel = tree_ax.get_window_extent(renderer).width / inch
    gap = TREE_GAP_PT / 72
    name_width = max(width(row[0], family="monospace") for row in rows)
    type_width = max(width(row[1]) for row in rows)
    room = TREE_FILL * (panel - name_width - type_width - 2 * gap)
    lines_of = []  # per row: its tensors, wrapped into lines that fit the panel
    for _, _, tensors, _ in rows:
        lines, used = [[]], 0.0
        for label, colour in tensors:
            extent = width(label)
            if lines[-1] and used + gap + extent > room:
                lines.append([])
                used = 0.0
            used += (gap if lines[-1] else 0.0) + extent
            lines[-1].append((label, colour))
        lines_of.append(lines)
    plt.close(figure)
    first_line = [sum(len(lines) for lines in lines_of[:i]) for i in range(len(rows))]
    line_count = first_line[-1] + len(lines_of[-1])

    height = 0.24 * (line_count + 2.5) + 0.4
    figure, (tree_ax, count_ax) = _module_tree_axes(height)
    names = [
        tree_ax.text(
            0.0,
            first_line[i],
            row[0],
            va="center",
            fontsize=TREE_FONT,
            family="monospace",
        )
        for i, row in enumerate(rows)
    ]
    widest_name = max(names, key=lambda text: len(text.get_text()))  # monospace
    types = [
        _after(tree_ax, widest_name, first_line[i], row[1], color="0.4")
        for i, row in enumerate(rows)
    ]
    renderer = figure.canvas.get_renderer()
    widest_type = max(types, key=lambda text: text.get_window_extent(renderer).width)
    for i, (_, _, tensors, count) in enumerate(rows):
        for offset, line in enumerate(lines_of[i]):
            previous = widest_type
            for label, colour in line:
                previous = _after(
                    tree_ax, previous, first_line[i] + offset, label, color=colour
                )
        shared = any(" = " in label for label, _ in tensors) and len(tensors) == 1
        count_ax.barh(
            first_line[i],
            count,
            height=0.6,
            color=PARAMETER_COLOUR,
            alpha=0.6 if i == 0 else 0.35,
            hatch="///" if shared else None,
        )
        count_ax.text(
            count,
            first_line[i],
            f" {count:,}" + (" shared" if shared else ""),
            va="center",
            fontsize=7,
        )
    drawn_colours = {colour for row in rows for _, colour in row[2]}
    legend = [
        (colour, meaning)
        for colour, meaning in (
            (PARAMETER_COLOUR, "parameter (trained, saved)"),
            (BUFFER_COLOUR, "buffer, not saved"),
            (SAVED_BUFFER_COLOUR, "buffer, saved"),
        )
        if colour in drawn_colours  # only the kinds this tree has
    ]
    previous = None
    for colour, meaning in legend:
        if previous is None:
            previous = tree_ax.text(
                0.0, -1.4, "■ " + meaning, color=colour, fontsize=TREE_FONT, va="center"
            )
        else:
            previous = _after(tree_ax, previous, -1.4, "■ " + meaning, color=colour)
    tree_ax.set_ylim(line_count - 0.4, -2.0)
    tree_ax.set_xlim(0, 1)
    tree_ax.axis("off")
    count_ax.set_xlabel("parameters")
    count_ax.set_xlim(0, max(row[3] for row in rows) * 1.5)
    count_ax.locator_params(axis="x", nbins=3)
    count_ax.tick_params(left=False, labelleft=False, labelsize=7)
    count_ax.xaxis.set_major_formatter("{x:,.0f}")
    count_ax.spines[["top", "right", "left"]].set_visible(False)
    return figure
