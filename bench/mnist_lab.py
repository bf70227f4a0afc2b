"""How much slower is the lab's training loop than a bare loop?

The lab's loop is ``train_epoch`` in ``torchbook.book.lab``, which ``make
gpu-results`` runs. Both train the lab's MLP from the same seeded weights, over
the same resident MNIST tensors in the same seeded order, for the same number of
steps (one epoch), with the same AdamW and cosine schedule, and both then compute
the test accuracy once. Runs alternate in one process (lab, bare, bare, lab, ...)
so that load from other processes hits both alike; the median of the
per-pair ratios is reported, with process CPU time beside wall time as a
second opinion (less sensitive to other processes on a shared machine).

What the lab does beyond the bare loop: the autocast context (disabled in
float32), the loss as a sum divided by the batch size (so accumulation is
exact), the per-step loss kept as a device tensor and read once per epoch,
and the epoch's timing and history.

Run: ``.venv/bin/python bench/mnist_lab.py [--pairs 5]``. The last line is
``lab training / bare loop time: <ratio>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import torch
import torch.nn.functional as F

from torchbook.book import lab
from torchbook.book.mnist import resident_batches
from torchbook.book.profiles import make_profile
from torchbook.device import synchronize


def steps_per_epoch(data: lab.MnistTensors, batch_size: int) -> int:
    return math.ceil(len(data.train_labels) / batch_size)


def run_lab(data: lab.MnistTensors, profile) -> tuple[float, float, float]:
    """One epoch of training via ``lab.lab_run``: (wall s, CPU s, accuracy)."""
    sizes = dataclasses.replace(profile.lab, epochs=1)
    synchronize(profile.device)
    started, cpu_started = time.perf_counter(), time.process_time()
    _, history = lab.lab_run(data, sizes, profile)
    synchronize(profile.device)
    return (
        time.perf_counter() - started,
        time.process_time() - cpu_started,
        history["epoch_accuracy"][-1],
    )


def run_bare(data: lab.MnistTensors, profile) -> tuple[float, float, float]:
    """The same epoch, bare: forward, mean loss, backward, step, schedule, zero."""
    sizes = profile.lab
    model = lab.fresh_model(sizes.hidden, profile.seed, profile.device)
    optimizer, scheduler = lab.lab_optimizer(
        "adamw", model, sizes, steps_per_epoch(data, sizes.batch_size)
    )
    synchronize(profile.device)
    started, cpu_started = time.perf_counter(), time.process_time()
    generator = torch.Generator().manual_seed(profile.seed)
    for images, labels in resident_batches(
        data.train_images, data.train_labels, sizes.batch_size, generator
    ):
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    with torch.no_grad():
        accuracy = (
            (model(data.test_images).argmax(1) == data.test_labels)
            .float()
            .mean()
            .item()
        )
    synchronize(profile.device)
    return time.perf_counter() - started, time.process_time() - cpu_started, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    args = parser.parse_args()
    profile = make_profile(args.profile)
    data = lab.load_data(profile.device)
    # warm-up: allocator, kernels, page cache
    (
        run_lab(data, profile),
        run_bare(data, profile),
    )
    ratios, cpu_ratios = [], []
    for pair in range(args.pairs):
        order = (run_lab, run_bare) if pair % 2 == 0 else (run_bare, run_lab)
        results = {run.__name__: run(data, profile) for run in order}
        (lab_s, lab_cpu, lab_acc), (bare_s, bare_cpu, bare_acc) = (
            results["run_lab"],
            results["run_bare"],
        )
        ratios.append(lab_s / bare_s)
        cpu_ratios.append(lab_cpu / bare_cpu)
        print(
            f"pair {pair + 1}: lab {lab_s:.2f} s ({lab_acc:.2%}), "
            f"bare {bare_s:.2f} s ({bare_acc:.2%}), "
            f"ratio {ratios[-1]:.3f}; CPU-time ratio {cpu_ratios[-1]:.3f}"
        )
    print(
        f"device {profile.device}, {torch.get_num_threads()} threads, "
        f"{steps_per_epoch(data, profile.lab.batch_size)} steps per run"
    )
    print(f"median CPU-time ratio: {statistics.median(cpu_ratios):.3f}")
    print(f"lab training / bare loop time: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
