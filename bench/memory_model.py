"""The memory model of torchbook.memory against measurements, over a grid of configurations.

For each configuration (model width and depth, batch, sequence length,
precision, activation checkpointing, dropout) it predicts the saved-activation
bytes and the peak of a training step, and measures both without the formula:
the ``saved_tensors_hooks`` count and the allocator's peak (the profiler's
memory records on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA) plus
the exact bytes of the parameters and AdamW's states.

Run: ``.venv/bin/python bench/memory_model.py`` (``--device cuda`` on a GPU).
The last line printed is ``largest memory prediction error: <x>%``, and the
script exits with an error when it is above ``MAX_ERROR``: chapter 7 shows its
own table, and this is where the bound is required over more configurations.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from torchbook.memory import (
    TrainingShape,
    peak_bytes,
    predict_memory,
    predict_peak,
    saved_activation_bytes,
    state_bytes,
    training_loss,
    training_step,
)
from torchbook.models import GPT, GPTConfig

MAX_ERROR = 0.10  # the bound on every prediction
VOCAB_SIZE = 256  # byte-level, as the book's small GPTs
MODELS = ((2, 4, 64), (4, 4, 128))  # (n_layer, n_head, d_model)
SHAPES = ((8, 128), (2, 512))  # (batch, sequence length)


def measure(
    config: GPTConfig, shape: TrainingShape, device: torch.device
) -> tuple[int, int]:
    """Measured saved-activation bytes and peak bytes of one steady training step."""
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(
        0, config.vocab_size, (shape.batch_size, shape.seq_len), device=device
    )
    targets = idx.roll(-1, dims=1)

    def step() -> None:
        training_step(model, optimizer, idx, targets, shape.precision)

    step()  # AdamW creates its states in the first step
    saved = saved_activation_bytes(
        model, lambda: training_loss(model, idx, targets, shape.precision)
    )
    states = state_bytes(model, optimizer)
    return saved, states["parameters"] + states["optimizer_states"] + peak_bytes(
        step, device
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(
        f"{'layers':>6s}{'width':>6s}{'batch':>6s}{'tokens':>7s}{'prec':>6s}{'ckpt':>5s}{'drop':>5s}"
        f" | {'activations MB pred / meas':>27s}{'err':>7s} | {'peak MB pred / meas':>20s}{'err':>7s}"
    )
    errors = []
    for (layers, heads, width), (
        batch,
        steps,
    ), precision, checkpointing, dropout in itertools.product(
        MODELS, SHAPES, ("fp32", "bf16"), (False, True), (0.0, 0.1)
    ):
        config = GPTConfig(
            VOCAB_SIZE,
            steps,
            layers,
            heads,
            width,
            dropout,
            activation_checkpointing=checkpointing,
        )
        shape = TrainingShape(
            batch, steps, precision, checkpointing, device_type=device.type
        )
        saved, peak = measure(config, shape, device)
        predicted_saved, predicted_peak = (
            predict_memory(config, shape).activations,
            predict_peak(config, shape),
        )
        saved_error, peak_error = predicted_saved / saved - 1, predicted_peak / peak - 1
        errors += [abs(saved_error), abs(peak_error)]
        print(
            f"{layers:>6d}{width:>6d}{batch:>6d}{steps:>7d}{precision:>6s}{'yes' if checkpointing else 'no':>5s}"
            f"{dropout:>5.1f} | {predicted_saved / 1e6:>13.2f} / {saved / 1e6:>10.2f}{saved_error:>+7.1%}"
            f" | {predicted_peak / 1e6:>9.2f} / {peak / 1e6:>8.2f}{peak_error:>+7.1%}",
            flush=True,
        )
    worst = max(errors)
    print(f"largest memory prediction error: {worst:.1%}")
    return 0 if worst <= MAX_ERROR else 1


if __name__ == "__main__":
    sys.exit(main())
